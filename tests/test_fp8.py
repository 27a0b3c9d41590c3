"""The fp8 storage codec (shards.codec=fp8): the bytes it stores are torch's own float8_e4m3fn codes of
each token's state in each slot over its scale, the compiled loops and numpy's agree to the byte, every
reader gives back bf16 and says which codec the set holds, a set never holds both codecs, and the
manifest's error per slot is the error of what was stored."""

import json

import numpy as np
import pytest
import torch
from conftest import compose

from recipe.main import run
from recipe.shards import ShardReader, fp8
from recipe.shards.codec import Codec, split_planes
from recipe.shards.store import ProvenanceMismatch
from recipe.shards.verify import verify


def bf16_words(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def edge_rows(width: int = 64) -> np.ndarray:
    """Rows that reach every branch: normal and subnormal codes, ties, zeros (signed), a zero row, the
    largest value, magnitudes that differ by 1e30 within a row, and negative values that round to zero."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal(width) * 10.0 ** rng.integers(-30, 30) for _ in range(40)]
    rows += [np.zeros(width), -np.zeros(width), np.r_[1e30, rng.standard_normal(width - 1)],
             np.r_[448.0, 1.0 * np.arange(width - 1) / 512], -np.abs(rng.standard_normal(width)) * 1e-6]  # fmt: skip
    ties = np.r_[448.0, (np.arange(width - 1) + 0.5) * 2.0**-9 * 448 / 448]  # exact halves between subnormals
    return np.stack(rows + [ties])


def reference(words: np.ndarray, width: int):
    """torch's float8_e4m3fn conversion of x * (448 / max|x|) (the division rounded once, in float32),
    and its dequantization to bf16."""
    x = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).float().reshape(-1, width).numpy()
    amax = np.abs(x).max(1)
    inv = np.where(amax > 0, np.float32(448) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    f = torch.from_numpy(np.clip(x * inv[:, None], -448, 448).astype(np.float32))
    codes = f.to(torch.float8_e4m3fn)
    scale = torch.from_numpy((amax / np.float32(448)).astype(np.float32))
    back = (codes.float() * scale[:, None]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return codes.view(torch.uint8).numpy().reshape(-1), scale.numpy(), back.reshape(-1)


@pytest.mark.parametrize("width", [64, 70])  # 70: a row the C loop's lanes of eight leave a remainder of
@pytest.mark.parametrize("impl", ["compiled", "numpy"])
def test_codes_and_values_are_torchs_own_float8_e4m3fn(impl, width, monkeypatch):
    if impl == "numpy":
        monkeypatch.setattr(fp8, "_c_quantize", None)
        monkeypatch.setattr(fp8, "_c_dequantize", None)
    elif fp8.IMPL != "compiled":
        pytest.skip("recipe/shards/_fp8.c was not built here")
    words = bf16_words(edge_rows(width))
    hi, lo = split_planes(words)
    exp, sm, scales, err, norm = fp8.quantize(hi, lo, width)
    want_codes, want_scales, want_back = reference(words, width)
    assert np.array_equal(fp8.joined(exp, sm, width), want_codes) and np.array_equal(scales, want_scales)
    back = fp8.dequantize(exp, sm, scales, width)
    assert np.array_equal(back, want_back)
    x = torch.from_numpy(words.view(np.int16)).view(torch.bfloat16).double().reshape(-1, width)
    y = torch.from_numpy(back.view(np.int16)).view(torch.bfloat16).double().reshape(-1, width)
    want_err, want_norm = ((y - x) ** 2).sum(1).numpy(), (x**2).sum(1).numpy()
    assert np.allclose(norm, want_norm, rtol=1e-4)
    assert (np.abs(err - want_err) <= 1e-3 * want_err + 1e-9 * want_norm).all()  # to 1e-9 of the row's norm


def cfg(tmp_path, *extra, out="out", limit=8):
    return compose([f"output_dir={tmp_path / out}", f"capture.dump_dir={tmp_path / 'shm'}", f"data.limit={limit}",
                    "log_every_s=1000", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """The same samples stored lossless and fp8."""
    tmp = tmp_path_factory.mktemp("fp8")
    run(cfg(tmp, out="lossless"))
    run(cfg(tmp, "shards.codec=fp8", out="fp8"))
    return tmp


def test_every_reader_gives_bf16_equal_to_the_lossless_values_quantized_and_names_the_codec(both):
    from recipe.shards.reader import HiddenStatesDataset
    from recipe.shards.trainers import SpecForgeDataset

    exact, packed = ShardReader(both / "lossless"), ShardReader(both / "fp8")
    assert (exact.codec, packed.codec) == ("lossless", fp8.NAME)
    assert verify(both / "fp8") == []
    for sid in exact.ids:
        a, b = exact.get(sid), packed.get(sid)
        assert b["hidden"].dtype == torch.bfloat16 and b["hidden"].shape == a["hidden"].shape
        words = a["hidden"].view(torch.int16).numpy().view(np.uint16)
        hi, lo = split_planes(words)
        exp, sm, scales, _, _ = fp8.quantize(hi, lo, words.shape[-1])
        want = fp8.dequantize(exp, sm, scales, words.shape[-1]).reshape(words.shape)
        assert np.array_equal(b["hidden"].view(torch.int16).numpy().view(np.uint16), want)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
    i = packed.ids.index(exact.ids[0])
    assert HiddenStatesDataset(both / "fp8")[i]["hidden"].dtype == torch.bfloat16
    assert SpecForgeDataset(both / "fp8")[i]["hidden_state"].dtype == torch.bfloat16


def test_the_manifest_records_the_codec_and_the_error_of_what_it_stored(both):
    m = json.loads((both / "fp8" / "manifest.json").read_text())
    assert (
        m["codec"]["name"] == fp8.NAME and json.loads((both / "fp8" / "identity.json").read_text())["codec"] == fp8.NAME
    )
    exact, packed = ShardReader(both / "lossless"), ShardReader(both / "fp8")
    err, norm = np.zeros(4), np.zeros(4)
    for sid in exact.ids:
        a, b = exact.get(sid)["hidden"].double(), packed.get(sid)["hidden"].double()
        err += ((b - a) ** 2).sum((0, 2)).numpy()
        norm += (a**2).sum((0, 2)).numpy()
    measured = np.sqrt(err / norm)
    stated = np.asarray([m["codec"]["rel_l2_error"][s] for s in packed.slots])
    assert np.allclose(stated, measured, rtol=1e-3) and (measured < 0.04).all(), (stated, measured)
    assert m["totals"]["raw_bytes"] / m["totals"]["stored_bytes"] > 2.0


def test_the_disk_check_counts_on_what_fp8_records_hold_and_passes_a_run_that_fits(both, tmp_path, monkeypatch):
    """fp8 stores a byte a value whatever the values: its disk check counts on that, not on lossless's
    ratio, which refused an fp8 run that fitted with room to spare (seen on an H100 host)."""
    import shutil as sh
    from types import SimpleNamespace

    from recipe import preflight

    t = json.loads((both / "fp8" / "manifest.json").read_text())["totals"]
    packed = ShardReader(both / "fp8")
    slots, hidden = packed.get(packed.ids[0])["hidden"].shape[1:]
    samples = [SimpleNamespace(input_ids=range(t["tokens"]))] + [SimpleNamespace(input_ids=())] * (t["samples"] - 1)
    raw, counted = preflight.estimate(samples, slots, hidden, "fp8")
    lossless = preflight.estimate(samples, slots, hidden)[1]
    assert raw == t["raw_bytes"] and t["stored_bytes"] <= counted < lossless
    free = (counted + lossless) // 2  # room for the fp8 set, not for the lossless count
    real, outputs = sh.disk_usage, tmp_path / "o"
    outputs.mkdir()

    def disk_usage(p):
        return real(p)._replace(free=free) if str(p).startswith(str(outputs)) else real(p)

    monkeypatch.setattr("recipe.preflight.shutil.disk_usage", disk_usage)
    run(cfg(tmp_path, "shards.codec=fp8", out="o/fp8"))
    assert len(ShardReader(outputs / "fp8")) == t["samples"]
    with pytest.raises(preflight.PreflightError, match="needs about"):
        run(cfg(tmp_path, out="o/lossless"))


def stated_and_measured(exact_dir, packed_dir) -> tuple[np.ndarray, np.ndarray]:
    """The manifest's error per slot, and the error of every sample the set holds against its lossless twin."""
    m = json.loads((packed_dir / "manifest.json").read_text())
    exact, packed = ShardReader(exact_dir), ShardReader(packed_dir)
    err, norm = np.zeros(len(packed.slots)), np.zeros(len(packed.slots))
    for sid in packed.ids:
        a, b = exact.get(sid)["hidden"].double(), packed.get(sid)["hidden"].double()
        err += ((b - a) ** 2).sum((0, 2)).numpy()
        norm += (a**2).sum((0, 2)).numpy()
    return np.asarray([m["codec"]["rel_l2_error"][s] for s in packed.slots]), np.sqrt(err / norm)


def test_after_a_resume_the_manifests_error_covers_the_whole_set(both, tmp_path):
    run(cfg(tmp_path, "shards.codec=fp8", limit=3))
    run(cfg(tmp_path, "shards.codec=fp8", limit=8))  # the resume stores the other five
    stated, measured = stated_and_measured(both / "lossless", tmp_path / "out")
    assert len(ShardReader(tmp_path / "out")) == 8
    assert np.allclose(stated, measured, rtol=1e-3), (stated, measured)


def test_a_set_never_holds_both_codecs(both, tmp_path):
    import shutil

    from recipe.shards.merge import MergeError, merge

    shutil.copytree(both / "lossless", tmp_path / "out")
    with pytest.raises(ProvenanceMismatch, match="codec"):
        run(cfg(tmp_path, "shards.codec=fp8", limit=10))
    with pytest.raises(MergeError, match="codec"):
        merge(tmp_path / "merged", [both / "lossless", both / "fp8"])
    run(cfg(tmp_path, limit=10))  # the set's own codec resumes it
    assert ShardReader(tmp_path / "out").codec == "lossless" and len(ShardReader(tmp_path / "out")) == 10


@pytest.mark.parametrize("pieces", [[15], [5, 7, 3], [1, 1, 13]])
def test_a_chunked_sample_is_stored_in_whole_groups_whatever_its_pieces(tmp_path, monkeypatch, pieces):
    """Chunked prefill dumps a sample in pieces whose ends fall anywhere; an fp8 record's groups start at
    every group_tokens-th token all the same, and read back as the lossless record quantized."""
    import io

    from recipe.capture import records
    from recipe.packer import worker
    from recipe.packer.messages import PackTask
    from recipe.shards.codec import decode

    monkeypatch.setattr(fp8, "GROUP_BYTES", 64)  # 4 tokens of 2 slots x 8 a group
    monkeypatch.setattr(worker, "BLOCK", 64)
    n, rng = sum(pieces), np.random.default_rng(1)
    words = bf16_words(rng.standard_normal((n, 2, 8)) * 10.0 ** rng.integers(-3, 3, (n, 2, 1)))
    ids = np.arange(n, dtype=np.int32)
    paths, at = [], 0
    for k in pieces:
        records.write_record(
            tmp_path, "hsx-s", at, ids[at : at + k], records.split_words(words[at : at + k]), at + k == n
        )
        paths.append((str(tmp_path / records.record_name("hsx-s", at)), k))
        at += k
    task = PackTask(0, "x", n, 2, 8, 2, tuple(paths), ids, np.ones(n, np.uint8), {"id": "s"})
    out = {}
    for kind in ("lossless", "fp8"):
        sink = io.BytesIO()
        assert isinstance(worker.pack(task, Codec(1, entropy_only=True, kind=kind), sink), int)
        out[kind] = decode(sink.getvalue())[1]["hidden"]
    assert np.array_equal(out["lossless"], words)
    hi, lo = split_planes(words)
    exp, sm, scales, _, _ = fp8.quantize(hi, lo, 8)
    assert np.array_equal(out["fp8"], fp8.dequantize(exp, sm, scales, 8).reshape(words.shape))


@pytest.mark.parametrize("codec", ["fp8", "lossless"])
def test_a_run_that_would_quantize_in_numpy_says_so_before_any_gpu_work(codec, tmp_path, monkeypatch, caplog):
    """Without _fp8.c the packer quantizes ~5x slower and may fall behind the GPU: the run's preflight
    names it, and states the stored size at the codec's own measured ratio."""
    from recipe import preflight

    monkeypatch.setattr(fp8, "IMPL", "numpy")
    with caplog.at_level("INFO", logger="recipe.preflight"):
        run(cfg(tmp_path, f"shards.codec={codec}", limit=2))
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "_fp8.c" in r.getMessage()]
    assert len(warned) == (codec == "fp8")
    stated = f"{preflight.MEASURED_RATIO[codec]:.2f}x {codec}"
    assert any(stated in r.getMessage() for r in caplog.records)


def test_numpy_quantizes_a_non_finite_block_quietly_and_finite_rows_as_before(monkeypatch):
    """A packer worker quantizes a block before the plane check refuses its sample as non_finite: numpy's
    loops must pass NaN and Inf without a warning (one per block in the worker's log) or an error, and
    leave the block's finite rows as they code alone."""
    import warnings

    monkeypatch.setattr(fp8, "_c_quantize", None)
    rows = edge_rows(64)
    words = bf16_words(rows)
    bad = words.copy().reshape(-1, 64)
    bad[3, 5], bad[7, 0] = 0x7FC0, 0xFF80  # NaN, -Inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = fp8.quantize(*split_planes(bad.reshape(-1)), 64)
    want = fp8.quantize(*split_planes(words), 64)
    keep = np.ones(len(rows), bool)
    keep[[3, 7]] = False
    assert np.array_equal(got[2][keep], want[2][keep])  # scales of the finite rows
    codes_got = fp8.joined(got[0], got[1], 64).reshape(-1, 64)
    codes_want = fp8.joined(want[0], want[1], 64).reshape(-1, 64)
    assert np.array_equal(codes_got[keep], codes_want[keep])
