"""Exporters to the on-disk formats draft trainers read, and the per-sample items they share with
the direct datasets (`recipe.shards.trainers`). Layer-id conventions are mapped explicitly.

Ours: slot `layer_i` = residual stream entering decoder layer i (= HF output_hidden_states[i]);
`final_post_norm` = the last hidden state after the final norm.

specforge 0.2.0 (`specforge_hidden_states_v1`, as written by its scripts/prepare_hidden_states.py):
  rows_{g}-{g+2000}/data_{i}.ckpt[.gz], one torch.save dict per sample:
  input_ids [L] int64, loss_mask [L] int64 (1-D: its loader adds the batch dim), hidden_state
  [1, L, H] (final, post-norm), aux_hidden_state [1, L, K*H] (captured layers, ascending), bf16.
  Its `eagle_aux_hidden_state_layer_ids` count "output of layer k": k = our i - 1.
speculators 0.9.0 (vLLM extract_hidden_states layout, read by its ArrowDataset + FileTransfer):
  OUT/ is an Arrow dataset (input_ids, loss_mask, seq_len; torch format) and
  OUT/hidden_states/hs_{i}.safetensors = {token_ids [L], hidden_states [L, K+1, H]}, row i of the
  dataset aligned with hs_i. Its layer ids are ours. Its last slot must be the *pre-norm* final
  state: the trainer applies the verifier's norm itself (`verifier_norm` then `verifier_lm_head`).
  We store post-norm, so the last slot is a pre-norm equivalent: for RMSNorm with gain g (the weight
  w, or 1 + w in Gemma's and Qwen3-Next's), x = post / g has RMS 1 (post = g * h / rms(h)), hence
  norm(x) = g * x / rms(x) = post, up to eps and one bf16 rounding. It needs only the checkpoint's
  final-norm weight, no re-extraction (`final_norm_gain`).
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..procs import in_order
from .aliasing import refuse_alias, set_around, set_within
from .reader import ShardReader, manifest_needs

SPECFORGE_GROUP = 2000  # files per rows_* folder, SpecForge's --file-group-size default
EXPORT_CHUNK = 64  # samples per unit of work: small enough to spread, large enough to amortise
FINAL_NORM_MODES = ("pre-norm-equivalent", "refuse", "keep-post-norm")
ARROW_COLUMNS = ("input_ids", "loss_mask", "seq_len")  # speculators' Arrow table


class ExportError(UserError, ValueError):
    pass


# --- per-sample items (the exporters and the direct datasets build exactly these) -------------


def specforge_raw(x: dict, n_aux: int) -> dict:
    """One SpecForge feature record, as its offline writer persists it."""
    h = x["hidden"]  # [L, K+1, H] bf16
    L, _, H = h.shape
    return {
        "input_ids": x["input_ids"].long(),
        "loss_mask": x["loss_mask"].long(),
        "hidden_state": h[:, n_aux][None].clone(),
        "aux_hidden_state": h[:, :n_aux].reshape(L, n_aux * H)[None].clone(),
    }


def specforge_file(i: int) -> str:
    """Sample i's file in a SpecForge export (its prepare_hidden_states.py layout)."""
    g = i // SPECFORGE_GROUP * SPECFORGE_GROUP
    return f"rows_{g}-{g + SPECFORGE_GROUP}/data_{i}.ckpt"


def speculators_raw(x: dict, n_aux: int, final: str, norm_weight=None) -> dict:
    """One speculators hs_i record: captured layers, then the final slot as `final` says."""
    import torch

    h = x["hidden"]
    slots = [h[:, :n_aux]]
    if final == "pre-norm-equivalent":
        slots.append(pre_norm_equivalent(h[:, n_aux], norm_weight)[:, None])
    elif final == "keep-post-norm":
        slots.append(h[:, n_aux : n_aux + 1])
    return {"token_ids": x["input_ids"].long(), "hidden_states": torch.cat(slots, 1).contiguous()}


def pre_norm_equivalent(post, weight):
    """x with rmsnorm(x) * weight == post (see the module docstring); a zero weight maps to 0."""
    import torch

    w = weight.float()
    safe = torch.where(w == 0, torch.ones_like(w), w)
    x = torch.where(w == 0, torch.zeros_like(w), post.float() / safe)
    return x.to(post.dtype)


