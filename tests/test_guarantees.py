"""The guarantees, each tested so that it fails when the code is wrong (tests/mutate.py applies the
mutations these catch; tests/README.md lists them).

- the packer stores a sample only when every token is covered *and* the server has answered;
- values: NaN, +-Inf and all-zero slots are refused;
- the store's durability order (shard fsync, then index write, then index fsync), observed call by call;
- a crash between append and commit: the reopened store cuts the shard back to the index end;
- a torn index line is dropped; a wrong crc32 is reported by verify and raised by the reader;
- real ENOSPC (a fault-injecting file layer) at write, flush, fsync, index and manifest, each
  followed by a resume that stores every sample exactly once;
- the hook's stream-order snapshot of input_ids / orig_seq_lens (SGLang refills them in place);
- the format: an independent reader written from docs/FORMAT.md alone decodes what the recipe wrote,
  and `rebuild-index` scans shards without their index.
"""

import errno
import io
import json
import os
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
import zstandard
from conftest import compose
from conftest import small_run_cfg as cfg

from recipe.capture import records
from recipe.data import Sample
from recipe.main import RunFailed, run
from recipe.packer import Packer, check_planes
from recipe.shards import CorruptRecord, ShardReader
from recipe.shards.appender import AppendingStore
from recipe.shards.codec import Codec, split_planes
from recipe.shards.store import INDEX, ShardStore
from recipe.shards.verify import verify

IDENTITY = {"format": "t", "model_fingerprint": "m", "capture": {}}


# --- the packer ---------------------------------------------------------------------------


def packer_with_one_sample(tmp_path, n=10):
    dump = tmp_path / "dump"
    dump.mkdir()
    store = ShardStore(tmp_path / "out", IDENTITY)
    rng = np.random.default_rng(0)
    s = Sample("sid", rng.integers(0, 100, n).astype(np.int32), np.ones(n, np.uint8), "x:1", key="k")
    words = torch.randn(n, 2, 8).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    hidden = records.split_words(words)  # [2, n, slots, H]: as the hook hands them to the writer
    pk = Packer(dump, store, Codec(1), ["a", "b"], workers=1, dump_timeout_s=30, commit_every=1, poll_s=0.005)
    return pk, store, s, dump, hidden


def test_the_packer_waits_for_the_last_token_and_for_the_response(tmp_path):
    n = 10
    pk, store, s, dump, hidden = packer_with_one_sample(tmp_path, n)
    with pk:
        pk.expect("hsx-sid", s)
        records.write_record(dump, "hsx-sid", 0, s.input_ids[: n - 1], hidden[:, : n - 1], None)  # all but one token
        pk.responded("hsx-sid")
        time.sleep(0.3)
        assert pk.ok == 0 and not pk.failed, "packed with a token missing"
        records.write_record(dump, "hsx-sid", n - 1, s.input_ids[n - 1 :], hidden[:, n - 1 :], True)
        pk.drain(timeout_s=10)
    assert pk.ok == 1 and not pk.failed and store.records[0]["tokens"] == n


def test_the_packer_does_not_pack_before_the_response(tmp_path):
    pk, store, s, dump, hidden = packer_with_one_sample(tmp_path)
    with pk:
        pk.expect("hsx-sid", s)
        records.write_record(dump, "hsx-sid", 0, s.input_ids, hidden, True)
        time.sleep(0.3)
        assert pk.ok == 0 and not store.records, "packed before the client vetted the response"
        pk.responded("hsx-sid")
        pk.drain(timeout_s=10)
    assert pk.ok == 1


@pytest.mark.parametrize("where", [1, 7])  # in the first piece, in the second
def test_a_bad_value_in_any_piece_of_a_chunked_sample_is_refused(tmp_path, where):
    """Chunked prefill: one sample in two equal pieces; +Inf in either is found beside a huge finite
    value in the other (the pieces' rows are numbered through the sample, so the low plane's check of
    each piece looks at that piece's rows, not at rows another piece left open)."""
    n = 12
    pk, store, s, dump, _ = packer_with_one_sample(tmp_path, n)
    words = np.full((n, 2, 8), 0x3F00, np.uint16)  # 0.5: a low byte of 0
    words[where, 1, 3] = 0x7F80  # +Inf
    words[(where + 6) % n, 0, 5] = 0x7F00  # 2^127, finite, in the other piece: its high byte looks alike
    hidden = records.split_words(words)
    with pk:
        pk.expect("hsx-sid", s)
        records.write_record(dump, "hsx-sid", 0, s.input_ids[:6], hidden[:, :6], None)
        records.write_record(dump, "hsx-sid", 6, s.input_ids[6:], hidden[:, 6:], True)
        pk.responded("hsx-sid")
        pk.drain(timeout_s=10)
    assert pk.ok == 0 and list(pk.failed) == ["non_finite"] and not store.records


