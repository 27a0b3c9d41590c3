"""Where a packer worker's time goes, on one machine: (1) each stage's kernel alone, in ms per raw MB,
on one 8B-shaped sample; (2) cProfile of the worker's own `pack` over several samples.

  python bench/stages.py --samples 12
Data as bench/packer.py: 2,300 tokens x 4 slots x 4096, bf16 N(0, 0.05) (compresses like real
activations within 4 %: bench/codec.py), dump records written as the hook writes them, on /dev/shm.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipe.capture import records  # noqa: E402
from recipe.packer import ShardAppender, check_planes, pack  # noqa: E402
from recipe.packer.messages import PackTask  # noqa: E402
from recipe.shards.codec import Codec, crc32, split_into  # noqa: E402


def best_ms_per_mb(f, mb: float, repeat: int = 3) -> float:
    best = 1e9
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return round(1e3 * best / mb, 3)


def kernel_costs(words: np.ndarray) -> tuple[dict, dict]:
    """ms per raw MB of each kernel on one sample's words, and the planes' zstd ratios."""
    mb = words.nbytes / 1e6
    hi, lo, tmp = np.empty(words.size, np.uint8), np.empty(words.size, np.uint8), np.empty(words.size, np.uint16)
    flat = words.reshape(-1)
    split_into(flat, hi, lo, tmp)
    cctx = Codec(entropy_only=True).compressor()
    c_hi, c_lo = cctx.compress(hi), cctx.compress(lo)
    planes = hi.reshape(words.shape), lo.reshape(words.shape)
    kernels = {  # ms per raw MB of the sample
        "byteplane_split (now done on the GPU)": best_ms_per_mb(lambda: split_into(flat, hi, lo, tmp), mb),
        "check_planes": best_ms_per_mb(lambda: check_planes(*planes), mb),
        "zstd_high_plane": best_ms_per_mb(lambda: cctx.compress(hi), mb),
        "zstd_low_plane (now stored raw)": best_ms_per_mb(lambda: cctx.compress(lo), mb),
        "crc32_zlib_of_stored_bytes": best_ms_per_mb(lambda: (zlib.crc32(c_hi), zlib.crc32(lo)), mb),
        "crc32_used_of_stored_bytes": best_ms_per_mb(lambda: (crc32(c_hi), crc32(lo)), mb),
    }
    return kernels, {"high_plane": round(hi.size / len(c_hi), 4), "low_plane": round(lo.size / len(c_lo), 4)}


def profile_pack(words: np.ndarray, samples: int, rng) -> tuple[float, dict]:
    """`samples` hook records packed by the worker's own pack() on one core: seconds, and the top
    functions' share of the time."""
    T, S, H = words.shape
    dump = Path(tempfile.mkdtemp(dir="/dev/shm"))
    shard = Path(tempfile.mkdtemp()) / "shard.bin"
    try:
        planes = records.split_words(words)
        ids = rng.integers(0, 1000, T).astype(np.int32)
        tasks = []
        for i in range(samples):
            records.write_record(dump, f"hsx-{i}", 0, ids, planes, True)
            piece = (str(dump / records.record_name(f"hsx-{i}", 0)), T)
            tasks.append(PackTask(tid=i, shard=str(shard), n=T, slots=S, hidden=H, n_slots=S, pieces=(piece,),
                                  input_ids=ids, loss_mask=np.ones(T, np.uint8), meta={"id": str(i)}))  # fmt: skip
        codec = Codec(1, entropy_only=True)
        fd = os.open(shard, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for t in tasks:
            pack(t, codec, ShardAppender(fd))
        prof.disable()
        dt = time.perf_counter() - t0
        os.close(fd)
    finally:
        shutil.rmtree(dump, ignore_errors=True)
        shutil.rmtree(shard.parent, ignore_errors=True)
    st = pstats.Stats(prof, stream=io.StringIO())
    total = sum(v[2] for v in st.stats.values())  # tottime over every function
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:8]
    return dt, {f"{fn[2]} ({Path(fn[0]).name}:{fn[1]})": round(v[2] / total, 3) for fn, v in top}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=12)
    a = ap.parse_args()
    T, S, H = 2300, 4, 4096
    rng = np.random.default_rng(0)
    words = ((rng.standard_normal((T, S, H), dtype=np.float32) * 0.05).view(np.uint32) >> 16).astype(np.uint16)
    kernels, ratios = kernel_costs(words)
    dt, share = profile_pack(words, a.samples, rng)
    rate = round(a.samples * words.nbytes / 1e6 / dt, 1)
    res = {"argv": sys.argv[1:], "kernels_ms_per_raw_MB": kernels, "ratios": ratios,
           "pack_raw_MB_s_one_core": rate, "pack_time_share_top": share}  # fmt: skip
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
