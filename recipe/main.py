"""The recipe: plan -> backend -> capture -> packer -> manifest.

    python -m recipe                      # embedded default (tiny model, HF backend, CPU)
    python -m recipe experiment=kimi-k2.5 # production, patched SGLang
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from . import preflight, schema
from .capture.writer import CaptureWriter
from .data import build_plan, sample_key
from .packer import Packer, Progress
from .provenance import backend_provenance, capture_spec, identity, model_fingerprint, tokenizer_provenance, versions
from .shards.codec import Codec
from .shards.store import ShardStore
from .tiny import resolve_model_path

log = logging.getLogger("recipe")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


class RunFailed(SystemExit):
    pass


def validate(cfg) -> None:
    layers = list(cfg.capture.layers)
    n = cfg.model.num_layers
    if not layers and not cfg.capture.final:
        raise ValueError("capture.layers is empty and capture.final is false: nothing to capture")
    if layers != sorted(set(layers)):
        raise ValueError(f"capture.layers must be ascending and unique, got {layers}")
    if layers and (layers[0] < 0 or layers[-1] >= n):
        raise ValueError(f"capture.layers {layers} out of range for {n} layers: index i is the residual "
                         f"stream entering layer i, so 0 <= i < {n}; use capture.final for the last state")
    if cfg.backend.name == "sglang" and layers and layers[0] == 0:
        raise ValueError("backend=sglang cannot capture layer 0 (the embeddings): SGLang adds the residual, "
                         "which does not exist yet before layer 0")
    if cfg.data.overflow not in ("truncate", "skip"):
        raise ValueError(f"data.overflow must be truncate or skip, got {cfg.data.overflow!r}")
    if not 0 <= cfg.data.shard_index < cfg.data.num_shards:
        raise ValueError(f"data.shard_index={cfg.data.shard_index} not in [0, data.num_shards={cfg.data.num_shards})")


def check_model_config(cfg, model_dir: Path) -> None:
    hf = json.loads((model_dir / "config.json").read_text())
    hf = hf.get("text_config", hf)
    for key, ours in (("num_hidden_layers", cfg.model.num_layers), ("hidden_size", cfg.model.hidden_size)):
        if key in hf and hf[key] != ours:
            raise ValueError(f"model config says {key}={ours} but {model_dir}/config.json says {hf[key]}")


# -- dump directory ------------------------------------------------------------------------
def make_dump_dir(parent: str) -> Path:
    """A fresh per-run folder on the RAM disk. Folders of runs whose process is gone are removed
    first, so a killed run never leaves /dev/shm filling up."""
    root = Path(parent)
    root.mkdir(parents=True, exist_ok=True)
    for d in root.glob("run-*"):
        with contextlib.suppress(ValueError, IndexError):
            pid = int(d.name.split("-")[1])
            if not Path(f"/proc/{pid}").exists():
                shutil.rmtree(d, ignore_errors=True)
    d = root / f"run-{os.getpid()}-{time.time_ns()}"
    d.mkdir()
    return d


# -- the flow ------------------------------------------------------------------------------
def run(cfg: DictConfig) -> dict:
    """Returns the run's accounting. Raises RunFailed (non-zero exit) if any sample failed."""
    validate(cfg)
    out = Path(cfg.output_dir)
    model_dir = resolve_model_path(cfg.model.path)
    check_model_config(cfg, model_dir)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_dir} has no chat template: the loss mask needs one")

    # 1. plan
    plan = build_plan(cfg.data, tokenizer)
    cap = capture_spec(cfg)
    fp = model_fingerprint(model_dir)
    for s in plan.samples:
        s.key = sample_key(fp, cap, s.input_ids)
    model = {"name": cfg.model.name, "path": str(model_dir), "num_layers": cfg.model.num_layers,
             "hidden_size": cfg.model.hidden_size}
    store = ShardStore(out, identity(cfg, fp, tokenizer_provenance(model_dir, tokenizer), plan.sources),
                       {"model": model}, max_shard_bytes=int(cfg.shards.max_shard_gb * (1 << 30)))
    for name, dropped in store.repaired:
        log.warning("resume: cut %d uncommitted bytes from %s", dropped, name)
    if store.lost:
        log.warning("resume: %d stored samples were lost (shard file missing or cut short) and will be redone: %s",
                    len(store.lost), ", ".join(store.lost[:10]) + (" ..." if len(store.lost) > 10 else ""))
    todo = [s for s in plan.samples if s.key not in store.keys]
    already = len(plan.samples) - len(todo)
    log.info("plan: %d input records -> %d samples (%d tokens), %d already stored, %d to do; skipped %s",
             plan.input, len(plan.samples), plan.tokens, already, len(todo), dict(plan.skipped) or "none")

    # 2. preflight: refuse before any GPU work if the disks cannot hold the run
    slots = len(cap["slots"])
    preflight.check(todo, slots, cfg.model.hidden_size, out, cfg.capture.dump_dir, cfg.capture.budget_gb)
    if cfg.dry_run:
        store.close()
        return {"input": plan.input, "planned": len(plan.samples), "dry_run": True}

    # 3. backend + capture + packer, side by side
    external = cfg.backend.name == "sglang" and not cfg.server.launch
    if external:  # the running server was started with SGLANG_HS_DUMP_DIR = capture.dump_dir itself
        dump_dir = Path(cfg.capture.dump_dir)
        if not dump_dir.is_dir():
            raise FileNotFoundError(f"server.launch=false but capture.dump_dir={dump_dir} does not exist")
    else:
        dump_dir = make_dump_dir(cfg.capture.dump_dir)
    budget = int(cfg.capture.budget_gb * (1 << 30))
    progress = Progress(len(todo), cfg.log_every_s, dump_dir, budget)
    packer = Packer(dump_dir, store, Codec(cfg.shards.zstd_level, cfg.shards.transform), cap["slots"],
                    workers=cfg.shards.workers, dump_timeout_s=cfg.capture.dump_timeout_s,
                    commit_every=cfg.shards.commit_every, progress=progress).start()
    writer = CaptureWriter(dump_dir, budget, cfg.capture.rid_prefix)
    rid_of = lambda s: f"{cfg.capture.rid_prefix}{s.id}"  # noqa: E731
    stop = threading.Event()
    started = time.time()
    interrupted = None
    with graceful_stop(stop):
        try:
            backend = make_backend(cfg, model_dir, dump_dir)
            try:
                backend.run(todo, packer, writer, rid_of, should_stop=stop.is_set)
                if stop.is_set():
                    interrupted = "interrupted by a signal"
                # drain *before* stopping the server: its writer thread may still hold the last passes
                packer.drain(timeout_s=None if not stop.is_set() else cfg.capture.dump_timeout_s)
            finally:
                backend.close()
        except KeyboardInterrupt:
            interrupted = "interrupted"
        except RuntimeError as e:
            full = disk_full(e)
            if full is None:
                raise
            interrupted = (f"output disk full ({full}): free space on the filesystem of {out} "
                           f"(about {preflight.estimate(todo, slots, cfg.model.hidden_size)[1] / 1e9:.1f} GB for the whole run)")
        finally:
            packer.stop()
            if not external:
                shutil.rmtree(dump_dir, ignore_errors=True)
    progress.maybe_log(force=True)

    # 4. manifest and accounting: ok + skipped + failed (+ not done, if interrupted) = input
    done_now = packer.ok
    not_done = len(todo) - done_now - sum(packer.failed.values())
    counts = {"input": plan.input, "ok": already + done_now, "ok_this_run": done_now, "already_stored": already,
              "skipped": dict(plan.skipped), "failed": dict(packer.failed), "not_done": not_done}
    write_manifest = store.write_manifest
    if interrupted and interrupted.startswith("output disk full"):
        write_manifest = lambda fields: best_effort(store.write_manifest, fields)  # noqa: E731
    manifest = write_manifest({
        "versions": versions(),
        "data": {"sources": plan.sources, "max_length": cfg.data.max_length, "overflow": cfg.data.overflow,
                 "limit": cfg.data.limit, "shard_index": cfg.data.shard_index, "num_shards": cfg.data.num_shards},
        "codec": {"zstd_level": cfg.shards.zstd_level, "transform": cfg.shards.transform},
        "backend": backend_provenance(cfg),
        "counts": counts,
        "examples": {"skipped": dict(plan.examples), "failed": dict(packer.examples)},
        "run": {"started": started, "seconds": round(time.time() - started, 3), "interrupted": interrupted},
        "config": OmegaConf.to_container(cfg, resolve=True),
    })
    store.close()
    print_summary(out, counts, plan, packer, manifest)
    if interrupted:
        raise RunFailed(f"{interrupted}: {not_done} samples not done; run the same command again to resume")
    if packer.failed:
        raise RunFailed(f"{sum(packer.failed.values())} samples failed: {dict(packer.failed)} (details in {out}/manifest.json)")
    return counts


