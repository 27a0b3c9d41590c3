"""What a resume may trust of a shard set it is about to extend, checked every time (cheaply) and,
with `deep`, down to every checksum. Nothing here trusts the index alone:
- an index line is kept only if its record is there: the shard long enough, a record starting at its
  offset (first and last of every shard: the record's own id read from its header; every record with
  `deep`: its crc32 too);
- a line listed twice is kept once;
- bytes after a shard's last kept record are cut only when they are provably not needed: a record
  there whose id no index line names (a crashed run's append), or the damaged record a dropped line
  placed exactly there (redone). Anything else (a renamed or swapped shard, foreign bytes) is left as
  it is and named, never cut.
Dropped lines are redone by the resume.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

from .codec import ZSTD_MAGIC, CorruptRecord, crc32, record_header


@dataclass(frozen=True)
class Checked:
    """The index lines to keep, what was dropped and why, the tails to cut, the files left alone."""

    kept: list[dict]
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (sample id, why)
    cuts: list[tuple[str, int, int]] = field(default_factory=list)  # (shard, cut at, bytes dropped)
    left: list[tuple[str, str]] = field(default_factory=list)  # (shard, why its extra bytes stay)
    ends: dict[str, int] = field(default_factory=dict)  # per shard, where its last kept record ends


def _mapped(path: Path):
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if os.fstat(f.fileno()).st_size else None


def _why_bad(m, rec: dict, deep: bool) -> str | None:
    end = rec["offset"] + rec["length"]
    if m is None or len(m) < end:
        return "its shard is missing or cut short"
    frame = memoryview(m)[rec["offset"] : end]
    try:
        header = record_header(frame)
    except CorruptRecord as e:
        return str(e)
    if header["meta"].get("id") != rec["id"]:
        return f"the record at its place is sample {header['meta'].get('id')}"
    if deep and crc32(frame) != rec["crc32"]:
        return "crc32 mismatch"
    return None


def check(shard_dir: Path, records: list[dict], deep: bool = False) -> Checked:
    dropped, unique, seen = [], [], set()
    for r in records:
        if r["id"] in seen:
            dropped.append((r["id"], "listed twice in the index"))
        else:
            seen.add(r["id"])
            unique.append(r)
    by_shard: dict[str, list[dict]] = {}
    for r in unique:
        by_shard.setdefault(r["shard"], []).append(r)
    bad: dict[str, str] = {}
    indexed_ends = record_ends(unique)
    for name, recs in by_shard.items():
        path = shard_dir / name
        m = _mapped(path) if path.exists() else None
        for r in recs if deep else [recs[0], recs[-1]]:
            why = _why_bad(m, r, deep)
            if why is not None:
                bad[r["id"]] = why
        suspect = not deep and any(r["id"] in bad for r in (recs[0], recs[-1]))
        # a shard whose ends are wrong is not the file the index names: none of it is kept. The
        # record by record pass only where something is wrong: a million lines cost a second.
        if suspect or m is None or len(m) < indexed_ends[name]:
            for r in recs:
                if r["id"] not in bad and (suspect or m is None or len(m) < r["offset"] + r["length"]):
                    bad[r["id"]] = f"{name} does not hold what the index says" if suspect else "its shard is cut short"
        if m is not None:
            m.close()
    kept = [r for r in unique if r["id"] not in bad] if bad else unique
    ends = record_ends(kept) if bad else indexed_ends
    cuts, left = _tails(shard_dir, ends, records)
    return Checked(kept, dropped + list(bad.items()), cuts, left, ends)


def record_ends(records) -> dict[str, int]:
    """Per shard, where its last indexed record ends."""
    ends: dict[str, int] = {}
    for r in records:
        ends[r["shard"]] = max(ends.get(r["shard"], 0), r["offset"] + r["length"])
    return ends


def _tails(shard_dir: Path, ends: dict[str, int], records: list[dict]) -> tuple[list, list]:
    """Bytes past each shard's last kept record (`ends`): cut if they start with a crashed run's
    uncommitted record (one no index line names) or with the very record a dropped line placed there
    (damaged, and redone); else left. `records`: every index line, looked up only where bytes follow."""
    cuts, left, indexed = [], [], None
    for f in sorted(shard_dir.glob("shard-*.bin")):
        size, want = f.stat().st_size, ends.get(f.name, 0)
        if size <= want:
            continue
        with open(f, "rb") as fh:
            fh.seek(want)
            head = fh.read(min(size - want, 1 << 20))
        try:
            first = record_header(head)["meta"].get("id")
        except CorruptRecord:
            first = None  # a torn append (the crash cut its header): uncommitted, if a record starts here
            if not head.startswith(ZSTD_MAGIC):
                left.append((f.name, f"{size - want} bytes after offset {want} are not a record"))
                continue
        if indexed is None:  # a million lines: built only for a set that has a tail to judge
            indexed = {r["id"]: (r["shard"], r["offset"]) for r in records}
        if first in indexed and indexed[first] != (f.name, want):
            left.append(
                (f.name, f"the bytes after offset {want} hold sample {first}, which the index places elsewhere")
            )
            continue
        cuts.append((f.name, want, size - want))
    return cuts, left
