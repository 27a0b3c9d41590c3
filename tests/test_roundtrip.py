"""capture -> packer -> shards -> reader, bit for bit; the HF backend against transformers itself."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import compose

from recipe.backends.hf import HFBackend
from recipe.capture.writer import CaptureWriter
from recipe.data import Sample
from recipe.main import run
from recipe.packer import Packer
from recipe.shards import CorruptRecord, HiddenStatesDataset, ShardReader
from recipe.shards.appender import AppendingStore
from recipe.shards.codec import Codec
from recipe.shards.store import ShardStore
from recipe.shards.verify import verify


def run_cfg(tmp_path, *extra):
    return compose(
        [f"output_dir={tmp_path / 'out'}", f"capture.dump_dir={tmp_path / 'shm'}", "log_every_s=1000", *extra]
    )


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The embedded default, with every tensor the backend produced recorded on the side."""
    tmp = tmp_path_factory.mktemp("run")
    cfg = run_cfg(tmp)
    produced = {}
    orig = HFBackend.hidden_states

    def recording(self, seqs):
        out = orig(self, seqs)
        for ids, h in zip(seqs, out):
            produced[np.asarray(ids, np.int32).tobytes()] = h.clone()
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(HFBackend, "hidden_states", recording)
        counts = run(cfg)
    return cfg, tmp / "out", counts, produced


def test_hf_backend_equals_transformers_output_hidden_states(tiny_model_dir, tokenizer):
    """The backend's rows == transformers' own output_hidden_states[i] at the configured indices."""
    from transformers import AutoModelForCausalLM

    layers = [0, 2, 3]
    be = HFBackend(tiny_model_dir, layers, final=True, device="cpu")
    ref = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 256, (n,), generator=g).numpy() for n in (7, 33, 20)]
    got = be.hidden_states(seqs)
    # 1. exact: transformers on the same right-padded batch, our slicing vs its hidden_states[i]
    ids = torch.zeros(3, 33, dtype=torch.long)
    att = torch.zeros(3, 33, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.as_tensor(s)
        att[i, : len(s)] = 1
    with torch.inference_mode():
        hs = ref(ids, attention_mask=att, output_hidden_states=True).hidden_states
    for i, (s, h) in enumerate(zip(seqs, got)):
        want = torch.stack([hs[k][i, : len(s)] for k in layers] + [hs[4][i, : len(s)]], dim=1)
        assert h.shape == (len(s), 4, 64)
        assert torch.equal(h, want)
    # 2. padding leaks nothing: each sequence alone, unpadded, agrees to bf16 rounding
    #    (a different batch shape takes other kernel blockings: a few ulps, never more)
    for s, h in zip(seqs, got):
        with torch.inference_mode():
            hs1 = ref(torch.as_tensor(s, dtype=torch.long)[None], output_hidden_states=True).hidden_states
        want = torch.stack([hs1[k][0] for k in layers] + [hs1[4][0]], dim=1)
        torch.testing.assert_close(h.float(), want.float(), rtol=1.6e-2, atol=2e-2)


def test_round_trip_is_bit_exact(default_run, tiny_model_dir):
    cfg, out, counts, produced = default_run
    assert counts["ok"] == counts["input"] == 40
    reader = ShardReader(out)
    from transformers import AutoTokenizer

    from recipe.data import build_plan

    plan = build_plan(cfg.data, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert len(produced) == len(plan.samples) == len(reader)
    for s in plan.samples:
        got = reader.get(s.id)
        want = produced[s.input_ids.tobytes()]
        assert got["hidden"].dtype == torch.bfloat16
        assert torch.equal(got["hidden"], want)
        assert np.array_equal(got["input_ids"].numpy(), s.input_ids)
        assert np.array_equal(got["loss_mask"].numpy(), s.loss_mask)
        assert got["meta"]["slots"] == ["layer_1", "layer_2", "layer_3", "final_post_norm"]


def test_manifest_records_provenance(default_run):
    _, out, _, _ = default_run
    m = json.loads((out / "manifest.json").read_text())
    assert m["capture"]["layers"] == [1, 2, 3] and m["capture"]["final_norm"] == "post"
    assert "entering decoder layer i" in m["capture"]["convention"]
    assert m["versions"]["torch"] and m["versions"]["transformers"]
    assert len(m["model_fingerprint"]) == 32 and m["tokenizer"]["chat_template_sha256"]
    assert m["data"]["sources"][0]["sha256"] and m["data"]["max_length"] == 1024
    assert m["counts"] == {
        "input": 40,
        "ok": 40,
        "ok_this_run": 40,
        "already_stored": 0,
        "skipped": {},
        "failed": {},
        "not_done": 0,
        "stored_total": 40,
        "stored_outside_this_input": 0,
    }


def test_resume_skips_what_is_stored(default_run):
    cfg, out, _, _ = default_run
    before = (out / "index.jsonl").read_bytes()
    counts = run(cfg)
    assert counts["already_stored"] == 40 and counts["ok_this_run"] == 0
    assert (out / "index.jsonl").read_bytes() == before
    assert verify(out) == []


def test_resume_with_other_layers_is_refused(default_run, tmp_path):
    cfg, out, _, _ = default_run
    from recipe.shards.store import ProvenanceMismatch

    with pytest.raises(ProvenanceMismatch, match="capture"):
        run(compose([f"output_dir={out}", f"capture.dump_dir={tmp_path}", "capture.layers=[1,3]"]))


def test_dataset_with_workers(default_run):
    _, out, _, _ = default_run
    ds = HiddenStatesDataset(out)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    n = sum(int(x["hidden"].shape[0]) for x in loader)
    assert n == sum(r["tokens"] for r in ds.reader.records)


def test_cli_verify_and_inspect(default_run):
    _, out, _, _ = default_run
    r = subprocess.run([sys.executable, "-m", "recipe.shards", "verify", str(out)], capture_output=True, text=True)
    assert r.returncode == 0 and "40 samples" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "recipe.shards", "inspect", "--json", str(out)], capture_output=True, text=True
    )
    assert json.loads(r.stdout)["samples"] == 40


