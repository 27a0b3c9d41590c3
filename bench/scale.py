"""The cost of growth on the CPU: time and peak RSS of what a user runs on a set, against its size.

    python bench/scale.py sets --sizes 10000,100000,1000000 --out scale.json    # 64 jobs merged, then each op
    python bench/scale.py long --tokens 131072 --hidden 2048 --out long.json    # one long sample: packer, reader
    python bench/scale.py huge --chars 20000000 --out huge.json                 # one huge record planned
    python bench/scale.py verify --shapes 200000x16x8,160x2048x4096 --out v.json  # verify against sample size

`sets`: N samples written as 64 job sets (the real ShardStore, index and records; small samples of
16 tokens x 4 slots x hidden 8, so the index and the per-record work dominate, as in a set of 1M short
chats), merged into one (`recipe.shards.merge`, timed), then in a fresh process each: open (ShardReader),
resume plan (ShardStore's checks + the keys left to do), inspect, verify (in one process, then over 2
worker processes). Peak RSS is each process's own ru_maxrss, and its largest child's (a verify's
workers; a spawned child's figure includes its parent's image as forked, before exec). `long`: one
sample through the real packer (its worker process) and the reader; peak RSS against the sample's
raw size. `huge`: one record whose reply is --chars characters of code-like words,
planned (read, rendered, tokenized, cut to max_length 2048) by `recipe.data.build_plan` with the tiny
byte tokenizer in a fresh process: time and peak RSS. `verify`: per shape SAMPLESxTOKENSxHIDDEN, one set
of them verified in a fresh process, in one process and over 2 workers, beside `zstd_floor`: zstd alone
decoding each record's compressed frame (its low plane is stored raw), nothing checked, timed after the
index is read: what one frame per sample, which random access by id needs, costs at the least; and
`read_all`: the reader's decode of every sample, planes joined into words, timed after the open. `sets`
measures the floor too.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

T, SLOTS, H, JOBS = 16, 4, 8, 64
CAPTURE = {"layers": [1, 2, 3], "final": True, "slots": ["layer_1", "layer_2", "layer_3", "final_post_norm"]}
IDENTITY = {"format": "bench-scale", "model_fingerprint": "x", "capture": CAPTURE | {"convention": "residual_in"}}


def build(root: Path, n: int, jobs: int = JOBS, tokens: int = T, hidden: int = H, sd: float = 1.0) -> float:
    """n samples as `jobs` job sets under root/job-i, their states bf16 of N(0, sd), one array shared by
    every sample; returns the seconds it took."""
    from recipe.shards.appender import AppendingStore
    from recipe.shards.codec import Codec

    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, SLOTS, hidden), dtype=np.float32) * sd
    h = (x.view(np.uint32) >> 16).astype(np.uint16)
    del x
    model = {"model": {"name": "bench", "hidden_size": hidden, "num_layers": 4}}
    codec, t0 = Codec(entropy_only=True), time.perf_counter()
    ids, mask = np.arange(tokens, dtype=np.int32), np.ones(tokens, np.uint8)
    for j in range(jobs):
        store = AppendingStore(root / f"job-{j}", IDENTITY, model)
        for i in range(j, n, jobs):
            sid = f"{i:024x}"
            meta = {"id": sid, "key": f"k{sid}", "dtypes": {"hidden": "bfloat16", "input_ids": "int32"}}
            tensors = {
                "input_ids": ("int32", ids),
                "loss_mask": ("uint8", mask),
                "hidden": ("bfloat16", h),
            }
            store.append(sid, f"k{sid}", codec.encode(meta, tensors), tokens=tokens, raw_bytes=h.nbytes)
            if len(store._pending) >= 8192:
                store.commit()
        store.commit()
        store.write_manifest({})
        store.close()
    return time.perf_counter() - t0


OPS = {
    "open": "from recipe.shards import ShardReader; r = ShardReader(ROOT); n = len(r.ids)",
    "resume_plan": (
        "from recipe.shards.store import ShardStore, read_identity; s = ShardStore(ROOT, read_identity(Path(ROOT))); "
        "todo = [k for k in (r['key'] for r in s.records) if k not in s.keys]; s.close()"
    ),
    "inspect": "from recipe.shards.__main__ import inspect; inspect(Path(ROOT))",
    "verify": "from recipe.shards.verify import verify; assert verify(Path(ROOT)) == []",
    "verify_2_workers": "from recipe.shards.verify import verify; assert verify(Path(ROOT), workers=2) == []",
    "zstd_floor": (
        "import zstandard; from recipe.shards import ShardReader; r = ShardReader(ROOT); "
        "d = zstandard.ZstdDecompressor(); frames = [r.read_frame(x) for x in r.records]; "
        "t1 = time.perf_counter(); n = sum(len(d.decompress(f)) for f in frames); "  # frame A: its first frame
        "extra = {'decode_s': round(time.perf_counter() - t1, 3)}"
    ),
    "read_all": (  # the reader's decode of every sample (planes joined into words), after the open
        "from recipe.shards import ShardReader; r = ShardReader(ROOT); ids = r.ids; "
        "t1 = time.perf_counter(); n = sum(len(r.get_numpy(i)[1]) for i in ids); "
        "extra = {'decode_s': round(time.perf_counter() - t1, 3)}"
    ),
    "plan": (
        "from omegaconf import OmegaConf; from recipe import data; from recipe.schema import DataConfig; "
        "from recipe.models import make_tokenizer; "
        "cfg = OmegaConf.merge(OmegaConf.structured(DataConfig), "
        "{'sources': [ROOT + '/huge.jsonl'], 'max_length': 2048}); "
        "p = data.build_plan(cfg, make_tokenizer()); assert p.tokens == 2048, p.tokens"
    ),
}


def measure(op: str, root: Path) -> dict:
    code = (
        "import json, resource, sys, time; from pathlib import Path; sys.path.insert(0, sys.argv[2]); "
        f"ROOT = sys.argv[1]; extra = {{}}; t0 = time.perf_counter(); {OPS[op]}; "
        "print(json.dumps({'seconds': round(time.perf_counter() - t0, 3), "
        "'peak_rss_MB': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1), "
        "'children_peak_rss_MB': round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1), **extra}))"
    )
    r = subprocess.run([sys.executable, "-c", code, str(root), str(ROOT)], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{op}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def raw_mb(n: int, tokens: int, hidden: int) -> float:
    """n samples' raw MB: the states (bf16) and, per token, its id (int32) and mask byte."""
    return round(n * (tokens * SLOTS * hidden * 2 + 5 * tokens) / 1e6, 1)