def test_a_dump_with_another_slot_count_is_refused_not_stored(tmp_path):
    """The packer's slot check: a dump of 3 slots under a 2-slot set is a failed sample, never `ok`."""
    n = 6
    pk, store, s, dump, _ = packer_with_one_sample(tmp_path, n)
    words = torch.randn(n, 3, 8).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    with pk:
        pk.expect("hsx-sid", s)
        records.write_record(dump, "hsx-sid", 0, s.input_ids, records.split_words(words), True)
        pk.responded("hsx-sid")
        pk.drain(timeout_s=10)
    assert pk.ok == 0 and list(pk.failed) == ["slot_count_mismatch"] and not store.records


def test_verify_names_a_loss_mask_whose_length_is_not_the_token_count(tmp_path):
    from recipe.shards.codec import Codec

    h = np.full((5, 2, 8), 0x3F80, np.uint16)
    frame = Codec(entropy_only=True).encode(
        {"id": "m", "key": "k", "dtypes": {"hidden": "bfloat16"}},
        {"input_ids": ("int32", np.arange(5, dtype=np.int32)), "loss_mask": ("uint8", np.ones(4, np.uint8)),
         "hidden": ("bfloat16", h)},
    )  # fmt: skip
    capture, model = {"slots": ["a", "b"], "layers": [1], "final": True}, {"name": "t", "path": "t", "hidden_size": 8}
    store = AppendingStore(tmp_path, {**IDENTITY, "capture": capture}, {"model": model})
    store.append("m", "k", frame, tokens=5, raw_bytes=h.nbytes)
    store.commit()
    store.write_manifest({})
    store.close()
    assert any("ids/mask length differ from 5 tokens" in p for p in verify(tmp_path))


@pytest.mark.parametrize(
    "value,reason", [(0x7F80, "non_finite"), (0xFF80, "non_finite"), (0x7FC0, "non_finite"), (None, "all_zero_slot_1")]
)
def test_bad_values_are_refused(value, reason):
    h = np.full((4, 3, 8), 0x3F80, np.uint16)  # 1.0 everywhere
    if value is None:
        h[:, 1] = 0x8000  # -0.0: all zero
    else:
        h[2, 1, 5] = value  # +Inf, -Inf, NaN
    hi, lo = split_planes(h)
    assert check_planes(hi.reshape(h.shape), lo.reshape(h.shape)) == reason


# --- the store's durability order -----------------------------------------------------------


class Recorder:
    """Records write/flush/fsync/rename calls on the store's files, in order."""

    def __init__(self, monkeypatch, root):
        self.events, self.root = [], root
        real_fsync, real_replace = os.fsync, os.replace

        def fsync(fd):
            self.events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
            return real_fsync(fd)

        def replace(a, b):
            self.events.append(("rename", os.path.basename(str(b))))
            return real_replace(a, b)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)

    def wrap(self, store):
        for attr, name in (("_shard", "shard"), ("_index", INDEX)):
            f = getattr(store, attr, None)
            if f is not None:  # an AppendingStore's own shard, once something was appended
                setattr(store, attr, _Spy(f, name, self.events))


class _Spy:
    def __init__(self, f, name, events):
        self._f, self._name, self._events = f, name, events

    def write(self, b):
        self._events.append(("write", self._name))
        return self._f.write(b)

    def flush(self):
        self._events.append(("flush", self._name))
        return self._f.flush()

    def __getattr__(self, k):
        return getattr(self._f, k)


