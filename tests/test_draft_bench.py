"""bench/draft's own plumbing, on the CPU: what its training processes are handed arrives whole."""

import sys

import pytest
from conftest import ROOT

if not (ROOT / "bench" / "draft").is_dir():  # inside the image (compose's test profile): no benches
    pytest.skip("bench/ is not in the image", allow_module_level=True)
sys.path.insert(0, str(ROOT / "bench"))
import draft  # noqa: E402


@pytest.mark.parametrize("export", [True, False])
def test_a_training_process_gets_its_config_and_the_sglang_export_options_whole(tmp_path, monkeypatch, export):
    """The export's options (`--to sglang --checkpoint ...`) are not this script's: argparse must never
    see them, or every served arm's training exits 2 before it starts."""
    got = []
    monkeypatch.setattr(draft.scenario, "sf_train", lambda *a: got.append(a) or 0)
    cfg, draft_json = tmp_path / "real.yaml", tmp_path / "draft.json"
    argv = draft.sftrain_argv(tmp_path, "real", cfg, draft_json, export)
    assert draft.main(argv) == 0
    expected = ("real", str(cfg), *(draft.sglang_export_args(tmp_path, "real", draft_json) if export else ()))
    assert got == [expected]
    assert ("--to" in expected) == export


def test_slot_distances_measure_each_pair_against_the_deeper_slot():
    import torch

    x, y = torch.randn(5, 8), torch.randn(5, 8)
    y = y - (y * x).sum(-1, keepdim=True) / x.square().sum(-1, keepdim=True) * x  # orthogonal to x per position
    h = torch.stack([x, 2 * x, y, torch.randn(5, 8)], 1)  # slots at layers 2, 4, 5, then the final state
    d = draft.slot_distances([h, h], [2, 4, 5])
    assert d["2-4"] == {"rel_l2": 0.5, "cosine": 1.0}
    assert abs(d["2-5"]["cosine"]) < 1e-4 and abs(d["4-5"]["cosine"]) < 1e-4
    expected = float(((2 * x - y).square().sum() / y.square().sum()).sqrt())
    assert abs(d["4-5"]["rel_l2"] - expected) < 1e-3


@pytest.mark.parametrize("depth, real", [(8, [2, 4, 5]), (16, [2, 8, 13])])
def test_the_extractions_capture_the_default_layers_of_the_target_on_disk(tmp_path, depth, real):
    """The draft config claims the saved target's default layers; the off-by-one control is each one
    deeper. `--target-layers` sets that depth, and a resumed call reads it from the saved target."""
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(f'{{"num_hidden_layers": {depth}}}')
    assert draft.capture_runs(tmp_path) == {"real": real, "off_by_one": [i + 1 for i in real]}
    assert draft.parse_args(["target"]).target_layers == draft.TARGET["num_hidden_layers"] == 16
