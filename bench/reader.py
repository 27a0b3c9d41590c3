"""Reader speed: random access to one sample (warm page cache) and sequential throughput.

  python bench/reader.py --tokens 8192 --hidden 7168 --samples 4
Writes a shard set of bf16 samples [tokens, 4, hidden] (N(0, 0.05), the packer bench's data; the
default codec, or zstd --level) to --dir, then times ShardReader.get (decompress + inverse transform +
torch view) on random ids, a full sequential pass on one thread (the decode rate per core), and one
get() cut into its stages.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import zstandard as zstd  # noqa: E402

from recipe.shards import ShardReader, codec  # noqa: E402
from recipe.shards.appender import AppendingStore  # noqa: E402
from recipe.shards.codec import Codec  # noqa: E402


def decode_stages(r: ShardReader, rec: dict, reps: int = 5) -> dict:
    """Where one get() goes, each stage timed alone (best of reps): read (a view of the mapped
    shard), crc, frame_a (zstd into reused memory), join (the planes into output words
    whose memory is reused, as get() does, with codec.JOIN's join), join_fresh (into freshly
    allocated words: what the reuse saves), join_numpy (numpy's join, the fallback), and get()
    whole for comparison."""
    frame = r.read_frame(rec)
    body = np.empty(zstd.frame_content_size(frame), np.uint8)
    body[:] = 0  # paged in, as the reader's recycled memory is
    codec._read_into(zstd.ZstdDecompressor().stream_reader(frame, read_size=len(frame)), memoryview(body))
    header, _ = codec._header(body)
    n = int(np.prod(header["tensors"][-1]["shape"]))
    low, high = codec.raw_tail(frame, header["tail"]), body[-n:]
    recycler = codec.Recycler()

    def join_numpy():  # the fallback where _join.c is not built, on the same planes
        compiled, codec._compiled_join = codec._compiled_join, None
        try:
            codec._join(high, low, recycler.take(n))
        finally:
            codec._compiled_join = compiled

    steps = {
        "read": lambda: r.read_frame(rec),
        "crc": lambda: codec.crc32(frame),
        "frame_a": lambda: codec._read_into(
            zstd.ZstdDecompressor().stream_reader(frame, read_size=len(frame)), memoryview(body)
        ),
        "join": lambda: codec._join(high, low, recycler.take(n)),
        "join_fresh": lambda: codec._join(high, low, np.empty(n, np.uint16)),
        "join_numpy": join_numpy,
        "get_total": lambda: r.get(rec["id"]),
    }
    out = {}
    for name, f in steps.items():
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(1e3 * best, 1)
    return out


def write_set(root: Path, a, rng) -> None:
    """a.samples samples of a.tokens x 4 slots x a.hidden, bf16 of N(0, 0.05), in one shard set."""
    shutil.rmtree(root, ignore_errors=True)
    store = AppendingStore(
        root,
        {
            "format": "bench",
            "model_fingerprint": "x",
            "capture": {"slots": ["a", "b", "c", "f"]},
            "model": {"hidden_size": a.hidden},
        },
    )
    coder = Codec(a.level) if a.level else Codec(entropy_only=True)
    for i in range(a.samples):
        f = rng.standard_normal((a.tokens, 4, a.hidden), dtype=np.float32) * 0.05
        h = (f.view(np.uint32) >> 16).astype(np.uint16)
        meta = {"id": f"s{i}", "dtypes": {"input_ids": "int32", "loss_mask": "uint8", "hidden": "bfloat16"}}
        frame = coder.encode(
            meta,
            {
                "input_ids": ("int32", np.zeros(a.tokens, np.int32)),
                "loss_mask": ("uint8", np.ones(a.tokens, np.uint8)),
                "hidden": ("bfloat16", h),
            },
        )
        store.append(f"s{i}", f"k{i}", frame, tokens=a.tokens, raw_bytes=h.nbytes + 5 * a.tokens)
    store.write_manifest({})
    store.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--reads", type=int, default=8)
    ap.add_argument("--level", type=int, default=0, help="zstd level instead of the default entropy-only codec")
    ap.add_argument("--dir", default="/tmp/reader-bench")
    a = ap.parse_args()
    root = Path(a.dir)
    rng = np.random.default_rng(0)
    write_set(root, a, rng)
    r = ShardReader(root)
    for sid in r.ids:  # warm the page cache
        r.read_frame(r.by_id[sid])
    lat = []
    for k in range(a.reads):
        sid = r.ids[int(rng.integers(len(r.ids)))]
        t0 = time.perf_counter()
        r.get(sid)
        lat.append(time.perf_counter() - t0)
    raw = a.tokens * 4 * a.hidden * 2
    t0 = time.perf_counter()
    n = sum(int(x["hidden"].shape[0]) for x in r)
    seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    frame = r.read_frame(r.by_id[r.ids[0]])
    pread = time.perf_counter() - t0
    stages = decode_stages(r, r.by_id[r.ids[0]])
    res = {
        "argv": sys.argv[1:],
        "sample_raw_MB": round(raw / 1e6, 1),
        "frame_MB": round(len(frame) / 1e6, 1),
        "random_get_ms_median": round(1e3 * float(np.median(lat)), 1),
        "random_get_ms_min": round(1e3 * min(lat), 1),
        "read_frame_ms": round(1e3 * pread, 2),
        "sequential_raw_MB_s": round(a.samples * raw / seq / 1e6, 1),
        "ratio": round(raw / len(frame), 4),
        "decode_stages_ms": stages,
        "join": codec.JOIN,
        "tokens_read": n,
    }
    print(json.dumps(res))
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