def test_commit_makes_the_shard_durable_before_the_index_names_it(tmp_path, monkeypatch):
    rec = Recorder(monkeypatch, tmp_path)
    store = AppendingStore(tmp_path / "out", IDENTITY)
    store.append("a", "ka", b"frame-a", 1, 1)
    rec.wrap(store)
    rec.events.clear()
    store.append("b", "kb", b"frame-b", 1, 1)
    store.commit()
    ev = rec.events
    shard_fsync = ev.index(("fsync", store._shard_path.name))
    assert ev.index(("write", "shard")) < ev.index(("flush", "shard")) < shard_fsync
    assert shard_fsync < ev.index(("write", INDEX)) < ev.index(("fsync", INDEX)), ev
    store.close()


def test_the_packer_workers_shards_are_fsynced_before_the_index_names_them(tmp_path, monkeypatch):
    """The production path: worker processes append to their own shards, the packer commits."""
    rec = Recorder(monkeypatch, tmp_path)
    pk, store, s, dump, hidden = packer_with_one_sample(tmp_path)
    rec.wrap(store)
    with pk:
        pk.expect("hsx-sid", s)
        records.write_record(dump, "hsx-sid", 0, s.input_ids, hidden, True)
        pk.responded("hsx-sid")
        pk.drain(timeout_s=10)
    shard = store.records[0]["shard"]
    ev = rec.events
    assert ev.index(("fsync", shard)) < ev.index(("write", INDEX)) < ev.index(("fsync", INDEX)), ev


def record(sid: str, n: int = 64) -> bytes:
    """A real record frame holding sample `sid` (a resume reads the id in its header)."""
    from recipe.shards.codec import Codec

    h = np.arange(n * 2 * 8, dtype=np.uint16).reshape(n, 2, 8)
    return Codec(entropy_only=True).encode({"id": sid}, {"hidden": ("bfloat16", h)})


def key_of(n: int) -> str:
    """The key IDENTITY's run stores for sample_record's token ids: a resume indexes only such records."""
    from recipe.data import sample_key

    return sample_key(IDENTITY["model_fingerprint"], IDENTITY["capture"], np.arange(n, dtype=np.int32))


def sample_record(sid: str, key: str, n: int = 40) -> bytes:
    from recipe.shards.codec import Codec

    tensors = {"input_ids": ("int32", np.arange(n, dtype=np.int32)), "loss_mask": ("uint8", np.ones(n, np.uint8)),
               "hidden": ("bfloat16", np.arange(n * 2 * 8, dtype=np.uint16).reshape(n, 2, 8))}  # fmt: skip
    return Codec(entropy_only=True).encode({"id": sid, "key": key}, tensors)


