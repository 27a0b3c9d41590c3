"""bench/peers.py's same-data check, on the CPU: SpecForge's files laid out as its prepare_hidden_states.py
writes them (one per sample, padded to the batch's longest sample, the last partial batch dropped) are
matched to our shards by their first token ids, and a difference in ids, loss mask or states is seen, not
averaged away."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

if not (ROOT / "bench" / "peers.py").exists():  # inside the image (compose's test profile): no benches there
    pytest.skip("bench/ is not in the image", allow_module_level=True)
sys.path.insert(0, str(ROOT / "bench"))
import peers  # noqa: E402

from recipe.shards.export import specforge_file  # noqa: E402


def specforge_layout(tmp_path, data):
    """Our shards and, from their SpecForge export, SpecForge's file per data line."""
    run = [sys.executable, "-m", "recipe", "backend=hf", "model=tiny-llama", "model.path=builtin:tiny-llama"]
    run += ["capture.layers=[1,2,3]", f"data.sources=[{data}]", f"output_dir={tmp_path / 'out'}"]
    run += [f"capture.dump_dir={tmp_path / 'shm'}", f"hydra.run.dir={tmp_path / 'run'}"]
    subprocess.run(run, cwd=tmp_path, check=True, capture_output=True)
    export = [sys.executable, "-m", "recipe.shards", "export", "--to", "specforge"]
    subprocess.run([*export, str(tmp_path / "out"), str(tmp_path / "sf")], cwd=ROOT, check=True, capture_output=True)
    files = {}
    for line in open(tmp_path / "sf" / "samples.jsonl"):
        r = json.loads(line)
        files[r["id"]] = torch.load(tmp_path / "sf" / r["file"], weights_only=True)
    from recipe.data import sample_id, to_messages

    theirs = tmp_path / "theirs"
    for i, line in enumerate(open(data)):
        (theirs / specforge_file(i)).parent.mkdir(parents=True, exist_ok=True)
        torch.save(files[sample_id(to_messages(json.loads(line)))], theirs / specforge_file(i))
    return tmp_path / "out", theirs


def pad(x: dict, n: int) -> dict:
    z = torch.zeros(n, dtype=torch.long)
    out = {"input_ids": torch.cat([x["input_ids"], z]), "loss_mask": torch.cat([x["loss_mask"], z])}
    for k in ("aux_hidden_state", "hidden_state"):
        out[k] = torch.cat([x[k], torch.ones(1, n, x[k].shape[-1], dtype=x[k].dtype)], 1)
    return out


def test_same_data_check_cuts_batch_padding_and_sees_each_difference(tmp_path):
    data, _ = peers.write_data(tmp_path, 5, 100, 300)
    ours, theirs = specforge_layout(tmp_path, data)
    same = peers.compare(ours, theirs, data)
    assert (same["samples"], same["ids_equal"], same["loss_mask_equal"], same["within_bf16"]) == (5, 5, 5, 5)
    assert same["rel_l2_worst_per_slot"] == [0.0] * 4 and same["bit_equal_mean_per_slot"] == [1.0] * 4

    x = torch.load(theirs / specforge_file(0), weights_only=True)
    torch.save(pad(x, 9), theirs / specforge_file(0))  # SpecForge pads a batch to its longest sample
    y = torch.load(theirs / specforge_file(1), weights_only=True)
    y["loss_mask"][4] = 1 - y["loss_mask"][4]
    y["hidden_state"] = y["hidden_state"] * 1.01
    torch.save(y, theirs / specforge_file(1))
    z = torch.load(theirs / specforge_file(2), weights_only=True)
    z["input_ids"][-2] += 1  # past the matching key
    torch.save(z, theirs / specforge_file(2))
    (theirs / specforge_file(3)).unlink()  # as its dataloader drops a last partial batch
    (theirs / specforge_file(4)).rename(theirs / specforge_file(3))  # files numbered by batch position

    seen = peers.compare(ours, theirs, data, key_len=64)
    assert (seen["samples"], seen["missing_in_specforge"], seen["files_not_at_their_line"]) == (4, [3], 1)
    assert seen["tokens_padded"] == seen["tokens_real"] + 9 and seen["padding_unmasked"] == 0
    assert (seen["ids_equal"], seen["loss_mask_equal"], seen["loss_mask_diff_positions"]) == (3, 3, 1)
    assert seen["loss_mask_diff_examples"][0][0] == 4
    assert seen["within_bf16"] == 3 and 0.009 < seen["rel_l2_worst_per_slot"][3] < 0.011
    assert seen["rel_l2_worst_per_slot"][:3] == [0.0] * 3


def test_the_bf16_band_holds_a_bf16_copy_and_not_a_state_moved_past_it(tmp_path):
    """bf16's own band (HF bf16 against HF float32, x2, per slot) lets through SpecForge's states when
    they are ours, and sees one slot moved by more than the band."""
    from recipe.models import resolve_model_path

    data, _ = peers.write_data(tmp_path, 4, 100, 300)
    ours, theirs = specforge_layout(tmp_path, data)
    band = peers.bf16_band(resolve_model_path("builtin:tiny-llama"), ours, data, n=4, device="cpu")
    assert len(band) == 4 and all(0 < b < 0.5 for b in band)  # bf16 rounds: never 0, never gross

    y = torch.load(theirs / specforge_file(1), weights_only=True)
    H = y["hidden_state"].shape[-1]
    y["aux_hidden_state"][..., H : 2 * H] *= 1 + 2 * band[1]  # the middle slot only
    torch.save(y, theirs / specforge_file(1))
    seen = peers.compare(ours, theirs, data, band=band)
    assert (seen["samples"], seen["within_bf16_band"], seen["bf16_band_per_slot"]) == (4, 3, band)


def test_a_band_rebuilt_for_an_earlier_run_tokenizes_as_the_recipe_and_holds_its_worst_slot(tmp_path):
    """For a run whose files are gone: the band from the data's own tokenization equals the band from the
    shards' ids, the data is recognised by its token count, and a slot whose worst distance passed the
    band says so."""
    from recipe.models import resolve_model_path
    from recipe.shards import ShardReader

    data, _ = peers.write_data(tmp_path, 4, 100, 300)
    ours, _ = specforge_layout(tmp_path, data)
    model = resolve_model_path("builtin:tiny-llama")
    band = peers.bf16_band(model, ours, data, n=4, device="cpu")
    tokens = sum(int(r["input_ids"].numel()) for r in ShardReader(ours))
    earlier = {"arms": {"recipe": {"tokens": tokens}}, "same_data": {"samples": 4, "rel_l2_worst_per_slot": band}}
    held = peers.band_against(model, data, 4, [1, 2, 3], earlier, device="cpu")
    assert held["bf16_band_per_slot"] == band and held["same_data"] and held["every_sample_within_band"]
    assert held["same_weights"] is None  # that run kept no fingerprint
    earlier["model_fingerprint"] = peers.model_fingerprint(model)
    assert peers.band_against(model, data, 4, [1, 2, 3], earlier, device="cpu")["same_weights"]
    earlier["model_fingerprint"] = "another"

    earlier["same_data"]["rel_l2_worst_per_slot"] = [band[0], band[1] * 1.5, band[2], band[3]]
    earlier["arms"]["recipe"]["tokens"] = tokens + 1
    moved = peers.band_against(model, data, 4, [1, 2, 3], earlier, device="cpu")
    assert not moved["every_sample_within_band"] and not moved["same_data"] and moved["same_weights"] is False