def disk_full(e: BaseException) -> str | None:
    """The ENOSPC behind a packer failure, if that is what it was."""
    import errno

    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return str(e)
        e = e.__cause__ or e.__context__
    return None


def best_effort(fn, *a):
    try:
        return fn(*a)
    except OSError as e:
        log.error("could not write the manifest (%s); the index is intact and resume rebuilds it", e)
        return {"totals": {"samples": 0, "tokens": 0, "raw_bytes": 0, "stored_bytes": 0}}


def make_backend(cfg, model_dir: Path, dump_dir: Path):
    if cfg.backend.name == "hf":
        from .backends.hf import HFBackend

        b = cfg.backend
        return HFBackend(model_dir, list(cfg.capture.layers), cfg.capture.final, device=b.device, dtype=cfg.model.dtype,
                         batch_tokens=b.batch_tokens, batch_size=b.batch_size, attn_implementation=b.attn_implementation)
    if cfg.backend.name == "sglang":
        from .backends.sglang import SGLangBackend

        return SGLangBackend(cfg, model_dir, dump_dir)
    raise ValueError(f"backend.name must be hf or sglang, got {cfg.backend.name!r}")


@contextlib.contextmanager
def graceful_stop(stop: threading.Event):
    """SIGTERM (docker compose down, SLURM preemption) and SIGINT: stop taking new work, store what
    is in flight, exit non-zero. A second signal exits at once (resume redoes the rest)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        log.warning("%s: finishing samples in flight, then stopping (again to stop now)", signal.Signals(signum).name)
        stop.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def print_summary(out, counts, plan, packer, manifest) -> None:
    t = manifest["totals"]
    ratio = t["raw_bytes"] / t["stored_bytes"] if t["stored_bytes"] else 0
    lines = [f"output: {out}",
             f"input {counts['input']} = ok {counts['ok']} (new {counts['ok_this_run']}, resumed {counts['already_stored']})"
             f" + skipped {sum(counts['skipped'].values())} + failed {sum(counts['failed'].values())}"
             + (f" + not done {counts['not_done']}" if counts["not_done"] else ""),
             f"stored: {t['samples']} samples, {t['tokens']} tokens, {t['stored_bytes'] / 1e6:.1f} MB "
             f"(raw {t['raw_bytes'] / 1e6:.1f} MB, ratio {ratio:.3f}x)"]
    for kind, ex in (("skipped", plan.examples), ("failed", packer.examples)):
        for reason, n in counts[kind].items():
            lines.append(f"  {kind} {reason}: {n}" + (f"  e.g. {ex[reason][0]}" if ex.get(reason) else ""))
    log.info("\n".join(lines))


schema.register()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    run(cfg)