def test_a_crash_between_append_and_commit_keeps_the_whole_record_and_cuts_the_torn_one(tmp_path):
    """kill -9 after appends the index never named: a whole record there is indexed from itself on
    reopen (nothing is redone that is already on disk); the torn one after it is cut, and only it."""
    store = AppendingStore(tmp_path / "out", IDENTITY)
    ka, kb, kc = key_of(40), key_of(500), key_of(300)
    a, b, c = sample_record("a", ka), sample_record("b", kb, 500), sample_record("c", kc, 300)
    store.append("a", ka, a, 40, 1)
    store.commit()
    store.append("b", kb, b, 500, 1)
    store._shard.write(c[: len(c) // 2])
    store._shard.flush()  # the bytes reached the file, the index never named them: then kill -9
    shard = store._shard_path
    assert shard.stat().st_size == len(a) + len(b) + len(c) // 2
    store._lock.close()  # the process is gone: its lock with it
    again = ShardStore(tmp_path / "out", IDENTITY)
    assert shard.stat().st_size == len(a) + len(b) and again.repaired == [(shard.name, len(c) // 2)]
    assert [r["id"] for r in again.records] == ["a", "b"] and kb in again.keys and kc not in again.keys
    again.close()


@pytest.mark.parametrize("short", [12, 5, 1])  # the whole check frame missing, part of it, its last byte
def test_a_record_cut_inside_its_check_frame_is_torn_and_cut(tmp_path, short):
    """A v3 record's last 12 bytes are its check frame: a crash there leaves a torn append, cut on
    reopen like any other, never foreign bytes the store leaves and works around."""
    store = AppendingStore(tmp_path / "out", IDENTITY)
    ka, kc = key_of(40), key_of(300)
    a, c = sample_record("a", ka), sample_record("c", kc, 300)
    from recipe.shards import framing

    cut = c[: len(c) - short]  # read alone: no whole record there, a torn one
    assert framing.record_at(cut, 0) is None and framing.torn(cut, 0) and framing.record_at(c, 0)[0] == len(c)
    store.append("a", ka, a, 40, 1)
    store.commit()
    store._shard.write(c[: len(c) - short])
    store._shard.flush()
    shard = store._shard_path
    store._lock.close()
    again = ShardStore(tmp_path / "out", IDENTITY)
    assert shard.stat().st_size == len(a) and again.repaired == [(shard.name, len(c) - short)]
    again.close()


def test_a_torn_index_line_is_dropped_and_its_record_indexed_again_from_the_shard(tmp_path):
    """The crash tore the line's append: its record, fsynced before it, is whole in the shard and
    inside the bytes the manifest counts, so the resume indexes it from itself rather than redo it."""
    run(cfg(tmp_path, limit=4))
    out = tmp_path / "out"
    raw = (out / INDEX).read_bytes()
    (out / INDEX).write_bytes(raw[: raw.rstrip(b"\n").rfind(b"\n") + 1] + raw.splitlines()[-1][:17])  # torn
    counts = run(cfg(tmp_path, limit=4))
    assert counts["already_stored"] == 4 and counts["ok_this_run"] == 0
    assert (out / INDEX).read_bytes() == raw
    assert verify(out) == [] and len(ShardReader(out)) == 4


def test_a_wrong_crc_is_reported_and_raised(tmp_path):
    run(cfg(tmp_path, limit=3))
    out = tmp_path / "out"
    lines = (out / INDEX).read_text().splitlines()
    rec = json.loads(lines[1])
    rec["crc32"] ^= 1  # the frame is intact, its recorded checksum is not
    lines[1] = json.dumps(rec)
    (out / INDEX).write_text("\n".join(lines) + "\n")
    problems = verify(out)
    assert len(problems) == 1 and rec["id"] in problems[0] and "crc32" in problems[0]
    with pytest.raises(CorruptRecord, match=rec["id"]):
        ShardReader(out).get(rec["id"])


# --- real ENOSPC at each step, then a resume that ends exactly once ---------------------------


class DiskFull:
    """A fault-injecting file layer: the Nth call of one kind of operation on the output directory's
    files raises ENOSPC, as a full disk does (in write, flush, fsync, or the manifest's rename)."""

    def __init__(self, monkeypatch, root, op, after):
        self.root, self.op, self.after, self.n = str(root), op, after, 0
        store_mod = __import__("recipe.shards.store", fromlist=["x"])
        real_open, real_fsync, real_replace = open, os.fsync, os.replace
        layer = self

        class File:
            def __init__(self, f, path):
                self._f, self._path = f, path

            def write(self, b):
                layer.hit("write", self._path)
                return self._f.write(b)

            def flush(self):
                layer.hit("flush", self._path)
                return self._f.flush()

            def __getattr__(self, k):
                return getattr(self._f, k)

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return self._f.__exit__(*a)

        def fopen(path, mode="r", *a, **k):
            f = real_open(path, mode, *a, **k)
            return File(f, str(path)) if "b" in mode and ("a" in mode or "w" in mode) else f

        def fsync(fd):
            layer.hit("fsync", os.readlink(f"/proc/self/fd/{fd}"))
            return real_fsync(fd)

        def replace(a, b):
            layer.hit("manifest", str(b))
            return real_replace(a, b)

        monkeypatch.setattr(store_mod, "open", fopen, raising=False)
        monkeypatch.setattr(store_mod.os, "fsync", fsync)
        monkeypatch.setattr(store_mod.os, "replace", replace)

    def hit(self, op, path):
        if op != self.op or not path.startswith(self.root):
            return
        if self.op == "index" or (self.op == "manifest" and not path.endswith("manifest.json")):
            return
        self.n += 1
        if self.n == self.after:
            raise OSError(errno.ENOSPC, "No space left on device", path)


@pytest.mark.parametrize("op,after", [("write", 5), ("flush", 3), ("fsync", 4), ("manifest", 1)])
def test_enospc_at_each_step_then_resume_exactly_once(tmp_path, monkeypatch, op, after):
    c = cfg(tmp_path, "shards.commit_every=1", "backend.batch_size=1", limit=10)
    with monkeypatch.context() as m:
        DiskFull(m, tmp_path / "out", op, after)
        with pytest.raises(RunFailed, match="output disk full|samples not done|failed"):
            run(c)
    assert not list((tmp_path / "out").glob(".*.tmp")) or op == "manifest"
    counts = run(c)  # space freed: the same command
    assert counts["ok"] == 10 and not counts["failed"]
    assert verify(tmp_path / "out") == [] and len(set(ShardReader(tmp_path / "out").ids)) == 10


def test_a_full_disk_mid_frame_is_reported_as_the_full_disk():
    """The sink fails inside zstd's stream: the OSError must come out (the packer turns it into a clean
    stop and a resume), not zstd's complaint about the cut-short frame (which the packer would take for
    a bug). Seen in CI, where the real full-filesystem test hit ENOSPC mid-frame."""

    class FullAfterOneWrite:
        def __init__(self):
            self.writes = 0

        def write(self, b):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return len(b)

    hidden = torch.randn(4096, 4, 256).to(torch.bfloat16).view(torch.int16).numpy()  # 8 MiB: many stream writes
    tensors = {"input_ids": ("int32", np.arange(4096, dtype=np.int32)), "hidden": ("bfloat16", hidden)}
    with pytest.raises(OSError) as e:
        Codec(1, "byteplane", True).encode_to(FullAfterOneWrite(), {"id": "x"}, tensors)
    assert e.value.errno == errno.ENOSPC


def test_enospc_on_the_index_write_then_resume_exactly_once(tmp_path, monkeypatch):
    from recipe.shards import store as store_mod

    real = store_mod.ShardStore.commit
    calls = {"n": 0}

    def commit(self, batch=None):
        batch = self.take_pending() if batch is None else batch
        calls["n"] += bool(batch)
        if calls["n"] == 3:  # the shards are fsynced, the index append fails
            self._fsync_shards({r["shard"] for r in batch})
            self._pending[:0] = batch
            raise OSError(errno.ENOSPC, "No space left on device", str(self.root / INDEX))
        return real(self, batch)

    c = cfg(tmp_path, "shards.commit_every=1", "backend.batch_size=1", limit=10)
    monkeypatch.setattr(store_mod.ShardStore, "commit", commit)
    with pytest.raises(RunFailed, match="output disk full"):
        run(c)
    monkeypatch.setattr(store_mod.ShardStore, "commit", real)
    counts = run(c)
    assert counts["ok"] == 10 and verify(tmp_path / "out") == []


# --- the hook's snapshot in stream order ------------------------------------------------------


def test_the_hook_snapshots_ids_before_sglang_refills_its_buffers(tmp_path):
    """SGLang overwrites forward_batch.input_ids in place for the next batch while the writer still
    holds this pass (overlap scheduling). The hook must have copied them when it was called."""
    from test_sglang_hook import ForwardMode, batch, dumped, hook

    hk = hook(tmp_path)
    gate = threading.Event()
    real = hk.writer.write_pass
    hk.writer.write_pass = lambda *a, **k: (gate.wait(10), real(*a, **k))[1]
    fb, final, aux = batch(ForwardMode.EXTEND, ["hsx-a", "hsx-b"], [5, 7], [0, 3], orig=[5, 20])
    want_ids = fb.input_ids.clone()
    hk(fb, final, aux)
    fb.input_ids.fill_(-1)  # the next batch's ids, written into the same buffer
    fb.orig_seq_lens.fill_(0)
    gate.set()
    hk.flush()
    got = dumped(tmp_path)
    assert np.array_equal(got[("hsx-a", 0)][1], want_ids[:5].numpy())
    assert np.array_equal(got[("hsx-b", 3)][1], want_ids[5:].numpy())
    assert got[("hsx-a", 0)][0]["last"] is True and got[("hsx-b", 3)][0]["last"] is False
    hk.close()


# --- the format, read by a reader written from docs/FORMAT.md alone ------------------------------


def doc_reader(root):
    """Only what docs/FORMAT.md says: index lines -> pread -> the record's frames decompressed
    across (stock zstd, not our raw-tail parser) -> u32 header_len, JSON header, tensors at
    offsets; byteplane = all high bytes, then all low bytes."""
    out = {}
    for line in (root / "index.jsonl").read_text().splitlines():
        rec = json.loads(line)
        with open(root / "shards" / rec["shard"], "rb") as f:
            f.seek(rec["offset"])
            frame = f.read(rec["length"])
        assert zlib.crc32(frame) == rec["crc32"]
        body = zstandard.ZstdDecompressor().stream_reader(io.BytesIO(frame), read_across_frames=True).read()
        (hlen,) = struct.unpack("<I", body[:4])
        header = json.loads(body[4 : 4 + hlen])
        tensors = {}
        for t in header["tensors"]:
            raw = body[4 + hlen + t["offset"] : 4 + hlen + t["offset"] + t["nbytes"]]
            if t["transform"] == "byteplane":
                half = len(raw) // 2
                words = [raw[half + i] | (raw[i] << 8) for i in range(half)]  # low | high << 8
                tensors[t["name"]] = (t["dtype"], t["shape"], words)
            else:
                tensors[t["name"]] = (t["dtype"], t["shape"], raw)
        out[rec["id"]] = (header["meta"], tensors)
    return out


def test_an_independent_reader_from_the_format_doc_decodes_the_shards(tmp_path, tiny_model_dir):
    """Compared with the model's own output, not with our reader: a bug made on both sides of the
    codec (say, byte planes swapped in encode and decode) must not cancel out."""
    from recipe.backends.hf import HFBackend

    run(cfg(tmp_path, "data.max_length=96", "backend.batch_size=1", limit=3))  # unpadded: bit-exact below
    out = tmp_path / "out"
    model = HFBackend(tiny_model_dir, [1, 2, 3], True, device="cpu")
    for sid, (meta, t) in doc_reader(out).items():
        assert meta["id"] == sid and meta["slots"] == ["layer_1", "layer_2", "layer_3", "final_post_norm"]
        ids = np.frombuffer(t["input_ids"][2], np.int32)
        truth = model.hidden_states([ids])[0]
        dtype, shape, words = t["hidden"]
        assert dtype == "bfloat16" and tuple(shape) == tuple(truth.shape)
        assert words == truth.view(torch.int16).reshape(-1).numpy().view(np.uint16).tolist()
        assert sum(t["loss_mask"][2]) == ShardReader(out).by_id[sid]["loss_tokens"] > 0


def test_rebuild_index_scans_shards_without_their_index(tmp_path):
    from recipe.shards.__main__ import rebuild_index

    run(cfg(tmp_path, "shards.max_shard_gb=0.00003", limit=6))
    out = tmp_path / "out"
    want = [json.loads(x) for x in (out / INDEX).read_text().splitlines()]
    got = rebuild_index(out)
    key = lambda r: (r["shard"], r["offset"])  # noqa: E731
    assert sorted(got, key=key) == sorted(want, key=key)


def test_a_real_full_filesystem_stops_the_run_and_the_resume_ends_exactly_once(tmp_path, monkeypatch):
    """A 1 MiB tmpfs as the output: the packer workers' own frame writes hit a real ENOSPC (no
    fault layer), the run stops with what to free; after the filesystem grows, the same run ends
    with every sample exactly once."""
    import subprocess

    small = tmp_path / "small"
    small.mkdir()
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root to mount a small tmpfs")
    try:
        c = compose(
            [
                f"output_dir={small / 'out'}",
                f"capture.dump_dir={tmp_path / 'shm'}",
                "data.limit=12",
                "log_every_s=1000",
                "shards.commit_every=1",
                "backend.batch_size=2",
            ]
        )
        with monkeypatch.context() as m:  # as if another process filled the disk after preflight
            m.setattr("recipe.preflight.check", lambda *a, **k: None)
            with pytest.raises(RunFailed, match="output disk full"):
                run(c)
        stored = len(ShardReader(small / "out")) if (small / "out" / "manifest.json").exists() else 0
        assert stored < 12
        subprocess.run(["mount", "-o", "remount,size=64m", str(small)], check=True)
        counts = run(c)
        assert counts["ok"] == 12 and not counts["failed"]
        assert verify(small / "out") == [] and len(set(ShardReader(small / "out").ids)) == 12
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
