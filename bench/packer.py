"""Packer throughput on synthetic dumps (no GPU): raw MB/s through reassembly, validation, codec, store.

  python bench/packer.py --workers 1,2,4,8,16 --out-dir /dev/shm/pk     # the scaling table, one line per count
  python bench/packer.py --codec fp8 --workers 1,4,8 --out-dir /dev/shm/pk   # the fp8 codec's (shards.codec=fp8)
  python bench/packer.py --samples 160 --workers 2 --stream-budget-gb 1 --out-dir /tmp/pk   # memory over 12x the budget
Each sample is a 8B-shaped record (tokens x 4 slots x 4096, bf16 ~ N(0, 0.05): compresses 1.50x with the
default codec, real activations 1.45x, bench/codec.py), written as the SGLang hook writes it (byte
planes, split on the GPU there); the dump dir is on /dev/shm. By default the dumps are written first, so
only the packer is timed, over max(48, 12 x workers) samples unless --samples says; with
--stream-budget-gb a producer writes them while the packer runs, held to that budget as the server's
hook is, and the memory (PSS) of the packer's processes is sampled throughout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from recipe.capture import records  # noqa: E402
from recipe.capture.writer import CaptureWriter  # noqa: E402
from recipe.data import Sample  # noqa: E402
from recipe.packer import Packer, Progress  # noqa: E402
from recipe.shards import codec, fp8  # noqa: E402
from recipe.shards.codec import Codec  # noqa: E402
from recipe.shards.store import ShardStore  # noqa: E402


def pss_bytes(pid: int) -> int:
    """Memory of a process and its children (the packer's workers), each page counted once: the
    proportional set size (PSS). Plain RSS would count the pages the forked workers share with
    the parent once per worker."""
    total = 0
    for p in [pid] + [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]:
        try:
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            total += next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration):
            pass
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=0, help="default: max(48, 12 x workers)")
    ap.add_argument("--tokens", type=int, default=2300)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--workers", default="2", help="a count, or several: 1,2,4,8,16")
    ap.add_argument("--level", type=int, default=1)
    ap.add_argument("--level-only", action="store_true", help="zstd --level instead of the entropy-only tuning")
    ap.add_argument("--codec", default="lossless", choices=["lossless", "fp8"], help="shards.codec")
    ap.add_argument("--out-dir", default="/tmp/packer-bench")
    ap.add_argument("--stream-budget-gb", type=float, default=0, help="write dumps while packing, within this budget")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    base = rng.standard_normal((a.tokens, a.slots, a.hidden), dtype=np.float32) * 0.05
    h = (base.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation: realistic bit patterns
    planes = records.split_words(h)  # what the hook hands the writer
    for workers in [int(w) for w in a.workers.split(",")]:
        print(json.dumps(one_run(a, workers, a.samples or max(48, 12 * workers), planes, rng)), flush=True)


def one_run(a, workers: int, n_samples: int, planes, rng) -> dict:
    dump = Path(tempfile.mkdtemp(dir="/dev/shm"))
    out = Path(a.out_dir)
    shutil.rmtree(out, ignore_errors=True)
    samples = [
        Sample(
            f"s{i}", rng.integers(0, 100000, a.tokens).astype(np.int32), np.ones(a.tokens, np.uint8), "b", key=f"k{i}"
        )
        for i in range(n_samples)
    ]
    w = CaptureWriter(dump, int(a.stream_budget_gb * (1 << 30)) or 1 << 40, "hsx-")

    def produce():
        for s in samples:
            w.write_pass([f"hsx-{s.id}"], [0], [a.tokens], s.input_ids, planes)

    if not a.stream_budget_gb:
        produce()  # dumps first, so only the packer is timed
    store = ShardStore(out, {"format": "bench", "model_fingerprint": "x", "capture": {}})
    packer = Packer(
        dump,
        store,
        Codec(a.level, entropy_only=not a.level_only, kind=a.codec),
        [f"s{k}" for k in range(a.slots)],
        workers=workers,
        progress=Progress(n_samples, 1e9),
    )
    for s in samples:
        packer.expect(f"hsx-{s.id}", s)
        packer.responded(f"hsx-{s.id}")
    rss, done = [], threading.Event()

    def sample_rss():
        while not done.wait(0.5):
            rss.append(pss_bytes(os.getpid()))

    t0, cpu0 = time.perf_counter(), os.times()
    packer.start()
    threading.Thread(target=sample_rss, daemon=True).start()
    if a.stream_budget_gb:
        threading.Thread(target=produce, daemon=True).start()
    packer.drain()
    dt = time.perf_counter() - t0
    done.set()
    packer.stop()  # joins the workers: their CPU time is in os.times().children_*
    cpu = os.times()
    tot = store.write_manifest({})["totals"]
    store.close()
    shutil.rmtree(dump, ignore_errors=True)
    res = figures(a, workers, n_samples, tot, dt, cpu0, cpu, rss)
    shutil.rmtree(out, ignore_errors=True)
    return res


def figures(a, workers: int, n_samples: int, tot: dict, dt: float, cpu0, cpu, rss: list[int]) -> dict:
    """One run's rates, CPU use (workers' and the main process's) and memory, as the JSON prints them."""
    res = {
        "argv": sys.argv[1:],
        "workers": workers,
        "samples": n_samples,
        "raw_GB": round(tot["raw_bytes"] / 1e9, 3),
        "seconds": round(dt, 3),
        "raw_MB_per_s": round(tot["raw_bytes"] / dt / 1e6, 1),
        "raw_MB_per_s_per_worker": round(tot["raw_bytes"] / dt / 1e6 / workers, 1),
        "ratio": round(tot["raw_bytes"] / tot["stored_bytes"], 4),
        "cpus": os.cpu_count(),
        "loops": {"fp8": fp8.IMPL, "join": codec.JOIN},  # compiled (C) or numpy: the rates depend on it
        # where the time went: workers busy (user+sys over workers x seconds) and the main process
        "worker_cpu_user_s": round(cpu.children_user - cpu0.children_user, 2),
        "worker_cpu_sys_s": round(cpu.children_system - cpu0.children_system, 2),
        "worker_busy": round(
            (cpu.children_user + cpu.children_system - cpu0.children_user - cpu0.children_system) / (workers * dt), 3
        ),
        "main_cpu_s": round(cpu.user + cpu.system - cpu0.user - cpu0.system, 2),
    }
    if rss:
        q = len(rss) // 4 or 1
        res.update(
            pss_MB_first_quarter_max=round(max(rss[:q]) / 1e6),
            pss_MB_last_quarter_max=round(max(rss[-q:]) / 1e6),
            pss_MB_max=round(max(rss) / 1e6),
            pss_samples=len(rss),
        )
    if a.stream_budget_gb:
        res.update(
            stream_budget_GB=a.stream_budget_gb,
            data_over_budget=round(tot["raw_bytes"] / (a.stream_budget_gb * 2**30), 1),
        )
    return res


if __name__ == "__main__":
    main()
