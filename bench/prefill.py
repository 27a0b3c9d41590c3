"""Extraction throughput against plain prefill, one server per arm, same flags in every arm.

  (a) plain     patched SGLang with the dump off (= upstream behaviour), no packer
  (b) dump      dump to /dev/shm, the recipe's packer compressing and appending durable shards
  (c) capture   dump on but the hook's writer disabled (capture + D2H copy only): splits b's cost

Every arm sends the same prompts with the recipe's own async client (max_new_tokens 0), after an
untimed warm-up. Prints one JSON object (also written to --out).

The weights are real random weights at the usual init scale (normal, std 0.02; norms 1), made once
on the GPU and saved as bf16 safetensors: their activations compress like a trained model's (the
run prints its ratio beside the real-activation ratio of bench/codec.py), where `--load-format dummy`
activations compress 2.8x and flatter the packer.

  python bench/prefill.py --model-dir /tmp/llama8b --samples 300 --out bench.json           # GPU host
  python bench/prefill.py --fake --samples 20                                               # CPU plumbing check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from hydra import compose as hydra_compose  # noqa: E402
from hydra import initialize_config_dir  # noqa: E402
from shapes import LLAMA_8B, make_weights  # noqa: E402,F401  (peers.py reads LLAMA_8B here)

from recipe import schema  # noqa: E402
from recipe.backends.sglang import SGLangBackend  # noqa: E402
from recipe.capture import records, settings  # noqa: E402
from recipe.data import Sample  # noqa: E402
from recipe.main import CONF_DIR  # noqa: E402
from recipe.packer import Packer, Progress  # noqa: E402
from recipe.shards.codec import Codec  # noqa: E402
from recipe.shards.store import ShardStore  # noqa: E402

REAL_ACTIVATION_RATIO = 1.448  # bench/codec.py, docs/codec-2026-11-30.json: trained model, default codec


def compose(overrides):
    schema.register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides))


class NullPacker:
    """Arms a and c: the server writes nothing, so nothing is waited for."""

    progress = SimpleNamespace(start=lambda: None)

    def expect(self, rid, s):
        pass

    def responded(self, rid):
        pass

    def forget(self, rid):
        pass

    def fail(self, rid, reason):
        raise RuntimeError(f"{rid}: {reason}")


def make_samples(n, lo, hi, vocab, seed):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(100, vocab - 100, int(rng.integers(lo, hi + 1))).astype(np.int32)
        out.append(
            Sample(
                id=f"b{seed}-{i:06d}",
                input_ids=ids,
                loss_mask=np.ones(len(ids), np.uint8),
                source="bench",
                key=f"k{seed}-{i}",
            )
        )
    return out


def tail(packer, t_end, timeout_s=600.0) -> dict:
    """Where the time after the last response goes, from the packer's own books (polled): until
    every sample's dump is complete and handed to a worker, until every one is packed (appended and
    flushed), until every one is committed."""
    marks, t0 = {}, time.monotonic()
    while len(marks) < 3 and time.monotonic() - t0 < timeout_s and packer.error is None:
        s = packer.stages_left()
        left = {
            "dispatched_s": s["waiting"],
            "packed_s": s["waiting"] + s["packing"],
            "committed_s": s["waiting"] + s["packing"] + s["committing"],
        }
        now = time.monotonic()
        for k, v in left.items():
            if v == 0 and k not in marks:
                marks[k] = round(now - t_end, 3)
        time.sleep(0.002)
    return marks


def arm_overrides(args, name: str, dump_parent: Path, extra: tuple = ()) -> list[str]:
    """The recipe config of one arm (an 8B-shape model; with --fake, the tiny one on the fake server)."""
    over = [
        *extra,
        "backend=sglang",
        f"output_dir={args.work}/out-{name}",
        f"capture.dump_dir={dump_parent}",
        "model.num_layers=32",
        "model.hidden_size=4096",
        "model.default_layers=[2,16,29]",
        f"server.port={args.port}",
        "server.ready_timeout_s=600",
        f"client.concurrency={args.concurrency}",
        f"server.args.mem_fraction_static={args.mem_fraction}",
        f"server.args.chunked_prefill_size={args.chunk}",
        f"server.args.attention_backend={args.attention_backend}",
        f"capture.budget_gb={args.budget_gb}",
        f"shards.workers={args.workers}",
        f"capture.writer_threads={args.writer_threads}",
        "capture.dump_timeout_s=120",
        "client.self_check=0",  # the arms time the hook; the product bench runs the check as users do
        f"server.args.tp_size={args.tp}",
        "+server.args.enforce_disable_flashinfer_allreduce_fusion=true",
    ]
    if args.fake:
        over += [
            f"server.command=[{sys.executable},{ROOT / 'tests' / 'fake_sglang.py'}]",
            "model.num_layers=4",
            "model.hidden_size=64",
            "model.default_layers=[1,2,3]",
            "server.args.tp_size=1",
            "~server.args.enforce_disable_flashinfer_allreduce_fusion",
        ]
    return over


def arm_backend(args, name: str, model_dir, dump_parent: Path, stats_file: Path, extra: tuple = ()):
    """The backend of one arm, its server's hook switched to what the arm measures: off (plain),
    capture without writing (capture), or the whole dump (dump); hook timings to stats_file."""
    cfg = compose(arm_overrides(args, name, dump_parent, extra))
    be = SGLangBackend(model_dir, dump_parent, Path(args.work) / f"out-{name}", server=cfg.server, client=cfg.client,
                       capture=cfg.capture, nccl=cfg.nccl, run_dir=Path(args.work) / f"logs-{name}")  # fmt: skip
    if name == "plain":
        for k in list(be.server.env):
            if k.startswith("SGLANG_HS_"):
                del be.server.env[k]
    if name == "capture":
        be.server.env[settings.ENV_NO_WRITE] = "1"
    if name != "plain":
        be.server.env[settings.ENV_STATS] = str(stats_file)
    return be, cfg


def dump_packer(args, dump_parent: Path, out: Path, n: int):
    store = ShardStore(out, {"format": "bench", "model_fingerprint": "random-init", "capture": {}})
    packer = Packer(dump_parent, store, Codec(1, "byteplane", entropy_only=True), ["l2", "l16", "l29", "final"],
                    workers=args.workers, dump_timeout_s=120, progress=Progress(n, 5.0),
                    sync_records=not args.no_sync_records).start()  # fmt: skip
    return store, packer


def stored_figures(packer, store) -> dict:
    tot = store.write_manifest({})["totals"]
    store.close()
    ratio = tot["raw_bytes"] / tot["stored_bytes"]
    return dict(stored=tot, ratio=round(ratio, 4), real_activation_ratio=REAL_ACTIVATION_RATIO,
                ratio_vs_real=round(ratio / REAL_ACTIVATION_RATIO, 4),
                bytes_per_token=round(tot["stored_bytes"] / tot["tokens"], 1), failed=dict(packer.failed),
                ok=packer.ok)  # fmt: skip


def arm(name, args, model_dir, samples, warm):
    dump_parent = Path(args.shm) / f"bench-{name}"
    shutil.rmtree(dump_parent, ignore_errors=True)
    dump_parent.mkdir(parents=True)
    stats_file = Path(args.work) / f"hook-stats-{name}.json"  # rank 0's timings (recipe.capture.hookstats.Stats)
    stats_file.parent.mkdir(parents=True, exist_ok=True)
    stats_file.unlink(missing_ok=True)
    be, cfg = arm_backend(args, name, model_dir, dump_parent, stats_file)
    result, peak, stop = {"arm": name}, {"bytes": 0}, threading.Event()

    def watch():
        while not stop.is_set():
            peak["bytes"] = max(peak["bytes"], records.dir_bytes(dump_parent))
            time.sleep(0.05)

    try:
        be.server.start()
        result["server_ready_s"] = round(be.server.wait_ready(), 1)
        be.opts.launch = False  # already up: run() must not start another
        be.rid_prefix = "warm-"  # untimed; rid without the hook's prefix: no dump
        be.run(warm, NullPacker())
        be.rid_prefix = cfg.capture.rid_prefix
        out = Path(args.work) / f"out-{name}"
        shutil.rmtree(out, ignore_errors=True)
        store, packer = dump_packer(args, dump_parent, out, len(samples)) if name == "dump" else (None, NullPacker())
        threading.Thread(target=watch, daemon=True).start()
        t0 = time.monotonic()
        be.run(samples, packer)
        t_client = time.monotonic() - t0
        t_all = t_client
        if name == "dump":
            result["tail"] = tail(packer, t0 + t_client)
            packer.drain(timeout_s=600)
            t_all = time.monotonic() - t0
            packer.stop()
            result.update(stored_figures(packer, store))
        tokens = sum(len(s.input_ids) for s in samples)
        result.update(samples=len(samples), tokens=tokens, client_s=round(t_client, 3), total_s=round(t_all, 3),
                      tokens_per_s=round(tokens / t_all, 1), samples_per_s=round(len(samples) / t_all, 3),
                      tokens_per_s_client=round(tokens / t_client, 1), peak_dump_bytes=peak["bytes"],
                      client=be.stats)  # fmt: skip
        if name != "plain":
            time.sleep(0.5)  # the writer rewrites its stats once it idles
            if stats_file.exists():
                result["hook"] = json.loads(stats_file.read_text())
    finally:
        stop.set()
        be.server.stop()
        shutil.rmtree(dump_parent, ignore_errors=True)
        shutil.rmtree(Path(args.work) / f"out-{name}", ignore_errors=True)
    print(json.dumps(result), flush=True)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default="/tmp/llama8b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=32)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--arms", default="plain,dump,capture")
    ap.add_argument("--attention-backend", default="flashinfer")
    ap.add_argument("--mem-fraction", type=float, default=0.85)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--budget-gb", type=float, default=16)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--writer-threads", type=int, default=2, help="the hook's writer threads (capture.writer_threads)")
    ap.add_argument("--port", type=int, default=32000)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--work", default="/tmp/bench")
    ap.add_argument(
        "--no-sync-records", action="store_true", help="packer workers leave flushing to the commit (the old way)"
    )
    ap.add_argument("--out")
    ap.add_argument("--fake", action="store_true", help="CPU plumbing check against tests/fake_sglang.py")
    args = ap.parse_args()
    if args.fake:
        from recipe.models import materialize

        model_dir, vocab = materialize("tiny-llama"), 256
    else:
        model_dir, vocab = Path(args.model_dir), LLAMA_8B["vocab_size"]
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(LLAMA_8B))
        t0 = time.monotonic()
        make_weights(model_dir)
        print(f"weights ready in {time.monotonic() - t0:.0f} s", flush=True)
    samples = make_samples(args.samples, args.min_len, args.max_len, vocab, seed=1)
    warm = make_samples(args.warmup, args.min_len, args.max_len, vocab, seed=2)
    res = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "arms": {}}
    for name in args.arms.split(","):
        res["arms"][name] = arm(name, args, model_dir, samples, warm)
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))
    a = res["arms"].get("plain")
    if a:
        for k in ("dump", "capture"):
            if k in res["arms"]:
                res[f"{k}/plain"] = round(res["arms"][k]["tokens_per_s"] / a["tokens_per_s"], 4)
    print(json.dumps({k: v for k, v in res.items() if k != "arms"}, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