def final_norm_weight(model_dir: str | Path):
    """The final RMSNorm weight from a checkpoint's safetensors (`model.norm.weight`, under any
    prefix such as Kimi-K2.5's `language_model.`)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    elif (model_dir / "model.safetensors").exists():
        with safe_open(model_dir / "model.safetensors", "pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        raise ExportError(f"{model_dir} has no model.safetensors[.index.json]: pass --model-dir with the checkpoint")
    keys = [k for k in weight_map if k == "model.norm.weight" or k.endswith(".model.norm.weight")]
    if len(keys) != 1:
        raise ExportError(f"{model_dir}: expected one final-norm weight (*model.norm.weight), found {keys}")
    with safe_open(model_dir / weight_map[keys[0]], "pt") as f:
        return f.get_tensor(keys[0])


# model types whose RMSNorm multiplies by (1 + w), not w (transformers' Gemma and Qwen3-Next/3.5 classes)
ZERO_CENTERED = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "recurrent_gemma", "qwen3_next", "qwen3_5",
                           "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"})  # fmt: skip
# the ones speculators 0.9.0's verifier_norm applies (1 + w) for (speculators/models/utils.py); for any
# other it applies w to the checkpoint's weight
SPECULATORS_ZERO_CENTERED = frozenset({"gemma", "gemma2", "gemma3", "gemma3_text", "qwen3_5", "qwen3_5_text",
                                       "recurrent_gemma"})  # fmt: skip


def model_type(model_dir: str | Path) -> str:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return str(cfg.get("text_config", {}).get("model_type") or cfg.get("model_type") or "").lower()


def final_norm_gain(model_dir: str | Path):
    """What speculators' verifier_norm multiplies the normalised state by, per channel: the checkpoint's
    final-norm weight w, or 1 + w where the model and speculators both read it so. A model whose norm is
    (1 + w) but which speculators reads as w would get a wrong teacher however the slot is written:
    refused in one line."""
    w, kind = final_norm_weight(model_dir), model_type(model_dir)
    if kind in ZERO_CENTERED and kind not in SPECULATORS_ZERO_CENTERED:
        raise ExportError(
            f"{model_dir}: {kind}'s final norm multiplies by (1 + w), which speculators 0.9.0 applies as w: its "
            "teacher would be wrong; train this model with SpecForge, or pass --final-norm keep-post-norm"
        )
    return w.float() + 1 if kind in ZERO_CENTERED else w


def model_dir_of(reader: ShardReader, model_dir=None) -> Path:
    path = Path(model_dir or reader.manifest["model"]["path"])
    if not (path / "config.json").exists():
        raise ExportError(
            f"the target checkpoint {path} is not here: pass --model-dir (its final-norm weight "
            "makes the pre-norm state speculators trains toward)"
        )
    return path


def draft_config(reader: ShardReader, fmt: str) -> dict:
    """The values a draft config must match for this data, in the trainer's own convention."""
    m = reader.manifest
    layers = list(m["capture"]["layers"])
    base = {
        "target_model": m["model"]["name"],
        "target_model_path": m["model"]["path"],
        "hidden_size": m["model"]["hidden_size"],
        "target_num_hidden_layers": m["model"]["num_layers"],
        "our_layers_residual_in": layers,
    }
    if fmt == "specforge":
        return {
            **base,
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in layers],
            "convention": "SpecForge counts 'output of layer k' (k = our i - 1)",
        }
    return {
        **base,
        "target_layer_ids": layers,
        "train_args": "--target-layer-ids " + " ".join(map(str, layers)),
        "convention": "speculators/vLLM count 'input to layer k' (= ours)",
    }


# --- the export command ------------------------------------------------------------------------


