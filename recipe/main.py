"""The recipe, in three phases:

plan     validate the config, tokenize the data, open the output directory (its identity is
         checked, or written before the first sample), preflight the disks
capture  the backend computes every sample still to do while the packer stores what it dumps
finish   the manifest with its accounting (input = ok + skipped + failed + not done), exit status

python -m recipe                      # embedded default (tiny model, HF backend, CPU)
python -m recipe experiment=kimi-k2.5 # production, patched SGLang
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

from . import preflight, schema, units
from .backends import make_backend
from .capture import presets
from .capture.architectures import refuse_undumped
from .capture.dumpdir import dump_dir as owned_dump_dir
from .capture.unservable import refuse_unservable
from .data import Plan, build_plan, sample_key
from .errors import ModelDirError, OutputDirError, UserError, disk_full
from .models import resolve_model_path
from .packer import Packer, Progress
from .provenance import (
    backend_provenance,
    capture_spec,
    codec_name,
    identity,
    model_fingerprint,
    tokenizer_provenance,  # fmt: skip
    versions,
)
from .regenerate import Regenerator, decode_graphs
from .shards.aliasing import set_around
from .shards.codec import Codec
from .shards.store import ShardStore

log = logging.getLogger("recipe")
CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


class RunFailed(SystemExit):
    pass


@dataclass
class Job:
    """What `plan` hands to `capture` and `finish`."""

    model_dir: Path
    shape: ModelShape
    plan: Plan
    todo: list  # samples not stored yet (with data.regenerate, some still to be written by the target)
    store: ShardStore
    slots: list[str]
    regen: Regenerator | None = None


@dataclass
class Captured:
    packer: Packer
    progress: Progress
    started: float
    interrupted: str | None
    server_stopping: threading.Thread | None = None  # the server's shutdown, begun once all was sent

    def wait_for_the_server(self) -> None:
        if self.server_stopping is not None:
            self.server_stopping.join()  # bounded: SIGKILL after the grace period


def run(cfg: DictConfig) -> dict:
    """Returns the run's accounting. Raises RunFailed (non-zero exit) if any sample failed, and on a
    full disk, wherever it was met (here only: the packer's comes as DiskFull)."""
    job = None
    try:
        job = plan(cfg)
        with job.store:
            if cfg.dry_run:
                return {"input": job.plan.input, "planned": len(job.plan.samples), "dry_run": True}
            cap = capture(cfg, job)
            try:
                return finish(cfg, job, cap)  # every sample durable, the manifest written...
            finally:
                cap.wait_for_the_server()  # ...then the server gone, then the exit
    except OSError as e:  # the packer's stop has committed what is durable: nothing is lost
        full = disk_full(e)
        if full is None:
            raise
        raise RunFailed(full_disk_message(full, cfg, job)) from e


# -- plan ------------------------------------------------------------------------------------
def plan(cfg) -> Job:
    """Validate, tokenize, open the output (identity checked or written) and preflight, in that
    order: every refusal comes before any GPU work, and before anything is written."""
    schema.validate(cfg)
    if not str(cfg.output_dir or "").strip():  # Path("") is the current folder: never a silent choice
        raise OutputDirError("output_dir= is empty: name a folder, or leave it out for the run folder's shards/")
    out = Path(cfg.output_dir)
    log_folders(cfg)
    check_output_dir(out)
    model_dir = resolve_model_path(cfg.model.path)
    if cfg.backend.name == "sglang":  # a class served without dumps, or a shape SGLang cannot serve: refused
        refuse_unservable(model_dir, refuse_undumped(model_dir))
    shape = read_model_shape(cfg, model_dir)
    presets.apply(cfg, shape.num_layers)  # capture=dflash / dspark: the layers, from the depth
    decode_graphs(cfg)  # data.regenerate decodes: SGLang's decode graphs on
    t0 = time.monotonic()
    tokenizer = load_tokenizer(model_dir, cfg.model.trust_remote_code)
    log.info("tokenizer loaded in %.1f s", time.monotonic() - t0)  # with transformers and torch imported: seconds
    t0 = time.monotonic()
    cap, fp = capture_spec(cfg), model_fingerprint(model_dir)
    the_plan = build_plan(cfg.data, tokenizer, cfg.log_every_s, key_of=lambda ids: sample_key(fp, cap, ids))
    log.info("read and tokenized %d records in %.1f s", the_plan.input, time.monotonic() - t0)
    model = {
        "name": cfg.model.name,
        "path": str(model_dir),
        "num_layers": shape.num_layers,
        "hidden_size": shape.hidden_size,
    }
    store = ShardStore(
        out,
        identity(cfg, fp, tokenizer_provenance(model_dir, tokenizer), the_plan.sources),
        {"model": model},
        max_shard_bytes=int(cfg.shards.max_shard_gb * (1 << 30)),
        deep_check=cfg.shards.deep_check,
    )
    with contextlib.ExitStack() as on_error:
        on_error.callback(store.close)
        regen = None
        if cfg.data.regenerate.turns != "off":  # the turns already regenerated, from the file beside the shards
            regen = Regenerator.open(cfg.data, tokenizer, out, lambda ids: sample_key(fp, cap, ids))
            regen.settle(the_plan)
        store.settle(the_plan.samples)
        log_repairs(store)
        todo = [s for s in the_plan.samples if s.key not in store.keys]
        log.info(
            "plan: %d input records -> %d samples (%d tokens), %d already stored, %d to do; skipped %s",
            the_plan.input,
            len(the_plan.samples),
            the_plan.tokens,
            len(the_plan.samples) - len(todo),
            len(todo),
            dict(the_plan.skipped) or "none",
        )
        preflight.check(todo, len(cap["slots"]), shape.hidden_size, out, cfg.capture.dump_dir, cfg.capture.budget_gb,
                        cfg.shards.codec)  # fmt: skip
        on_error.pop_all()
    return Job(model_dir, shape, the_plan, todo, store, cap["slots"], regen)


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The model's tokenizer, which must carry a chat template (the loss mask comes from it)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except ValueError as e:
        if "trust_remote_code" not in str(e) or trust_remote_code:
            raise
        raise schema.ConfigError(
            f"the tokenizer in {model_dir} is remote code (auto_map in tokenizer_config.json): "
            "set model.trust_remote_code=true after reading its *.py files"
        ) from None
    if not getattr(tokenizer, "chat_template", None):
        raise ModelDirError(f"{model_dir} has no chat template: the loss mask needs one")
    return tokenizer


def log_repairs(store: ShardStore) -> None:
    """What opening the set for a resume cut, left alone or dropped (then redone)."""
    for name, dropped in store.repaired:
        log.warning("resume: cut %d uncommitted bytes from %s", dropped, name)
    if store.recovered:
        log.warning("resume: %d whole records the index did not name were indexed again from the shards",
                    len(store.recovered))  # fmt: skip
    for sid, why in store.reindexed[:5]:
        log.warning("resume: the index line of %s was rewritten from its record (%s)", sid, why)
    for name, why in store.left:
        log.warning("resume: %s left as it is (%s); new samples go to new shards", name, why)
    if store.lost:
        log.warning(
            "resume: %d index lines dropped (damaged, gone or listed twice); what is not stored is redone: %s",
            len(store.lost),
            "; ".join(f"{i} ({why})" for i, why in store.lost[:5]) + (" ..." if len(store.lost) > 5 else ""),
        )


def log_folders(cfg) -> None:
    """Every folder the run writes to, first thing in its log."""
    from .backends.sglang import hydra_run_dir
    from .models import cache_dir

    log.info(
        "writing to: output_dir=%s | run log=%s | dumps=%s (RAM disk, removed at the end)%s",
        Path(cfg.output_dir).resolve(),
        hydra_run_dir() or "(no Hydra run folder)",
        cfg.capture.dump_dir,
        f" | built-in model cache={cache_dir()}" if str(cfg.model.path).startswith("builtin:") else "",
    )


def check_output_dir(out: Path) -> None:
    """Fail now, not after tokenizing a terabyte's worth of prompts."""
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir={out} is a file, not a directory")
    parent = out if out.exists() else next(p for p in out.parents if p.exists())
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputDirError(f"output_dir={out}: {parent} is not writable")
    inside = set_around(out)  # a set's shards/ folder, say, reached directly or through a link
    if inside is not None:
        raise OutputDirError(f"output_dir={out} lies inside the shard set {inside}: give the run a folder of its own")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int


def read_model_shape(cfg, model_dir: Path) -> ModelShape:
    """Depth and hidden size from the checkpoint's config.json (the language model's `text_config`
    in a multimodal wrapper such as Kimi-K2.5's); values set in the config must agree. The config
    itself is left as the user wrote it."""
    import json

    outer = json.loads((model_dir / "config.json").read_text())
    hf = outer.get("text_config", outer)
    where = f"{model_dir}/config.json" + (" (text_config)" if "text_config" in outer else "")
    shape = {}
    for key, ours in (("num_hidden_layers", "num_layers"), ("hidden_size", "hidden_size")):
        theirs, given = hf.get(key), cfg.model[ours]
        if theirs is None and given is None:
            raise schema.ConfigError(f"{where} has no {key}: set model.{ours}")
        if given is not None and theirs is not None and given != theirs:
            raise schema.ConfigError(f"model.{ours}={given} but {where} says {key}={theirs}")
        shape[ours] = given if given is not None else theirs
    shape = ModelShape(**shape)
    schema.check_layers(cfg, shape.num_layers)
    positions = hf.get("max_position_embeddings")
    if positions and cfg.data.max_length > positions:
        raise schema.ConfigError(
            f"data.max_length={cfg.data.max_length} exceeds the model's max_position_embeddings={positions}"
        )
    return shape


# -- capture ---------------------------------------------------------------------------------
def capture(cfg, job: Job) -> Captured:
    """Compute and store every sample still to do. On the way out, in this order: the packer drains
    (the server's writer may still hold the last passes), the backend closes (a server it launched
    begins its shutdown beside what follows: nothing durable waits on its drain), the packer stops
    (final commit), the dump folder goes. A signal ends it early but cleanly; a full disk ends the
    run (`run`)."""
    stop, started, interrupted, stopping = threading.Event(), time.time(), None, None
    with graceful_stop(stop), dump_folder(cfg) as dump_dir:
        budget = int(cfg.capture.budget_gb * (1 << 30))
        progress = Progress(len(job.todo), cfg.log_every_s, dump_dir, budget)
        codec = Codec(cfg.shards.zstd_level, entropy_only=cfg.shards.entropy_only, kind=cfg.shards.codec)
        with Packer(
            dump_dir,
            job.store,
            codec,
            job.slots,
            workers=cfg.shards.workers,
            dump_timeout_s=cfg.capture.dump_timeout_s,
            commit_every=cfg.shards.commit_every,
            progress=progress,
        ) as packer:
            try:
                stopping = compute(cfg, job, dump_dir, packer, stop)
                if stop.is_set():
                    interrupted = "interrupted by a signal"
            except KeyboardInterrupt:
                interrupted = "interrupted"
    progress.maybe_log(force=True)
    return Captured(packer, progress, started, interrupted, stopping)


def compute(cfg, job: Job, dump_dir: Path, packer: Packer, stop) -> threading.Thread | None:
    """The backend computes what is still to do while the packer stores it; returns the launched
    server's shutdown, begun as the backend closed. Nothing to do: no model loaded, no server started."""
    if not job.todo:
        return None
    with make_backend(cfg, job.model_dir, dump_dir, Path(cfg.output_dir)) as backend:
        todo = job.todo if job.regen is None else job.regen.complete(job, backend, stop)  # the target's turns
        early = packer.books.early  # the first samples all failing alike: the rest would too
        backend.run(todo, packer, should_stop=lambda: stop.is_set() or early.verdict is not None)
        if early.verdict is not None:
            raise early.verdict
        packer.progress.computed(packer.outstanding())
        packer.drain(timeout_s=cfg.capture.dump_timeout_s if stop.is_set() else None)
        packer.progress.drained()
    return getattr(backend, "stopping", None)  # set by its close(), just now


def dump_folder(cfg):
    """This run's own folder on the RAM disk, or, with an external server (server.launch=false),
    the folder that server was started with."""
    if cfg.backend.name == "sglang" and not cfg.server.launch:
        dump_dir = Path(cfg.capture.dump_dir)
        if not dump_dir.is_dir():
            raise OutputDirError(f"server.launch=false but capture.dump_dir={dump_dir} does not exist")
        return contextlib.nullcontext(dump_dir)
    return owned_dump_dir(cfg.capture.dump_dir)


def full_disk_message(err: OSError, cfg, job: Job | None) -> str:
    """Which disk is full, named by the file that could not be written (the RAM disk of the dump
    folder, or the output's filesystem), what the whole run needs, and the command that resumes."""
    if err.filename and Path(str(err.filename)).resolve().is_relative_to(Path(cfg.capture.dump_dir).resolve()):
        what = (
            f"the RAM disk of capture.dump_dir={cfg.capture.dump_dir} is full ({err}): lower "
            "capture.budget_gb or enlarge it (docker: ipc: host or shm_size)"
        )
    else:
        what = f"output disk full ({err}): free space on the filesystem of {cfg.output_dir}"
        if job is not None and job.todo:
            need = preflight.estimate(job.todo, len(job.slots), job.shape.hidden_size, cfg.shards.codec)[1]
            what += f" (this run stores about {units.size(need)})"
    return f"{what}; what is stored is kept: run the same command again to resume: {resume_command(cfg)}"


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


# -- finish ----------------------------------------------------------------------------------
def finish(cfg, job: Job, cap: Captured) -> dict:
    """Write the manifest, print the accounting, and turn failures into a non-zero exit."""
    packer, the_plan = cap.packer, job.plan
    counts = accounting(job, packer)
    fields = {
        "versions": versions(),
        "data": {
            "sources": the_plan.sources,
            "max_length": cfg.data.max_length,
            "overflow": cfg.data.overflow.value,
            "limit": cfg.data.limit,
            "shard_index": cfg.data.shard_index,
            "num_shards": cfg.data.num_shards,
        },
        "codec": codec_fields(cfg, job, packer),
        "backend": backend_provenance(cfg),
        "counts": counts,
        "examples": {"skipped": dict(the_plan.examples), "failed": dict(packer.examples)},
        "run": {"started": cap.started, "seconds": round(time.time() - cap.started, 3), "interrupted": cap.interrupted},
        "config": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }
    manifest = job.store.write_manifest(fields)  # a full disk here: `run` says so; resume rewrites it
    print_summary(Path(cfg.output_dir), counts, the_plan, packer, manifest)
    fail_unless_whole(cfg, counts, cap)
    return counts


def codec_fields(cfg, job: Job, packer) -> dict:
    """What the records hold: the codec, and for fp8 its measured error per slot, sqrt(sum of squared
    errors / sum of squares) over every sample it stored, this run's added to the set's earlier ones."""
    fields = {"name": codec_name(cfg.shards.codec), "zstd_level": cfg.shards.zstd_level,
              "transform": "byteplane" if cfg.shards.codec == "lossless" else "fp8-per-token-and-slot",
              "entropy_only": cfg.shards.entropy_only}  # fmt: skip
    if cfg.shards.codec != "fp8":
        return fields
    sums = packer.codec_error.copy()
    before = (job.store.earlier_manifest or {}).get("codec") or {}
    if before.get("name") == fields["name"] and isinstance(before.get("error_sums"), dict):
        sums += np.asarray([before["error_sums"].get(s, [0.0, 0.0]) for s in job.slots]).T
    fields["error_sums"] = {s: [float(e), float(n)] for s, e, n in zip(job.slots, *sums)}
    fields["rel_l2_error"] = {s: round(float(np.sqrt(e / n)), 6) if n else None for s, e, n in zip(job.slots, *sums)}
    return fields


def accounting(job: Job, packer) -> dict:
    """input = ok + skipped + failed + not done, for this run's input; stored_total for the set."""
    already = len(job.plan.samples) - len(job.todo)
    counts = {
        "input": job.plan.input,
        "ok": already + packer.ok,
        "ok_this_run": packer.ok,
        "already_stored": already,
        "skipped": dict(job.plan.skipped),
        "failed": dict(packer.failed),
        "not_done": len(job.todo) - packer.ok - sum(packer.failed.values()),
        # the set on disk, which a narrower resume (data.limit, fewer sources) does not shrink
        "stored_total": len(job.store.records),
        "stored_outside_this_input": len(job.store.records) - already - packer.ok,
    }
    if counts["stored_outside_this_input"]:
        log.warning(
            "the set holds %d samples outside this run's input (a smaller data.limit or other sources): "
            "the counts describe this input, stored_total the whole set (%d)",
            counts["stored_outside_this_input"],
            counts["stored_total"],
        )
    return counts


def fail_unless_whole(cfg, counts: dict, cap: Captured) -> None:
    """A stop, a failed sample or one neither stored nor failed: RunFailed (a non-zero exit)."""
    not_done, failed = counts["not_done"], counts["failed"]
    if cap.interrupted:
        raise RunFailed(
            f"{cap.interrupted}: {not_done} samples not done; run the same command again to resume: "
            f"{resume_command(cfg)}"
        )
    if failed:
        raise RunFailed(f"{sum(failed.values())} samples failed: {failed} (details in {cfg.output_dir}/manifest.json)")
    if not_done:  # neither stored nor failed, with no stop asked for: never a silent success
        raise RunFailed(
            f"{not_done} samples were neither stored nor failed; run the same command again to resume: "
            f"{resume_command(cfg)}"
        )


def resume_command(cfg) -> str:
    """The command that resumes this run: its own overrides, with output_dir pinned (the default is
    already stable; pinned, the command also works from another directory)."""
    import shlex

    args = [a for a in sys.argv[1:] if not a.startswith(("output_dir=", "-m", "--multirun"))]
    if not sys.argv or not sys.argv[0].endswith(("recipe/__main__.py", "-m", "recipe")):
        args = []  # called as a library (tests, notebooks): only the output_dir is known
    return shlex.join(["python", "-m", "recipe", *args, f"output_dir={cfg.output_dir}"])


def print_summary(out, counts, the_plan, packer, manifest) -> None:
    lines = [
        f"output: {out}",
        f"input {counts['input']} = ok {counts['ok']} (new {counts['ok_this_run']}, resumed {counts['already_stored']})"
        f" + skipped {sum(counts['skipped'].values())} + failed {sum(counts['failed'].values())}"
        + (f" + not done {counts['not_done']}" if counts["not_done"] else ""),
    ]
    t = manifest["totals"]
    ratio = f"{t['raw_bytes'] / t['stored_bytes']:.3f}x" if t["stored_bytes"] else "n/a"
    lines.append(
        f"stored: {t['samples']} samples, {t['tokens']} tokens, {units.size(t['stored_bytes'])} "
        f"(raw {units.size(t['raw_bytes'])}, ratio {ratio})"
    )
    for kind, ex in (("skipped", the_plan.examples), ("failed", packer.examples)):
        for reason, n in counts[kind].items():
            lines.append(f"  {kind} {reason}: {n}" + (f"  e.g. {ex[reason][0]}" if ex.get(reason) else ""))
    log.info("\n".join(lines))


# -- the command -----------------------------------------------------------------------------
schema.register()


def quiet_third_party() -> None:
    """transformers' and the hub's progress bars would interleave with the recipe's progress lines."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    quiet_third_party()
    try:
        run(cfg)
    except UserError as e:  # one line with the fix (bugs keep their traceback); HYDRA_FULL_ERROR=1 keeps it too
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", e)
        sys.exit(2)
