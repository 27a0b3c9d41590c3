"""The product's throughput: `python -m recipe backend=sglang ...` as a user runs it, against plain
prefill of the same token ids on a fresh server with the same flags.

Arms, in this order, each with its own server:
  product   the recipe's own command at its defaults (a fresh machine: kernels compile on its start)
  plain     patched SGLang with the dump off (= upstream), the same ids sent by the recipe's client at
            the recipe's concurrency; timed from the first request to the last response
  product   again, on the now warm machine (skipped when --deadline-s would be passed)

For the product, times come from the recipe's own log and files: from "server ready" to the manifest
written (every sample durable: the manifest is written after the last commit) and to the process's
exit. Ratios: plain's prefill time over the product's ready-to-durable and ready-to-exit times.

The target: Llama-3.1-8B's shape with init-scale random weights (bench/prefill.py's, made on the GPU),
its tokenizer the built-in byte-level one with the Llama-3 template, so a record of N ASCII bytes is
about N tokens. Data: chat records cut from the Python standard library's sources (text, not random
ids), 512-4096 bytes per sample.

  python bench/product.py --samples 300 --out product.json          # GPU host (~16 GB of weights in --model-dir)
  python bench/product.py --fake --samples 20                       # CPU plumbing check (tests/fake_sglang.py)
  python bench/product.py --samples 3000 --warm-only --out-root /dev/shm/bench-product   # after a run warmed
      # the machine: a set larger than the disk goes to the RAM disk
  python bench/product.py --abba --samples 2000 --out product.json     # warm-up, then A B B A on one machine;
      # each arm recorded as it ends: the same command again (same --out) goes on where a call stopped
  python bench/product.py --abba --self-check-cost --samples 300       # ... with the self-check off in the middle
  python bench/product.py --abba --variant "shards.workers=8" --samples 300   # ... with other overrides there
  python bench/product.py --abba --hook-stats --samples 300            # ... with the hook's own timings per
      # product arm (where the compute lag goes) and, always, the tail's steps (where the end goes)
  python bench/product.py --abba --regenerate 512 --samples 1000       # data.regenerate.turns=last, against
      # plain generation to the same lengths then plain prefill (bench/plain_regen.py)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import plain_regen  # noqa: E402  (the plain arm of --regenerate)
import prefill  # noqa: E402  (the plain arm)
import shapes  # noqa: E402  (the target shapes and their weights)

from recipe.capture.settings import ENV_STATS  # noqa: E402
from recipe.data import Sample  # noqa: E402
from recipe.packer.progress import TAIL  # noqa: E402
from recipe.shards import ShardReader, codec, fp8  # noqa: E402
from recipe.shards.tokencounts import read_tokens  # noqa: E402

STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def make_data(path: Path, n: int, lo: int, hi: int, seed: int = 0) -> None:
    """n chat records of lo..hi bytes of real text (stdlib sources), split into a user and an assistant turn."""
    src = Path(sysconfig.get_paths()["stdlib"])
    text = "".join(p.read_text(errors="replace") for p in sorted(src.glob("*.py"))[:400])
    text = text.encode("ascii", "replace").decode()  # one byte, one token
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            size = int(rng.integers(lo, hi + 1))
            at = int(rng.integers(0, len(text) - size))
            cut = size // 4
            msgs = [
                {"role": "user", "content": f"[{i}] " + text[at : at + cut]},
                {"role": "assistant", "content": text[at + cut : at + size]},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")


def log_time(line: str) -> float:
    return datetime.strptime(STAMP.match(line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def product_arm(args, tag: str, model_dir: Path, data: Path, extra: tuple = ()) -> dict:
    """The recipe's command as a user types it (plus `extra` overrides); returns its timings and its
    shards' folder."""
    out, dumps = Path(args.out_root or args.work) / f"out-{tag}", Path(args.shm) / f"product-{tag}"
    shutil.rmtree(out, ignore_errors=True)
    model = shapes.SHAPES[args.shape].model if not args.fake else "tiny-llama"
    cmd = [sys.executable, "-m", "recipe", "backend=sglang", f"model={model}", f"model.path={model_dir}"]
    cmd += [f"data.sources=[{data}]", f"output_dir={out}", f"capture.dump_dir={dumps}", f"server.port={args.port}"]
    cmd += [*args.flags, *extra]
    log_path = Path(args.work) / f"recipe-{tag}.log"
    env, stats = dict(os.environ), Path(args.work) / f"hook-stats-{tag}.json"
    stats.unlink(missing_ok=True)
    if args.hook_stats:  # the hook's own timings, rank 0's, kept current by its writer threads
        env[ENV_STATS] = str(stats)
    t_start = time.time()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=args.work, env=env).returncode
    t_exit = time.time()
    lines = log_path.read_text(errors="replace").splitlines()
    ready = [log_time(ln) for ln in lines if "server ready after" in ln and STAMP.match(ln)]
    manifest = out / "manifest.json"
    if rc != 0 or not ready or not manifest.exists():
        raise SystemExit(f"product arm {tag} failed (rc {rc}); its log: {log_path}\n" + "\n".join(lines[-20:]))
    t_ready, t_durable = ready[0], manifest.stat().st_mtime
    totals = json.loads(manifest.read_text())["totals"]
    computed = [log_time(ln) for ln in lines if "every sample computed" in ln and STAMP.match(ln)]
    return {
        "arm": f"product-{tag}",
        "command": " ".join(cmd),
        "start_to_ready_s": round(t_ready - t_start, 1),
        "ready_to_durable_s": round(t_durable - t_ready, 2),
        "ready_to_exit_s": round(t_exit - t_ready, 2),
        "durable_to_exit_s": round(t_exit - t_durable, 2),
        # the server's part and the packer's tail: every sample computed, then the last ones stored
        "ready_to_computed_s": round(computed[0] - t_ready, 2) if computed else None,
        "computed_to_durable_s": round(t_durable - computed[0], 2) if computed else None,
        "samples": totals["samples"],
        "tokens": totals["tokens"],
        "raw_bytes": totals["raw_bytes"],
        "stored_bytes": totals["stored_bytes"],
        "tokens_per_s_ready_to_durable": round(totals["tokens"] / (t_durable - t_ready), 1),
        "tail_steps_s": tail_steps(lines),
        "hook_stats": json.loads(stats.read_text()) if stats.exists() else None,
        "progress_lines": [ln for ln in lines if "samples/s" in ln or "the last samples stored" in ln][-4:],
        **self_check_times(lines, t_ready),
        "out": str(out),
    }