def export(
    fmt: str,
    src,
    out,
    final_norm: str = "pre-norm-equivalent",
    model_dir=None,
    compress: bool = False,
    overwrite: bool = False,
    log=None,
    workers: int = 1,
    draft_vocab: int | None = None,
    target_vocab: int | None = None,
) -> dict:
    """Write `src`'s samples in trainer `fmt` to `out`, atomically: the files are built in a
    sibling staging folder and moved into place at the end, so a refused or failed export leaves
    nothing and a finished one is complete. `workers` processes write it; with `draft_vocab`, the
    trainer's d2t/t2d too (vocabmap.py). Returns export_info."""
    r, out, log = ShardReader(src), Path(out), log or sys.stderr  # stderr as it is now, not at import
    manifest_needs(r.root, r.manifest, "capture", ("layers", "final", "convention"))
    manifest_needs(r.root, r.manifest, "model", ("name", "path", "hidden_size", "num_layers"))
    refuse_unless_exportable(fmt, r, out, final_norm, overwrite)
    if workers < 1:
        raise ExportError(f"--workers {workers}: at least 1")
    norm_w = None
    if fmt == "speculators" and final_norm == "pre-norm-equivalent":
        norm_w = final_norm_gain(model_dir_of(r, model_dir))
    info = {"format": fmt, "source": str(Path(src).resolve()), "samples_total": len(r),
            "our_convention": r.manifest["capture"]["convention"], "draft_config": draft_config(r, fmt),
            "model_fingerprint": r.manifest.get("model_fingerprint")}  # fmt: skip
    if draft_vocab is not None:  # before a sample is written, not after all of them
        from .vocabmap import check_request

        check_request(r, draft_vocab, target_vocab)
    out.parent.mkdir(parents=True, exist_ok=True)
    with export_lock(out), staging(out) as stage:
        job = ExportJob(fmt, str(src), str(stage), len(r.manifest["capture"]["layers"]), final_norm, norm_w, compress)
        _write_stage(job, r, info, workers, log)
        if draft_vocab is not None:  # where each looks: SpecForge's extraction's folder, speculators' data_path
            from .vocabmap import write

            info["draft_config"]["draft_vocab_size"] = draft_vocab
            where = stage / "vocab_mapping" if fmt == "specforge" else stage
            info["vocab_map"] = write(src, where, draft_vocab, (fmt,), target_vocab)
        _write_text(stage / "export_info.json", json.dumps(info, indent=2) + "\n")
        if out.exists():
            refuse_unless_replaceable(out)  # again: a set may have been put there while this one wrote
            shutil.rmtree(out)
        os.replace(stage, out)
        os.chmod(out, 0o755)
    return info


@contextlib.contextmanager
def export_lock(out: Path):
    """One export into `out` at a time: a second is refused at once, before it writes anything (the
    lock file stays beside `out`: removing it would let a third export take a lock of its own)."""
    fd = os.open(out.parent / f".{out.name}.export-lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportError(f"another export is writing {out}: wait for it, or export elsewhere") from None
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def staging(out: Path):
    """A folder beside `out` made by this export alone (a fresh name: never a user's folder), removed
    at the end unless it became `out`."""
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        yield stage
    finally:
        if stage.exists():
            shutil.rmtree(stage)


def _write_stage(job: ExportJob, r: ShardReader, info: dict, workers: int, log) -> None:
    """The samples into the staging folder, with samples.jsonl (and speculators' Arrow table)."""
    stage, cap = Path(job.stage), r.manifest["capture"]
    rows, columns = _write_samples(job, r, workers, log)
    if job.fmt == "speculators":
        _write_arrow(columns, stage)
        info["hidden_states_slots"] = [f"input_to_layer_{i}" for i in cap["layers"]] + (
            ["final_pre_norm_equivalent"] if job.final_norm == "pre-norm-equivalent" else ["final_post_norm"]
        )
    _write_text(stage / "samples.jsonl", "".join(json.dumps(x) + "\n" for x in rows))


def refuse_unless_exportable(fmt: str, r: ShardReader, out: Path, final_norm: str, overwrite: bool) -> None:
    """One-line refusals before anything is written: format, norm mode, a non-empty OUT, no final slot."""
    if fmt not in ("specforge", "speculators"):
        raise ExportError(f"unknown export format {fmt!r}: specforge or speculators")
    if final_norm not in FINAL_NORM_MODES:
        raise ExportError(f"--final-norm {final_norm!r}: one of {', '.join(FINAL_NORM_MODES)}")
    refuse_alias(out, [r.root], ExportError)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"{out} is {'a symbolic link' if out.is_symlink() else 'a file'}: export into a folder")
    inside = set_around(out)
    if inside is not None:
        raise ExportError(f"{out} lies inside the shard set {inside}: writing there would destroy it; export elsewhere")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(
                f"{out} exists and is not empty: a trainer would read stale files there. "
                "Pass --overwrite to replace it, or choose another folder"
            )
        refuse_unless_replaceable(out)
    if not r.manifest["capture"]["final"]:
        raise ExportError(
            f"{fmt} trains toward the final hidden state: these shards were captured with capture.final=false"
        )
    if fmt == "speculators" and final_norm == "refuse":
        raise ExportError(
            "speculators applies the verifier's final norm to its last slot, which must be "
            "pre-norm; these shards hold it post-norm. Use --final-norm pre-norm-equivalent "
            "(the default: exact up to bf16 rounding)"
        )


def refuse_unless_replaceable(out: Path) -> None:
    """--overwrite deletes `out` whole: never where a shard set lies anywhere under it."""
    found = set_within(out)
    if found is not None:
        raise ExportError(f"{out} holds a shard set ({found}): --overwrite never deletes one; choose another folder")


