"""Merge shard sets (one per data-parallel job) into one index + manifest.

Shard files are hard-linked into OUT/shards (copied across filesystems) under a per-set prefix; the
index is rewritten to point at them. Sets must agree on every field of the identity a resume
compares (`differences`, the same function), but their job's share of the data. A sample id
present in several sets is kept once and reported: ids are unique in OUT. An input that does not
verify is refused; OUT never aliases an input, and no file in it is ever written over.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import CorruptFile, UserError
from . import tokencounts
from .aliasing import refuse_alias, set_around
from .codec import CorruptRecord, crc32
from .reader import ShardReader
from .store import (
    IDENTITY,
    INDEX,
    MANIFEST,
    SHARD_DIR,
    atomic_write,
    atomic_write_json,
    identity_diff,
    index_lines,
    read_identity,
    read_index,
    read_manifest,
    summarize,
)

SPLIT_KEYS = ("sources", "split", "shard_index", "num_shards", "limit")  # which records a job took
JOB_SPLIT = frozenset(f"data.{k}" for k in SPLIT_KEYS)


def set_identity(d: Path, manifest: dict) -> dict:
    """A set's identity: identity.json, else the manifest's copy of it, else (a set from before
    both) the manifest's own fields."""
    saved = manifest.get("identity")
    legacy = {k: manifest.get(k) for k in ("format", "model_fingerprint", "capture", "tokenizer", "data")}
    return read_identity(d) or (saved if isinstance(saved, dict) else legacy)


def differences(a: dict, b: dict, names=("first", "second")) -> list[str]:
    """What makes two sets' samples differ: every identity field a resume compares (the same
    function), but the job's share of the data."""
    return identity_diff(a, b, names=names, ignore=JOB_SPLIT)


class MergeError(UserError, ValueError):
    pass


def merge(out, inputs) -> dict:
    out = Path(out)
    refuse_alias(out, inputs, MergeError)
    inside = set_around(out)
    if inside is not None:
        raise MergeError(f"{out} lies inside the shard set {inside}: merge into a folder of its own")
    if (out / INDEX).exists() or (out / MANIFEST).exists():
        raise MergeError(f"{out} already holds a shard set: merge into an empty directory")
    manifests = []
    for d in inputs:
        m = read_manifest(d)
        if m is None:
            raise MergeError(f"{d} has no manifest.json")
        manifests.append(m)
        problem = damaged(Path(d))
        if problem:
            raise MergeError(f"{d} does not verify ({problem}): mend it first (`python -m recipe.shards verify {d}`)")
    want = set_identity(Path(inputs[0]), manifests[0])
    for d, m in zip(inputs[1:], manifests[1:]):
        diff = differences(want, set_identity(Path(d), m), names=(f"{inputs[0]}:", f"{d}:"))
        if diff:
            raise MergeError(f"{d} and {inputs[0]} hold different samples:\n  " + "\n  ".join(diff))
    records, duplicates = link_shards_and_join_indexes(out, inputs)
    atomic_write(out / INDEX, index_lines(records))
    counts = merged_counts(out, inputs, records, duplicates)
    tokencounts.save(out, counts, records, atomic_write)
    ident = Path(inputs[0]) / IDENTITY
    if ident.exists():  # the merged set's identity: the first set's, without its job split
        merged_identity = json.loads(ident.read_text())
        merged_identity["data"] = {**merged_identity.get("data", {}), "sources": "merged", "shard_index": None,
                                   "num_shards": None}  # fmt: skip
        atomic_write_json(out / IDENTITY, merged_identity)
    manifest = merged_manifest(inputs, manifests, records, duplicates)
    manifest["token_counts"] = counts.summary()
    atomic_write_json(out / MANIFEST, manifest)
    return {"out": str(out), "samples": len(records), "duplicates": len(duplicates), "sets": len(inputs)}