def tail_steps(lines: list[str]) -> dict:
    """When the last sample went through each step of the tail (recipe.packer.progress.TAIL), in seconds
    from the last computed: the run's "the last samples stored" line."""
    steps = ", ".join(rf"{re.escape(what)} ([-+][\d.]+) s" for _, what in TAIL)
    for ln in lines:
        if m := re.search(rf"\({steps}\)", ln):
            return dict(zip((step for step, _ in TAIL), map(float, m.groups())))
    return {}


def self_check_times(lines: list[str], t_ready: float) -> dict:
    """The self-check's own seconds from the recipe's log: its head read while the server started, its
    judgements (in a thread, beside the capture), and when the last verdict came after the server was ready."""

    def seconds(what: str) -> list[float]:
        return [float(m.group(1)) for ln in lines if (m := re.search(what + r" in ([\d.]+) s", ln))]

    verdicts = [log_time(ln) for ln in lines if "gives the server's logprobs" in ln and STAMP.match(ln)]
    return {
        "self_check_head_s": sum(seconds("lm_head read and widened")),
        "self_check_judging_s": round(sum(seconds(r"samples judged")), 3),
        "self_check_last_verdict_after_ready_s": round(max(verdicts) - t_ready, 2) if verdicts else None,
    }


def stored_samples(out: Path) -> list[Sample]:
    """The token ids a product arm stored, as samples plain prefill is sent: each record's first bytes
    (decoding the hidden states too ran past 12 s for 956 samples on a GPU host, between arms)."""
    samples = []
    for rec in ShardReader(out).records:
        ids, sid = read_tokens(out, rec)[0].astype(np.int32), rec["id"]
        samples.append(Sample(id=sid, input_ids=ids, loss_mask=np.ones(len(ids), np.uint8), source="bench", key=sid))
    return samples


def regen_rows(out: Path) -> list[tuple[str, list[int], int]]:
    """(sample id, prompt ids, generated length) of each sample a --regenerate product arm stored: its ids
    less the turn regenerated.jsonl says the target wrote."""
    from recipe.regenerate import FILE

    lines = [json.loads(x) for x in (out / FILE).read_text().splitlines()]
    generated = {t["turn"]["id"]: len(t["turn"]["generated"]) for t in lines if "turn" in t}
    rows = []
    for s in stored_samples(out):
        n = generated[s.id]
        rows.append((s.id, s.input_ids[: len(s.input_ids) - n].tolist(), n))
    return rows