def rates(row: dict) -> None:
    """Raw MB/s of the verifies (their whole command) and of the zstd floor (its decode alone)."""
    for op in ("verify", "verify_2_workers"):
        row[op]["raw_MB_per_s"] = round(row["raw_MB"] / row[op]["seconds"], 1)
    for op in ("zstd_floor", "read_all"):
        if op in row:
            row[op]["raw_MB_per_s"] = round(row["raw_MB"] / row[op]["decode_s"], 1)
            row[op]["us_per_record"] = round(row[op]["decode_s"] / row["samples"] * 1e6, 2)


def sets(sizes: list[int], work: Path) -> list[dict]:
    from recipe.shards.merge import merge

    rows = []
    for n in sizes:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        built = build(work, n)
        t0 = time.perf_counter()
        merge(work / "merged", [work / f"job-{j}" for j in range(JOBS)])
        row = {"samples": n, "build_s": round(built, 1), "merge_64_jobs_s": round(time.perf_counter() - t0, 3)}
        row["raw_MB"] = raw_mb(n, T, H)
        row["index_MB"] = round((work / "merged" / "index.jsonl").stat().st_size / 1e6, 1)
        for op in ("open", "resume_plan", "inspect", "verify", "verify_2_workers", "zstd_floor"):  # "plan": `huge`'s
            row[op] = measure(op, work / "merged")
        rates(row)
        print(json.dumps(row), flush=True)
        rows.append(row)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def long_sample(tokens: int, hidden: int, work: Path) -> dict:
    """One sample of `tokens` through the packer (its worker process packs it) and the reader."""
    code_pack = (
        "import json, resource, sys; sys.path.insert(0, sys.argv[1]); from bench.scale import pack_one; "
        "raw = pack_one(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]); "
        "kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024; "
        "me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024; "
        "print(json.dumps({'raw_MB': raw / 1e6, 'packer_main_peak_MB': me, 'packer_worker_peak_MB': kids}))"
    )
    shutil.rmtree(work, ignore_errors=True)
    r = subprocess.run(
        [sys.executable, "-c", code_pack, str(ROOT), str(tokens), str(hidden), str(work)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    res = json.loads(r.stdout.strip().splitlines()[-1])
    code_read = (
        "import json, resource, sys, time; from recipe.shards import ShardReader; r = ShardReader(sys.argv[1]); "
        "t0 = time.perf_counter(); x = r.get(r.ids[0]); dt = time.perf_counter() - t0; "
        "print(json.dumps({'reader_peak_MB': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 'get_s': dt}))"
    )
    r = subprocess.run([sys.executable, "-c", code_read, str(work / "out")], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(r.stderr[-3000:])
    res.update(json.loads(r.stdout.strip().splitlines()[-1]))
    res["tokens"], res["hidden"], res["slots"] = tokens, hidden, SLOTS
    for k in ("packer_main_peak_MB", "packer_worker_peak_MB", "reader_peak_MB"):
        res[k.replace("_MB", "_over_raw")] = round(res[k] / res["raw_MB"], 3)
    shutil.rmtree(work, ignore_errors=True)
    return res


def pack_one(tokens: int, hidden: int, work: str) -> int:
    """The hook's dump of one sample, then the packer (one worker process) stores it."""
    from recipe.capture import records
    from recipe.capture.writer import CaptureWriter
    from recipe.data import Sample
    from recipe.packer import Packer, Progress
    from recipe.shards.codec import Codec
    from recipe.shards.store import ShardStore

    work = Path(work)
    dump = work / "dump"
    dump.mkdir(parents=True)
    rng = np.random.default_rng(0)
    h = np.empty((tokens, SLOTS, hidden), np.uint16)
    for a in range(0, tokens, 4096):  # filled in blocks: no float32 copy of the whole sample
        x = rng.standard_normal((min(4096, tokens - a), SLOTS, hidden), dtype=np.float32) * 0.05
        h[a : a + len(x)] = (x.view(np.uint32) >> 16).astype(np.uint16)
    s = Sample("long", rng.integers(0, 100000, tokens).astype(np.int32), np.ones(tokens, np.uint8), "b", key="k")
    CaptureWriter(dump, 1 << 40, "hsx-").write_pass(["hsx-long"], [0], [tokens], s.input_ids, records.split_words(h))
    del h
    store = ShardStore(work / "out", IDENTITY)
    with Packer(
        dump, store, Codec(entropy_only=True), ["a", "b", "c", "final"], workers=1, progress=Progress(1, 1e9)
    ) as pk:
        pk.expect("hsx-long", s)
        pk.responded("hsx-long")
        pk.drain()
    raw = store.write_manifest({})["totals"]["raw_bytes"]
    store.close()
    return raw


def verify_shape(n: int, tokens: int, hidden: int, work: Path) -> dict:
    """n samples of one shape in one set, states of N(0, 0.05) as bf16 (real activations' ratio): `verify`
    in one process, then over 2 workers, then the zstd floor and the reader's decode of every sample."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    row = {
        "samples": n,
        "tokens": tokens,
        "hidden": hidden,
        "build_s": round(build(work, n, 1, tokens, hidden, sd=0.05), 1),
    }
    root = work / "job-0"
    stored = json.loads((root / "manifest.json").read_text())["totals"]["stored_bytes"]
    row["raw_MB"], row["stored_MB"] = raw_mb(n, tokens, hidden), round(stored / 1e6, 1)
    row["raw_KB_per_sample"] = round(row["raw_MB"] / n * 1e3, 1)
    for op in ("verify", "verify_2_workers", "zstd_floor", "read_all"):
        row[op] = measure(op, root)
    rates(row)
    print(json.dumps(row), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return row


def huge_record(chars: int, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    reply = " ".join(f"w{i % 977}" for i in range(chars // 4 + 1))[:chars]
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}]
    (work / "huge.jsonl").write_text(json.dumps({"messages": msgs}) + "\n")
    try:
        return {"chars": chars, "max_length": 2048, **measure("plan", work)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["sets", "long", "huge", "verify"])
    ap.add_argument("--shapes", default="160x2048x4096", help="verify: SAMPLESxTOKENSxHIDDEN,...")
    ap.add_argument("--chars", type=int, default=20_000_000)
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--work", type=Path, default=Path("/tmp/hs-scale"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.what == "sets":
        res = {"sets": sets([int(x) for x in a.sizes.split(",")], a.work)}
    elif a.what == "long":
        res = {"long": long_sample(a.tokens, a.hidden, a.work)}
    elif a.what == "verify":
        shapes = [[int(v) for v in x.split("x")] for x in a.shapes.split(",")]
        res = {"verify": [verify_shape(n, t, h, a.work) for n, t, h in shapes]}
    else:
        res = {"huge": huge_record(a.chars, a.work)}
    res["machine"] = {"cpus": __import__("os").cpu_count(), "python": sys.version.split()[0]}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
