"""How the host's cores scale on the packer's kernel alone: P processes, each splitting bf16 words into
byte planes and entropy-coding the high plane (recipe.shards.codec), no files, no coordination.
What the packer can get from P workers at best on this host (hyperthreads, memory bandwidth, clocks).

  python bench/cores.py --procs 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipe.shards.codec import Codec, split_into  # noqa: E402


def work(seconds: float, q) -> None:
    rng = np.random.default_rng(os.getpid())
    w = (rng.standard_normal(8 << 20, dtype=np.float32) * 0.05).view(np.uint32) >> 16
    w = w.astype(np.uint16)
    hi, lo, tmp = np.empty(w.size, np.uint8), np.empty(w.size, np.uint8), np.empty_like(w)
    cctx = Codec(entropy_only=True).compressor()
    t0, raw = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        split_into(w, hi, lo, tmp)
        cctx.compress(hi)
        raw += w.nbytes
    q.put(raw / (time.perf_counter() - t0))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", default="1,2,4,8,16")
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    ctx = mp.get_context("fork")
    out = {"cpus": os.cpu_count(), "rows": []}
    for p in [int(x) for x in a.procs.split(",")]:
        q = ctx.SimpleQueue()
        procs = [ctx.Process(target=work, args=(a.seconds, q)) for _ in range(p)]
        for pr in procs:
            pr.start()
        rates = [q.get() for _ in procs]
        for pr in procs:
            pr.join()
        total = sum(rates) / 1e6
        out["rows"].append({"procs": p, "raw_MB_s": round(total), "per_proc": round(total / p)})
        print(json.dumps(out["rows"][-1]), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