def plain_args(args) -> SimpleNamespace:
    """bench/prefill.py's arm settings at the recipe's defaults, the ones the product ran with."""
    cfg = prefill.compose(["backend=sglang"])
    return SimpleNamespace(
        shm=args.shm,
        work=args.work,
        port=args.port + 1,
        concurrency=cfg.client.concurrency,
        mem_fraction=cfg.server.args.mem_fraction_static,
        chunk=cfg.server.args.chunked_prefill_size,
        attention_backend=args.attention_backend or shapes.SHAPES[args.shape].attention,
        budget_gb=cfg.capture.budget_gb,
        workers=cfg.shards.workers,
        writer_threads=cfg.capture.writer_threads,
        tp=1,
        fake=args.fake,
        no_sync_records=False,
    )


def plain_arm(args, model_dir: Path, out: Path | list) -> dict:
    """The same ids (a product arm's set, or its samples), on a fresh server with the recipe's default
    flags and the dump off; with --regenerate, plain generation to the same lengths, then that prefill
    (bench/plain_regen.py)."""
    if args.regenerate:
        return plain_regen.arm(plain_args(args), model_dir, regen_rows(out) if isinstance(out, Path) else out)
    samples = stored_samples(out) if isinstance(out, Path) else out
    return prefill.arm("plain", plain_args(args), model_dir, samples, warm=[])


def prepare_model(args) -> Path:
    """The target shape with init-scale weights (or, with --fake, the tiny model and the fake server);
    sets args.flags, the recipe overrides every product arm takes."""
    args.attention_backend = args.attention_backend or shapes.SHAPES[args.shape].attention
    args.flags = [f"server.args.attention_backend={args.attention_backend}", f"shards.codec={args.codec}"]
    if args.regenerate:  # the target answers each record's last turn first, as data.regenerate does
        args.flags += ["data.regenerate.turns=last", f"data.regenerate.max_new_tokens={args.regenerate}"]
    if args.fake:
        from recipe.models import materialize

        fake = Path(__file__).resolve().parent.parent / "tests" / "fake_sglang.py"
        args.flags += [f"server.command=[{sys.executable},{fake}]", "capture.layers=[1,2,3]"]
        return materialize("tiny-llama")
    from recipe.models import make_tokenizer

    model_dir = Path(args.model_dir or f"/tmp/{args.shape}")
    shapes.make_weights(model_dir, args.shape)
    make_tokenizer("llama3").save_pretrained(model_dir)
    return model_dir


def ratios(res: dict, tag: str, arm: dict, plain: dict) -> None:
    res[f"{tag}/plain ready-to-durable"] = round(plain["client_s"] / arm["ready_to_durable_s"], 4)
    res[f"{tag}/plain ready-to-exit"] = round(plain["client_s"] / arm["ready_to_exit_s"], 4)


def product_then_plain(args, tag: str, model_dir: Path, data: Path, res: dict, save) -> tuple[dict, dict]:
    """The product, then plain on the ids it stored; its set removed once read (the disk holds one)."""
    arm = product_arm(args, tag, model_dir, data)
    res["arms"][f"product-{tag}"] = arm
    save()
    plain = plain_arm(args, model_dir, Path(arm["out"]))
    res["arms"]["plain"] = plain
    shutil.rmtree(arm["out"], ignore_errors=True)
    ratios(res, tag, arm, plain)
    save()
    return arm, plain


def cold_then_warm(args, model_dir: Path, data: Path, res: dict, save, t0: float) -> None:
    """The product on a fresh machine, plain on its ids, then the product again, warm (if the deadline
    allows). With --warm-only (a machine an earlier call warmed): the product, then plain."""
    if args.warm_only:
        product_then_plain(args, "warm", model_dir, data, res, save)
        return
    cold, plain = product_then_plain(args, "cold", model_dir, data, res, save)
    # the warm arm's start is about the plain arm's (same machine, kernels compiled)
    if time.monotonic() - t0 + plain["server_ready_s"] + cold["ready_to_exit_s"] + 15 < args.deadline_s:
        warm = product_arm(args, "warm", model_dir, data)
        res["arms"]["product-warm"] = warm
        ratios(res, "warm", warm, plain)
        shutil.rmtree(warm["out"], ignore_errors=True)
    else:
        res["product-warm"] = "skipped: it would pass --deadline-s"


