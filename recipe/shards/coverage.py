"""What verify says of the shard bytes no index line covers: the gaps between indexed records and
each shard's bytes after its last one, read along their own framing (`framing.py`).
- whole records of samples the index does not hold: a problem (the index lost them; `repair`
  indexes them again);
- a torn record at a shard's end: a problem (a crashed run's append; a resume or `repair` cuts it);
- a copy of a sample indexed elsewhere (a merge skipped it), or bytes that are no record (damaged
  or foreign, which a resume leaves as they are): a note; no reader ever reads them.
"""

from __future__ import annotations

import mmap
from pathlib import Path

from . import belonging, framing
from .codec import CorruptRecord
from .store import SHARD_DIR, committed_ends


def gaps(recs: list[dict], size: int) -> list[tuple[int, int]]:
    """The [a, b) ranges of a shard of `size` bytes that no record in `recs` covers."""
    out, at = [], 0
    for r in sorted(recs, key=lambda r: r["offset"]):
        if r["offset"] > at:
            out.append((at, r["offset"]))
        at = max(at, r["offset"] + r["length"])
    return out + ([(at, size)] if size > at else [])


def unindexed(root: Path, records: list[dict], sizes: dict[str, int], lost: frozenset) -> tuple[list, list]:
    """(problems, notes) for every shard's unindexed bytes; shards in `lost` are reported already. A
    torn record inside the bytes the manifest counts is a damaged committed one, not an append."""
    committed = committed_ends(root) or {}
    by_shard: dict[str, list[dict]] = {}
    for r in records:
        by_shard.setdefault(r["shard"], []).append(r)
    ids, problems, notes = {r["id"] for r in records}, [], []
    foreign = belonging.of_set(root)
    for name, size in sorted(sizes.items()):
        holes = gaps(by_shard.get(name, []), size) if name not in lost else []
        if not holes:
            continue
        with open(root / SHARD_DIR / name, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        try:
            for a, b in holes:
                p, n = _judge(m, a, b, ids, f"{name} bytes {a}..{b}", root, committed.get(name, 0), foreign)
                problems += p
                notes += n
        finally:
            m.close()
    return problems, notes


def _judge(m, a: int, b: int, ids: set, where: str, root: Path, committed: int, foreign) -> tuple[list, list]:
    """What one unindexed range holds, record by record from its start."""
    fix = f"`python -m recipe.shards repair {root}`"
    problems, notes, copies, strangers, pos = [], [], 0, [], a
    while pos < b:
        rec = framing.record_at(m, pos)
        if rec is None or pos + rec[0] > b:
            break
        sid = rec[1]["meta"].get("id")
        why = foreign(m[pos : pos + rec[0]], rec[1]) if foreign and sid not in ids else None
        broken = None if sid in ids or why is not None else _undecodable(m, pos, rec[0])
        if sid in ids:
            copies += 1
        elif why is not None:
            strangers.append(why)
        elif broken is not None:
            problems.append(f"{where}: sample {sid} is in no index line, and its record is damaged ({broken}): the "
                            "command that made the set redoes it")  # fmt: skip
        else:
            problems.append(f"{where}: sample {sid}, whole, is in no index line ({fix} indexes it)")
        pos += rec[0]
    if strangers:
        notes.append(f"{where}: {len(strangers)} records of another set or model ({strangers[0]}); never indexed "
                     "or read: move the file out of shards/")  # fmt: skip
    if copies:
        notes.append(f"{where}: {copies} copies of samples the index holds elsewhere (no reader reads them)")
    if pos < b and b == len(m) and pos >= committed and framing.torn(m, pos):
        problems.append(f"{where}: a torn record at offset {pos}, a crashed run's append ({fix} cuts it)")
    elif pos < b:
        notes.append(
            f"{where}: {b - pos} bytes at offset {pos} are not a record (left as they are; no reader reads them)"
        )
    return problems, notes


def _undecodable(m, at: int, length: int) -> str | None:
    """Why the framed record at m[at:at+length] does not decode (checksum, sizes), or None: it is whole."""
    try:
        framing.line_of(m, "", at, length)
    except CorruptRecord as e:
        return str(e)
    return None