@dataclass(frozen=True)
class ExportJob:
    """What every worker needs to write its range of samples (picklable into spawn workers)."""

    fmt: str
    src: str
    stage: str
    n_aux: int
    final_norm: str
    norm_w: object  # the final-norm weight (speculators' pre-norm equivalent), else None
    compress: bool


@dataclass(frozen=True)
class ExportPart:
    """Samples [lo, hi) written: their samples.jsonl rows, speculators' columns, bytes written."""

    rows: list
    columns: dict
    nbytes: int


_WORKER_READER: ShardReader | None = None  # one reader per worker process (opening one reads the index)


def _open_worker_reader(src: str) -> None:
    """A worker's setup: its reader, and one torch thread. The work is already split by process; N
    workers with torch's default of a thread per core oversubscribe the cores (its OpenMP threads
    spin), which on a busy node (trainers beside the export) slows each copy many times over."""
    import torch

    global _WORKER_READER
    torch.set_num_threads(1)
    _WORKER_READER = ShardReader(src)


def _write_range(job: ExportJob, lo: int, hi: int, r: ShardReader | None = None) -> ExportPart:
    """Samples lo..hi-1 (index order) as one file each."""
    import torch
    from safetensors.torch import save_file

    r = _WORKER_READER if r is None else r
    stage, rows, nbytes = Path(job.stage), [], 0
    columns = {k: [] for k in ARROW_COLUMNS}
    for i in range(lo, hi):
        sid = r.records[i]["id"]  # (r.ids builds the whole list)
        x = r.get(sid)
        if job.fmt == "specforge":
            rel = specforge_file(i) + (".gz" if job.compress else "")
            (stage / rel).parent.mkdir(exist_ok=True)
            rec = specforge_raw(x, job.n_aux)
            if job.compress:
                with gzip.open(stage / rel, "wb", compresslevel=6) as f:
                    torch.save(rec, f)
            else:
                torch.save(rec, stage / rel)
        else:
            rel = f"hidden_states/hs_{i}.safetensors"
            (stage / rel).parent.mkdir(exist_ok=True)
            save_file(speculators_raw(x, job.n_aux, job.final_norm, job.norm_w), str(stage / rel))
        os.chmod(stage / rel, 0o644)
        nbytes += (stage / rel).stat().st_size
        rows.append({"index": i, "file": rel, "id": sid, "tokens": int(x["input_ids"].shape[0])})
        if job.fmt == "speculators":
            columns["input_ids"].append(x["input_ids"].long().tolist())
            columns["loss_mask"].append(x["loss_mask"].long().tolist())
            columns["seq_len"].append(rows[-1]["tokens"])
    return ExportPart(rows, columns, nbytes)


def _write_samples(job: ExportJob, r: ShardReader, workers: int, log):
    """One file per sample, numbered in index order, in chunks spread over `workers` processes (one
    process decodes ~1.4 GB/s; a node's export of a terabyte needs more than one); returns the
    mapping rows and the columns of speculators' Arrow table, both in index order."""
    n = len(r)
    chunks = [(lo, min(lo + EXPORT_CHUNK, n)) for lo in range(0, n, EXPORT_CHUNK)]
    rows, columns = [], {k: [] for k in ARROW_COLUMNS}
    t0 = last = time.monotonic()
    nbytes = done = 0
    tasks = [(job, lo, hi) for lo, hi in chunks]
    with in_order(_write_range, tasks, workers, _open_worker_reader, (job.src,), r) as parts:
        for part in parts:  # in chunk order, as each finishes
            rows += part.rows
            for k, v in part.columns.items():
                columns[k] += v
            nbytes, done = nbytes + part.nbytes, done + len(part.rows)
            if time.monotonic() - last > 5 or done == n:
                last, mb = time.monotonic(), nbytes / 1e6
                rate = mb / max(last - t0, 1e-9)
                print(
                    f"export {job.fmt}: {done}/{n} samples, {mb:.0f} MB written, {rate:.0f} MB/s", file=log, flush=True
                )
    return rows, columns


def _write_arrow(columns, stage) -> None:
    """speculators' ArrowDataset reads load_from_disk(OUT), row i beside hidden_states/hs_i."""
    import datasets

    ds = datasets.Dataset.from_dict(columns)
    ds.set_format(type="torch")
    ds.save_to_disk(str(stage))
    for p in stage.iterdir():
        if p.is_file():
            os.chmod(p, 0o644)


def _write_text(path: Path, text: str) -> None:
    path.write_text(text)
    os.chmod(path, 0o644)