ABBA = ("warmup", "product-A1", "plain-B1", "plain-B2", "product-A2")


def abba_c(args) -> tuple[str, tuple]:
    """The C arms, the product under other overrides in the middle (A B C C B A, every side centred on the
    same moment: what the overrides change is A against C, on the same machine and ids): their name and
    overrides. --self-check-cost: client.self_check=0; --variant: the overrides given."""
    if args.self_check_cost:
        return "nocheck", ("client.self_check=0",)
    return ("variant", tuple(args.variant.split())) if args.variant else ("", ())


def abba_order(args) -> tuple:
    c = abba_c(args)[0]
    return (*ABBA[:3], f"{c}-C1", f"{c}-C2", *ABBA[3:]) if c else ABBA


def machine() -> dict:
    """Which machine an arm ran on, and which packer loops (C or numpy: fp8 packs ~5x slower in numpy):
    arms of one comparison must share both (a rerun may get another machine)."""
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True
        )
    except FileNotFoundError:  # --fake on a CPU box
        gpu = SimpleNamespace(stdout="none")
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return {"gpu": gpu.stdout.strip(), "boot_id": boot, "loops": {"fp8": fp8.IMPL, "join": codec.JOIN}}


def abba(args, model_dir: Path, data: Path, res: dict, save, t0: float) -> None:
    """Warm (a small product run compiles the kernels), then product, plain, plain, product on the same
    ids: a drift over the session falls on both sides alike. Each arm is recorded as it ends and
    skipped by a rerun (--out kept), so the five span calls; each arm says its machine."""
    here = machine()
    if any(a.get("machine") != here for a in res["arms"].values()):  # one comparison, one machine
        res.setdefault("discarded", []).append({k: a.get("machine") for k, a in res["arms"].items()})
        res["arms"] = {}
    warm_data = Path(args.work) / "warmup.jsonl"
    make_data(warm_data, min(100, args.samples), args.min_len, args.max_len, seed=1)
    ids_file, samples = Path(args.work) / "abba-ids.json", None
    order = abba_order(args)
    res.pop("stopped", None)  # a rerun that goes on is judged afresh
    for name in order:
        if name in res["arms"]:
            continue
        if time.monotonic() - t0 > args.deadline_s:
            res["stopped"] = f"before {name}: past --deadline-s; a rerun with --out goes on"
            return
        if not name.startswith("plain"):
            extra = abba_c(args)[1] if name.endswith(("-C1", "-C2")) else ()
            arm = product_arm(args, name, model_dir, warm_data if name == "warmup" else data, extra)
            if name == "product-A1":
                samples = regen_rows(Path(arm["out"])) if args.regenerate else stored_samples(Path(arm["out"]))
                ids_file.write_text(
                    json.dumps(samples if args.regenerate else {x.id: x.input_ids.tolist() for x in samples})
                )
            shutil.rmtree(arm["out"], ignore_errors=True)
        else:
            if samples is None:  # A1 ran in an earlier call, on this machine's disk
                samples = kept_samples(json.loads(ids_file.read_text()), args.regenerate)
            arm = plain_arm(args, model_dir, samples)
        res["arms"][name] = {**arm, "machine": here}
        save()
    res.update(abba_figures(res["arms"]))
    res["one machine"] = len({json.dumps(res["arms"][k]["machine"]) for k in order}) == 1


def kept_samples(stored, regenerate: int) -> list:
    """What abba kept of A1 for a later call's plain arms: rows (--regenerate) or samples."""
    if regenerate:
        return [tuple(r) for r in stored]
    return [Sample(id=k, input_ids=np.asarray(v, np.int32), loss_mask=np.ones(len(v), np.uint8), source="bench",
                   key=k) for k, v in stored.items()]  # fmt: skip