def test_flipped_byte_is_named(default_run, tmp_path):
    import shutil

    _, out, _, _ = default_run
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    rec = ShardReader(bad).records[5]
    path = bad / "shards" / rec["shard"]
    b = bytearray(path.read_bytes())
    b[rec["offset"] + rec["length"] // 2] ^= 0x40
    path.write_bytes(bytes(b))
    problems = verify(bad)
    assert len(problems) == 1 and rec["id"] in problems[0] and rec["shard"] in problems[0]
    with pytest.raises(CorruptRecord, match=rec["id"]):
        ShardReader(bad).get(rec["id"])
    other = ShardReader(bad).records[6]["id"]
    assert ShardReader(bad).get(other)["hidden"].shape[0] > 0  # the rest reads fine
    r = subprocess.run([sys.executable, "-m", "recipe.shards", "verify", str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and rec["id"] in r.stdout


def test_a_shard_cut_short_is_named_and_what_precedes_the_cut_still_reads(default_run, tmp_path):
    import shutil

    _, out, _, _ = default_run
    bad = tmp_path / "cut"
    shutil.copytree(out, bad)
    recs = ShardReader(bad).records
    last = max((r for r in recs if r["shard"] == recs[0]["shard"]), key=lambda r: r["offset"])
    before = next(r for r in recs if r["shard"] == last["shard"] and r["offset"] < last["offset"])
    os.truncate(bad / "shards" / last["shard"], last["offset"] + last["length"] // 2)
    r = ShardReader(bad)  # the reader maps shard files: a short one must be refused, not read past its end
    with pytest.raises(CorruptRecord, match=f"{last['id']}.*truncated"):
        r.get(last["id"])
    got, want = r.get(before["id"]), ShardReader(out).get(before["id"])
    assert torch.equal(got["hidden"].view(torch.int16), want["hidden"].view(torch.int16))


def small_shards(tmp_path, n=6, tokens=1024, hidden=1024):
    """n samples of [tokens, 4, hidden] random bf16 words, every one different: (dir, id -> words)."""
    rng = np.random.default_rng(0)
    store = AppendingStore(tmp_path, {"format": "t", "model_fingerprint": "m", "capture": {}})
    want = {}
    for i in range(n):
        h = (rng.standard_normal((tokens, 4, hidden), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
        frame = Codec(entropy_only=True).encode(
            {"id": f"s{i}", "dtypes": {"hidden": "bfloat16"}},
            {"input_ids": ("int32", np.full(tokens, i, np.int32)), "hidden": ("bfloat16", h)},
        )
        store.append(f"s{i}", f"k{i}", frame, tokens=tokens, raw_bytes=h.nbytes)
        want[f"s{i}"] = h
    store.write_manifest({})
    store.close()
    return tmp_path, want


def test_threads_sharing_one_reader_get_their_own_samples(tmp_path):
    """The reader decodes into a buffer it keeps: shared between threads, one thread's sample would
    be joined from another's bytes (zstd and numpy release the GIL on large buffers)."""
    from concurrent.futures import ThreadPoolExecutor

    root, want = small_shards(tmp_path)  # 8 MB of bf16 words each
    r = ShardReader(root)

    def check(k):
        sid = f"s{k % 6}"
        return np.array_equal(r.get_numpy(sid)[1]["hidden"], want[sid])

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(check, range(48)))


def test_each_thread_decodes_with_its_own_zstd_context():
    """A zstd context decodes one stream at a time: threads sharing one interleave their streams
    (another sample's bytes, or a crash); one thread reuses its own (making one costs ~10 µs)."""
    import threading

    from recipe.shards import codec

    other = []
    t = threading.Thread(target=lambda: other.append(codec._decompressor()))
    t.start()
    t.join()
    assert codec._decompressor() is codec._decompressor() and other[0] is not codec._decompressor()


def test_a_samples_memory_is_reused_only_once_nothing_views_it(tmp_path):
    """The reader hands the memory of a sample the caller dropped to the next sample (no fresh pages
    per sample), but never while a view of it lives: a torch tensor, a reshaped numpy view."""
    import gc

    root, want = small_shards(tmp_path, n=4, tokens=256, hidden=512)
    r = ShardReader(root)
    kept = r.get("s0")["hidden"]  # a bf16 tensor over a view of the decoded words
    view = r.get_numpy("s1")[1]["hidden"][::2]
    gc.collect()
    for sid in ("s2", "s3", "s2", "s3"):
        got = r.get(sid)["hidden"]
        assert got.data_ptr() != kept.data_ptr() and not np.shares_memory(got.view(torch.int16).numpy(), view)
    assert np.array_equal(kept.view(torch.int16).numpy().view(np.uint16), want["s0"])
    assert np.array_equal(view, want["s1"][::2])
    del kept, view, got
    gc.collect()
    ptr = r.get("s2")["hidden"].data_ptr()  # dropped at once: its memory serves the next sample
    assert r.get("s3")["hidden"].data_ptr() == ptr


def test_a_forked_worker_decoding_into_recycled_memory_leaves_the_parents_samples_alone(tmp_path):
    """DataLoader fork workers inherit the reader with its free memory: each process's decodes must
    land in its own copy of it."""
    import gc
    import multiprocessing as mp

    root, want = small_shards(tmp_path, n=3, tokens=256, hidden=512)
    r = ShardReader(root)
    r.get_numpy("s0")  # dropped at once: its memory waits in the reader for the next sample
    gc.collect()
    ctx = mp.get_context("fork")
    go, ok = ctx.Event(), ctx.Value("b", 0)

    def child():
        go.wait(10)
        ok.value = int(np.array_equal(r.get_numpy("s1")[1]["hidden"], want["s1"]))

    proc = ctx.Process(target=child)
    proc.start()
    mine = r.get_numpy("s2")[1]["hidden"]  # the same free memory as the child's next sample
    go.set()
    proc.join(30)
    assert proc.exitcode == 0 and ok.value == 1
    assert np.array_equal(mine, want["s2"])


def mk_sample(i, n, rng):
    ids = rng.integers(0, 256, n).astype(np.int32)
    return Sample(
        id=f"s{i}", input_ids=ids, loss_mask=(np.arange(n) % 2).astype(np.uint8), source=f"t:{i}", key=f"k{i}"
    )


def packer_for(tmp_path, slots=2, start=True, **kw):
    store = ShardStore(tmp_path / "out", {"format": "t", "model_fingerprint": "m", "capture": {}})
    dump = tmp_path / "dump"
    dump.mkdir(exist_ok=True)
    packer = Packer(dump, store, Codec(), [f"s{k}" for k in range(slots)], workers=2, **kw)
    return store, dump, packer.start() if start else packer


def finish(store, packer, tmp_path):
    packer.drain(timeout_s=30)
    packer.stop()
    store.write_manifest({})
    store.close()
    return ShardReader(tmp_path / "out")


def test_chunked_records_reassemble(tmp_path):
    """One request over three passes, sharing passes with others (as SGLang chunked prefill does)."""
    rng = np.random.default_rng(0)
    a, b, c = mk_sample(0, 300, rng), mk_sample(1, 50, rng), mk_sample(2, 120, rng)
    H = {s.id: rng.integers(1, 30000, (len(s.input_ids), 2, 8)).astype(np.uint16) for s in (a, b, c)}
    store, dump, packer = packer_for(tmp_path, start=False)  # every piece on disk before its first scan
    w = CaptureWriter(dump, 1 << 30, "hsx-")
    for s in (a, b, c):
        packer.expect("hsx-" + s.id, s)
    # pass 1: all of b + a[0:78]; pass 2: a[78:206]; pass 3: a[206:300] + c
    w.write_pass(
        ["hsx-s1", "hsx-s0"],
        [0, 0],
        [50, 78],
        np.concatenate([b.input_ids, a.input_ids[:78]]),
        np.concatenate([H["s1"], H["s0"][:78]]),
    )
    w.write_pass(["hsx-s0"], [78], [128], a.input_ids[78:206], H["s0"][78:206])
    w.write_pass(
        ["hsx-s0", "HEALTH_CHECK_ab", "hsx-s2"],
        [206, 0, 0],
        [94, 1, 120],
        np.concatenate([a.input_ids[206:], [7], c.input_ids]),
        np.concatenate([H["s0"][206:], np.ones((1, 2, 8), np.uint16), H["s2"]]),
    )
    assert not list(dump.glob("HEALTH*"))  # not the recipe's request: never dumped
    packer.start()
    for s in (a, b, c):
        packer.responded("hsx-" + s.id)
    r = finish(store, packer, tmp_path)
    assert packer.ok == 3 and not packer.failed
    for s in (a, b, c):
        got = r.get_numpy(s.id)[1]
        assert np.array_equal(got["hidden"], H[s.id]) and np.array_equal(got["input_ids"], s.input_ids)
    assert list(dump.iterdir()) == []  # raw pieces are gone once durable


def test_packer_failures_are_counted(tmp_path):
    rng = np.random.default_rng(1)
    s = [mk_sample(i, 20, rng) for i in range(5)]
    store, dump, packer = packer_for(tmp_path, dump_timeout_s=0.3)
    w = CaptureWriter(dump, 1 << 30, "hsx-")
    for x in s:
        packer.expect("hsx-" + x.id, x)
    ok = rng.integers(1, 30000, (20, 2, 8)).astype(np.uint16)
    w.write_pass(["hsx-s0"], [0], [20], s[0].input_ids, ok)  # good
    wrong_ids = s[1].input_ids.copy()
    wrong_ids[3] += 1
    w.write_pass(["hsx-s1"], [0], [20], wrong_ids, ok)  # ids differ from what was sent
    nan = ok.copy()
    nan[4, 1, 2] = 0x7FC0
    w.write_pass(["hsx-s2"], [0], [20], s[2].input_ids, nan)  # NaN
    zero = ok.copy()
    zero[:, 1] = 0x8000  # -0.0 everywhere in slot 1
    w.write_pass(["hsx-s3"], [0], [20], s[3].input_ids, zero)
    # s4: the server answered but no dump ever came (a CUDA-graph replay looks like this)
    for x in s:
        packer.responded("hsx-" + x.id)
    r = finish(store, packer, tmp_path)
    assert packer.ok == 1 and r.ids == ["s0"]
    assert dict(packer.failed) == {"token_ids_mismatch": 1, "non_finite": 1, "all_zero_slot_1": 1, "no_dump": 1}


def test_values_are_checked_as_they_stream_past_and_a_refused_sample_leaves_no_bytes(tmp_path, monkeypatch):
    """The worker checks each read block of the planes on its way into the record (3 rows a block
    here, samples in 3 pieces): a NaN/Inf or an all-zero slot anywhere is found, a slot that is zero
    in some pieces only is not, and a refused sample's streamed bytes are cut off its shard again."""
    import recipe.packer.worker

    monkeypatch.setattr(recipe.packer.worker, "BLOCK", 3 * 2 * 8)  # before the workers fork
    rng = np.random.default_rng(3)
    s = [mk_sample(i, 30, rng) for i in range(5)]
    H = [rng.integers(1, 30000, (30, 2, 8)).astype(np.uint16) for _ in s]
    H[0][17, 1, 5] = 0x7FC0  # NaN in the second piece, mid-block
    H[1][:, 0] = 0x8000  # -0.0 in slot 0 everywhere
    H[2][:, 0] = 0
    H[2][29, 0, 3] = 0x0080  # slot 0 zero but for one tiny value in the last row (high byte 0): fine
    H[3][29, 1, 7] = 0xFF80  # -Inf, the very last value
    store = ShardStore(tmp_path / "out", {"format": "t", "model_fingerprint": "m", "capture": {}})
    dump = tmp_path / "dump"
    dump.mkdir()
    packer = Packer(dump, store, Codec(), ["s0", "s1"], workers=1).start()
    w = CaptureWriter(dump, 1 << 30, "hsx-")
    for x, h in zip(s, H):
        packer.expect("hsx-" + x.id, x)
        for a, b in [(0, 11), (11, 23), (23, 30)]:
            w.write_pass(["hsx-" + x.id], [a], [b - a], x.input_ids[a:b], h[a:b])
        packer.responded("hsx-" + x.id)
    r = finish(store, packer, tmp_path)
    assert dict(packer.failed) == {"non_finite": 2, "all_zero_slot_0": 1}
    assert sorted(r.ids) == ["s2", "s4"]
    for i in (2, 4):
        assert np.array_equal(r.get_numpy(f"s{i}")[1]["hidden"], H[i])
    shards = {rec["shard"] for rec in r.records}
    on_disk = sum((tmp_path / "out" / "shards" / name).stat().st_size for name in shards)
    assert on_disk == sum(rec["length"] for rec in r.records)  # not a byte of the refused samples


def test_capture_error_marker_fails_the_sample(tmp_path):
    rng = np.random.default_rng(2)
    s = mk_sample(0, 10, rng)
    store, dump, packer = packer_for(tmp_path)
    packer.expect("hsx-s0", s)
    CaptureWriter(dump, 1 << 30, "hsx-").write_error("hsx-s0", "RuntimeError: boom")
    finish(store, packer, tmp_path)
    assert dict(packer.failed) == {"capture_error": 1}
    assert "boom" in packer.examples["capture_error"][0]


def test_record_layout_is_the_documented_one_and_v1_records_still_read():
    """docs/FORMAT.md: frame A (compressed) then frame B (the low plane in raw 128 KiB blocks); stock
    zstd decompressing across both gives the v1 body; a v1 record (one frame) decodes the same."""
    import io
    import struct

    import zstandard

    from recipe.shards import codec
    from recipe.shards.codec import RAW_BLOCK, decode

    rng = np.random.default_rng(5)
    for n in (RAW_BLOCK // 16, RAW_BLOCK // 16 * 2 + 3):  # low plane: exactly one block; two and a bit
        h = rng.integers(0, 1 << 16, (n, 2, 8), dtype=np.uint16)
        ids = np.arange(n, dtype=np.int32)
        tensors = {"input_ids": ("int32", ids), "hidden": ("bfloat16", h)}
        rec = Codec().encode({"id": "x"}, tensors)
        tail = h.size
        blocks = -(-tail // RAW_BLOCK)
        frame_b, check = rec[len(rec) - 12 - (13 + 3 * blocks + tail) : -12], rec[-12:]
        assert frame_b[:5] == b"\x28\xb5\x2f\xfd\xe0" and struct.unpack("<Q", frame_b[5:13])[0] == tail
        pos, sizes = 13, []
        while pos < len(frame_b):  # 3-byte headers: size << 3 | type (0: raw) << 1 | last
            word = int.from_bytes(frame_b[pos : pos + 3], "little")
            sizes.append((word >> 3, (word >> 1) & 3, word & 1))
            pos += 3 + (word >> 3)
        full = [(RAW_BLOCK, 0, 0)] * (blocks - 1)
        assert pos == len(frame_b) and sizes == full + [(tail - RAW_BLOCK * (blocks - 1), 0, 1)]
        body = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(rec), read_across_frames=True).read()
        (hlen,) = struct.unpack("<I", body[:4])
        header = json.loads(body[4 : 4 + hlen])
        assert header["v"] == 3 and header["tail"] == tail
        words = h.reshape(-1)
        planes = np.concatenate([(words >> 8).astype(np.uint8), (words & 0xFF).astype(np.uint8)]).tobytes()
        assert body[4 + hlen :] == ids.tobytes() + planes
        # v3: a skippable frame (magic 0x184D2A50, size 4) with the low plane's crc32
        assert check[:8] == b"\x50\x2a\x4d\x18" + struct.pack("<I", 4)
        assert struct.unpack("<I", check[8:])[0] == codec.crc32(planes[len(planes) // 2 :])
        # the same record as v2 (no check frame) reads the same
        hb = json.dumps({**header, "v": 2}).encode()
        a_content = struct.pack("<I", len(hb)) + hb + body[4 + hlen : len(body) - tail]
        v2 = zstandard.ZstdCompressor(write_checksum=True).compress(a_content) + frame_b
        # the same body as a v1 record: one frame, no tail
        header.update(v=1)
        del header["tail"]
        hb = json.dumps(header).encode()
        v1 = zstandard.ZstdCompressor().compress(struct.pack("<I", len(hb)) + hb + ids.tobytes() + planes)
        for r in (rec, v1, v2):
            meta, got = decode(r)
            assert meta == {"id": "x"} and np.array_equal(got["hidden"], h) and np.array_equal(got["input_ids"], ids)


def test_a_frame_a_that_disagrees_with_its_header_is_corrupt():
    """zstd's reader would run on from frame A into frame B: a record whose frame A is short of what
    its header describes must be refused, not read with low bytes as high ones."""
    import struct

    import zstandard

    from recipe.shards.codec import decode

    h = np.arange(64, dtype=np.uint16).reshape(4, 2, 8)
    rec = Codec().encode({"id": "x"}, {"hidden": ("bfloat16", h)})
    body = zstandard.ZstdDecompressor().decompress(rec)  # frame A only
    short = zstandard.ZstdCompressor().compress(body[:-8])
    with pytest.raises(CorruptRecord, match="frame A holds"):
        decode(short + rec[len(rec) - (13 + 3 + 64 + 12) :])
    assert struct.unpack("<I", body[:4])[0] > 0


def test_verify_refuses_every_record_the_reader_refuses():
    """verify checks records with codec.check, which joins no planes into words: whatever the reader's
    decode refuses, check refuses in the same words (the broken records here carry their own crc32,
    as a packer's bug would write them), and a record decode reads, check passes with its header."""
    import struct

    import zstandard

    from recipe.shards import codec

    h = np.random.default_rng(3).integers(0, 1 << 16, (40, 4, 64), dtype=np.uint16)
    ids = np.arange(40, dtype=np.int32)
    good = Codec().encode({"id": "x"}, {"input_ids": ("int32", ids), "hidden": ("bfloat16", h)})
    b0, n = len(good) - 12 - (13 + 3 + h.size), h.size  # frame B: one raw block of the low plane, then the check
    body = zstandard.ZstdDecompressor().decompress(good)  # frame A's content
    (hlen,) = struct.unpack("<I", body[:4])
    header, rest = json.loads(body[4 : 4 + hlen]), body[4 + hlen :]

    def frame_a(head: dict, content: bytes) -> bytes:
        hb = json.dumps(head).encode()
        return zstandard.ZstdCompressor(write_checksum=True).compress(struct.pack("<I", len(hb)) + hb + content)

    def frame_b(low: bytes) -> bytes:
        block = ((len(low) << 3) | 1).to_bytes(3, "little")  # one raw block, the last
        check = codec.CHECK_MAGIC + struct.pack("<I", codec.crc32(low))
        return codec.ZSTD_MAGIC + b"\xe0" + struct.pack("<Q", len(low)) + block + low + check

    flipped = bytearray(good)
    flipped[b0 // 2] ^= 0xFF
    broken = {
        "a wrong crc32": (good, codec.crc32(good) ^ 1),
        "a byte of frame A": bytes(flipped),
        "frame B cut short": good[:-5],
        "bytes after frame B": good + bytes(7),
        "frame B's size field": good[: b0 + 5] + struct.pack("<Q", n - 1) + good[b0 + 13 :],
        "another format version": frame_a({**header, "v": 9}, rest) + good[b0:],
        "a low plane short of its tensor": frame_a({**header, "tail": n - 2}, rest + bytes(2))
        + frame_b(good[-12 - n : -14]),
        "no zstd frame": bytes(64),
        "a shape unlike its bytes": frame_a(
            {**header, "tensors": [{**header["tensors"][0], "shape": [39]}, *header["tensors"][1:]]}, rest
        )
        + good[b0:],
        "an unknown dtype": frame_a(
            {**header, "tensors": [{**header["tensors"][0], "dtype": "int33"}, *header["tensors"][1:]]}, rest
        )
        + good[b0:],
    }
    meta, _ = codec.decode(good, codec.crc32(good))
    assert codec.check(good, codec.crc32(good), codec.Recycler())["meta"] == meta == {"id": "x"}
    for what, rec in broken.items():
        rec, crc = rec if isinstance(rec, tuple) else (rec, codec.crc32(rec))
        with pytest.raises(CorruptRecord) as read:
            codec.decode(rec, crc, codec.Recycler())
        with pytest.raises(CorruptRecord) as checked:
            codec.check(rec, crc, codec.Recycler())
        assert str(checked.value) == str(read.value), what
        with pytest.raises(CorruptRecord) as counted:  # what verify calls: check, then the tokens
            codec.check_tokens(rec, crc, codec.Recycler())
        assert str(counted.value) == str(read.value), what


@pytest.mark.parametrize("join", ["compiled", "numpy"])
def test_both_plane_joins_give_the_stored_words(join, monkeypatch):
    """The reader joins planes in C where _join.c was built, with numpy otherwise: both must give the
    stored words, over a block boundary, an odd tail and the v1/non-tail path (contiguous planes)."""
    from recipe.shards import codec

    if join == "compiled" and codec._compiled_join is None:
        pytest.skip("recipe/shards/_join.c not built here (no C compiler at install time)")
    if join == "numpy":
        monkeypatch.setattr(codec, "_compiled_join", None)
    rng = np.random.default_rng(11)
    for n in (1, codec.RAW_BLOCK // 16, codec.RAW_BLOCK // 16 * 3 + 5):
        h = rng.integers(0, 1 << 16, (n, 2, 8), dtype=np.uint16)
        for tail in (True, False):
            rec = Codec(transform="byteplane").encode({"id": "x"}, {"hidden": ("bfloat16", h)})
            if not tail:  # one more tensor after it: `hidden` is then joined from frame A's two planes
                rec = Codec().encode({"id": "x"}, {"hidden": ("bfloat16", h), "ids": ("int32", np.zeros(3, np.int32))})
            _, got = codec.decode(rec, recycler=codec.Recycler())
            assert np.array_equal(got["hidden"], h), (n, tail)
    if join == "compiled":
        with pytest.raises(ValueError, match="want n, n, 2n"):
            codec._compiled_join(np.zeros(4, np.uint8), np.zeros(3, np.uint8), np.zeros(4, np.uint16))


def test_a_record_decoded_in_steps_is_the_stored_record_and_lets_its_pages_go(monkeypatch):
    """With a release callback (a reader's record of gigabytes) the last tensor's high plane is
    decompressed and joined a step at a time: the same words and tensors as a whole decode, over
    block and step boundaries, frame B's blocks released once joined; a flipped byte still fails the
    checksum (taken on the way, as each byte is first used)."""
    from recipe.shards import codec

    monkeypatch.setattr(codec, "STEP", 2 * codec.RAW_BLOCK)  # several steps on a small record
    rng = np.random.default_rng(5)
    for n in (3, codec.RAW_BLOCK // 16 * 2, codec.RAW_BLOCK // 16 * 5 + 7):  # within a block, steps exact, odd tail
        h = rng.integers(0, 1 << 16, (n, 2, 8), dtype=np.uint16)
        ids = np.arange(n, dtype=np.int32)
        rec = Codec().encode({"id": "x"}, {"input_ids": ("int32", ids), "hidden": ("bfloat16", h)})
        gone = np.zeros(len(rec), bool)

        def release(a, b):
            gone[a:b] = True

        meta, got = codec.decode(rec, codec.crc32(rec), codec.Recycler(), release)
        assert meta == {"id": "x"} and np.array_equal(got["hidden"], h) and np.array_equal(got["input_ids"], ids)
        blocks = -(-h.size // codec.RAW_BLOCK)  # frame B: each full block let go once joined
        b_start = len(rec) - 12 - (13 + 3 * blocks + h.size)
        assert gone[b_start + 13 : b_start + 13 + (blocks - 1) * (codec.RAW_BLOCK + 3)].all(), n
        for at in (40, len(rec) // 2, len(rec) - 5):  # in frame A's compressed bytes, anywhere, in frame B
            bad = bytearray(rec)
            bad[at] ^= 1
            with pytest.raises(CorruptRecord, match="crc32 mismatch"):
                codec.decode(bytes(bad), codec.crc32(rec), None, release)


def test_the_reader_reads_a_long_record_in_steps_as_it_reads_a_short_one(tmp_path, monkeypatch):
    import mmap

    from recipe.shards import codec
    from recipe.shards import reader as reader_mod

    root, want = small_shards(tmp_path, n=3, tokens=300, hidden=256)
    whole = {sid: ShardReader(root).get_numpy(sid)[1] for sid in want}
    monkeypatch.setattr(reader_mod, "STEPWISE_FROM", 0)  # every record counts as long
    stepwise, real = [], codec._decode_in_steps
    monkeypatch.setattr(codec, "_decode_in_steps", lambda *a: stepwise.append(1) or real(*a))
    stepped = ShardReader(root)
    for sid, h in want.items():
        a, b = whole[sid], stepped.get_numpy(sid)[1]
        assert np.array_equal(b["hidden"], h) and np.array_equal(a["hidden"], b["hidden"])
        assert np.array_equal(a["input_ids"], b["input_ids"])
    assert len(stepwise) == 3 or not hasattr(mmap, "MADV_DONTNEED")
