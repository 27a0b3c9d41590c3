"""Exporters: round trip against the reader, and the layer-id conventions written down."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import compose
from recipe.main import run
from recipe.shards import ShardReader
from recipe.shards.export import ExportError, export


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exp")
    run(compose([f"output_dir={tmp / 'out'}", f"capture.dump_dir={tmp / 'shm'}", "data.limit=6", "log_every_s=1000"]))
    return tmp / "out"


def test_specforge_round_trip(shards, tmp_path):
    n = export("specforge", shards, tmp_path / "sf")
    r = ShardReader(shards)
    info = json.loads((tmp_path / "sf" / "export_info.json").read_text())
    assert n == 6 and info["specforge_aux_layer_ids_output_of"] == [0, 1, 2]  # ours [1, 2, 3] entering
    for sid, rel in info["samples"].items():
        d = torch.load(tmp_path / "sf" / rel)
        x = r.get(sid)
        L = x["hidden"].shape[0]
        assert d["input_ids"].shape == (1, L) and torch.equal(d["input_ids"][0], x["input_ids"].long())
        assert torch.equal(d["loss_mask"][0], x["loss_mask"].long())
        assert torch.equal(d["hidden_state"][0], x["hidden"][:, 3])
        assert d["aux_hidden_state"].shape == (1, L, 3 * 64)
        assert torch.equal(d["aux_hidden_state"][0].view(L, 3, 64), x["hidden"][:, :3])


def test_speculators_refuses_the_post_norm_final_by_default(shards, tmp_path):
    with pytest.raises(ExportError, match="pre-norm"):
        export("speculators", shards, tmp_path / "sp")
    r = subprocess.run([sys.executable, "-m", "recipe.shards", "export", "--to", "speculators", str(shards),
                        str(tmp_path / "sp2")], capture_output=True, text=True)
    assert r.returncode != 0 and "pre-norm" in r.stderr


@pytest.mark.parametrize("mode,slots", [("drop", 3), ("keep-post-norm", 4)])
def test_speculators_round_trip(shards, tmp_path, mode, slots):
    from safetensors.torch import load_file

    export("speculators", shards, tmp_path / mode, final_norm=mode)
    r = ShardReader(shards)
    info = json.loads((tmp_path / mode / "export_info.json").read_text())
    assert info["hidden_states_slots"][:3] == ["input_to_layer_1", "input_to_layer_2", "input_to_layer_3"]
    assert len(info["hidden_states_slots"]) == slots
    for sid, rel in info["samples"].items():
        d = load_file(str(tmp_path / mode / rel))
        x = r.get(sid)
        assert torch.equal(d["token_ids"], x["input_ids"].long())
        assert torch.equal(d["hidden_states"], x["hidden"][:, :slots])