def abba_figures(arms: dict) -> dict:
    """Plain's mean time over the product's (ready to durable, ready to exit), each side's spread, and
    the self-check's judging as a share of the product's time."""
    a = [arms[k] for k in ("product-A1", "product-A2")]
    b = [arms[k]["client_s"] for k in ("plain-B1", "plain-B2")]
    out = {}
    for end in ("durable", "exit"):
        t = [x[f"ready_to_{end}_s"] for x in a]
        out[f"plain/product ready-to-{end} (ABBA means)"] = round(sum(b) / sum(t), 4)
        out[f"product ready-to-{end} spread (max/min)"] = round(max(t) / min(t), 4)
    out["plain spread (max/min)"] = round(max(b) / min(b), 4)
    judging = [x.get("self_check_judging_s", 0.0) for x in a]
    out["self-check judging share of ready-to-exit"] = round(sum(judging) / sum(x["ready_to_exit_s"] for x in a), 5)
    # what the run's end waits for the verdicts: their last one past every sample computed (0: none)
    late = [x.get("self_check_last_verdict_after_ready_s", 0.0) - (x.get("ready_to_computed_s") or 0.0) for x in a]
    out["self-check verdict past every sample computed (max, s)"] = round(max(0.0, *late), 2)
    if "nocheck-C1" in arms:  # the self-check's cost as the run feels it: on against off
        on, off = (
            sum(arms[k]["ready_to_exit_s"] for k in ks)
            for ks in (("product-A1", "product-A2"), ("nocheck-C1", "nocheck-C2"))
        )
        out["self-check share of ready-to-exit (A against C)"] = round((on - off) / on, 5)
        out["plain/nocheck ready-to-exit (means)"] = round(sum(b) / off, 4)
    if "variant-C1" in arms:
        for end in ("durable", "exit"):
            c = [arms[k][f"ready_to_{end}_s"] for k in ("variant-C1", "variant-C2")]
            out[f"plain/variant ready-to-{end} (means)"] = round(sum(b) / sum(c), 4)
            out[f"variant spread ready-to-{end} (max/min)"] = round(max(c) / min(c), 4)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-8b", choices=sorted(shapes.SHAPES))
    ap.add_argument("--codec", default="lossless", choices=["lossless", "fp8"], help="the product arms' shards.codec")
    ap.add_argument("--model-dir", default=None, help="where the shape's weights are kept (default /tmp/SHAPE)")
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--min-len", type=int, default=512)
    ap.add_argument("--max-len", type=int, default=4096)
    # fa3, SGLang's default on Hopper, is not in the slim kernel wheel this host gets (shared/gpu/README.md):
    # the shape's own default (flashinfer for Llama, triton for GPT-OSS, whose sinks flashinfer lacks)
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--port", type=int, default=33000)
    ap.add_argument("--shm", default="/dev/shm")
    ap.add_argument("--work", default="/tmp/bench-product")
    # where each product arm's shards go (default --work): /dev/shm for a set larger than the disk
    ap.add_argument("--out-root", default=None)
    ap.add_argument("--warm-only", action="store_true", help="skip the cold arm: the product, then plain")
    ap.add_argument("--deadline-s", type=float, default=540, help="skip the warm product arm past this")
    ap.add_argument("--out")
    # where the product's compute lag goes: the hook's time in the forward thread, the plane split's GPU
    # time, the writers' waits (recipe.capture.hookstats.Stats); two CUDA events a pass, so off by default
    ap.add_argument("--hook-stats", action="store_true", help="record the hook's own timings per product arm")
    ap.add_argument("--fake", action="store_true", help="CPU plumbing check against tests/fake_sglang.py")
    ap.add_argument("--abba", action="store_true", help="warm-up, then product, plain, plain, product (resumable)")
    ap.add_argument("--self-check-cost", action="store_true", help="--abba with the self-check off in the middle")
    ap.add_argument("--variant", default="", help="--abba with the product under these overrides in the middle, "
                    "e.g. 'shards.workers=8'")  # fmt: skip
    # data.regenerate.turns=last with max_new_tokens N, against plain generation then plain prefill
    ap.add_argument("--regenerate", type=int, default=0, metavar="N")
    args = ap.parse_args()
    t0 = time.monotonic()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_model(args)
    print(f"weights ready at {time.monotonic() - t0:.0f} s", flush=True)
    data = work / "data.jsonl"
    make_data(data, args.samples, args.min_len, args.max_len)
    res = {"date": time.strftime("%Y-%m-%d"), "argv": sys.argv, "arms": {}}
    if args.abba and args.out and Path(args.out).exists():  # a rerun goes on where the last call stopped
        res = json.loads(Path(args.out).read_text())

    def save():
        if args.out:
            Path(args.out).write_text(json.dumps(res, indent=2))

    (abba if args.abba else cold_then_warm)(args, model_dir, data, res, save, t0)
    save()
    print(json.dumps({k: v for k, v in res.items() if k != "arms"}, indent=2))


if __name__ == "__main__":
    main()