def link_shards_and_join_indexes(out: Path, inputs) -> tuple[list[dict], list[dict]]:
    """Each input's shards hard-linked (copied across filesystems) as setKKK-<name>; their index
    records joined, a sample id already taken by an earlier set skipped and reported."""
    (out / SHARD_DIR).mkdir(parents=True, exist_ok=True)
    records, seen, duplicates = [], set(), []
    for k, d in enumerate(inputs):
        d, index = Path(d), read_index(Path(d))
        for name in sorted({r["shard"] for r in index}):  # by the index: a merged input's are setNNN-shard-*
            place(d / SHARD_DIR / name, out / SHARD_DIR / f"set{k:03d}-{name}")
        for r in index:
            if r["id"] in seen:
                duplicates.append({"id": r["id"], "set": str(d)})
                continue
            seen.add(r["id"])
            records.append({**r, "shard": f"set{k:03d}-{r['shard']}"})
    return records, duplicates


def merged_counts(out: Path, inputs, records: list[dict], duplicates: list[dict]) -> tokencounts.Counts:
    """The merged set's token counts: the inputs' own, joined in order, where every sample of each was
    kept; counted from the merged samples where a duplicate was dropped."""
    if duplicates:
        return tokencounts.catch_up(tokencounts.Counts(), out, records)
    parts = [tokencounts.load(Path(d), read_index(Path(d))) for d in inputs]
    return tokencounts.compose(parts, records)


def place(src: Path, dst: Path) -> None:
    """dst made a hard link of src, or a copy across filesystems: always a new file, never written
    into one that exists (it may be another set's shard through a link). A dst already linked to
    src (an interrupted merge, run again) is kept."""
    if dst.exists() or dst.is_symlink():
        if not dst.is_symlink() and (os.path.samefile(src, dst) or filecmp.cmp(src, dst, shallow=False)):
            return  # linked, or copied whole, by an earlier merge into this folder
        raise MergeError(f"{dst} exists and is not {src}: merge into an empty directory")
    try:
        os.link(src, dst)
        return
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".copy", dir=dst.parent)  # a new name, never reused
    with open(src, "rb") as a, os.fdopen(fd, "wb") as b:
        shutil.copyfileobj(a, b, 16 << 20)
        b.flush()
        os.fsync(b.fileno())
    os.replace(tmp, dst)


def damaged(d: Path) -> str | None:
    """The first thing that makes an input unfit to merge: an index that does not read, a record
    missing or cut short, a crc32 that does not match its bytes. None: every record is whole."""
    try:
        r = ShardReader(d)
    except (CorruptFile, CorruptRecord) as e:
        return str(e)
    for rec in r.records:
        try:
            frame = r.read_frame(rec)
        except (CorruptRecord, OSError) as e:
            return f"sample {rec['id']}: {e}"
        if crc32(frame) != rec["crc32"]:
            return f"sample {rec['id']} in {rec['shard']}: crc32 mismatch"
    return None


def merged_manifest(inputs, manifests: list[dict], records: list[dict], duplicates: list[dict]) -> dict:
    first = manifests[0]
    counts = {"merged": True, "input": 0, "ok": len(records), "skipped": {}, "failed": {},
              "duplicates": len(duplicates)}  # fmt: skip
    for m in manifests:
        c = m.get("counts") or {}
        counts["input"] += c.get("input", 0)
        for kind in ("skipped", "failed"):
            for reason, n in (c.get(kind) or {}).items():
                counts[kind][reason] = counts[kind].get(reason, 0) + n
    manifest = {k: first[k] for k in ("format", "model_fingerprint", "capture", "model", "tokenizer") if k in first}
    merged_from = [{"dir": str(Path(d).resolve()), "data": m.get("data"), "counts": m.get("counts")}
                   for d, m in zip(inputs, manifests)]  # fmt: skip
    manifest.update(versions=first.get("versions"), backend=first.get("backend"), codec=first.get("codec"))
    manifest.update(merged_from=merged_from, counts=counts, duplicates=duplicates[:100], **summarize(records))
    return manifest
