"""What a resume (or `python -m recipe.shards repair`) may trust of a shard set, and what it does with
the rest. The bytes decide, never the index alone:
- a shard whose index lines tile it exactly (from offset 0, no gap, its size their end, its first and
  last record the ones they name) is trusted as it is: a million lines cost a second;
- any other shard (and every shard with `deep`, or when the index holds a malformed line) is walked
  record by record along its own framing (`framing.py`). A line is kept where its record is; a line
  whose fields disagree with the record there, but whose crc32 matches those bytes, is re-indexed
  from the record's own header; a line whose record is gone or damaged is dropped and redone;
- a whole record no kept line names is indexed from itself: a lost or shortened index, or a crashed
  run's append that reached the file but not the index (it is whole: its frame A checksum holds and
  frame B is exactly where its header says). Where a line names its sample, only if its bytes are
  the ones that line committed (its crc32);
- bytes are cut only at a shard's end, past every byte any line names, and only where they are a
  torn append (they begin as a record and the file ends before it does). Foreign or damaged bytes
  are left as they are and named; new samples then go to another shard.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from pathlib import Path

from . import framing
from .belonging import Foreign
from .codec import CorruptRecord

LINE_FIELDS = {"id": str, "key": str, "shard": str, "offset": int, "length": int, "tokens": int,
               "raw_bytes": int, "crc32": int}  # fmt: skip


def line_problem(r) -> str | None:
    """Why an index line is not one the recipe writes (None: it has every field, of the right type)."""
    if type(r) is not dict:
        return "not JSON" if isinstance(r, str) and type(r) is not str else f"a JSON {type(r).__name__}, not an object"
    for k, t in LINE_FIELDS.items():
        if type(r.get(k)) is not t:
            return f"its {k!r} is {'missing' if k not in r else type(r[k]).__name__}, not {t.__name__}"
    if r["offset"] < 0 or r["length"] < 1 or "/" in r["shard"] or not r["shard"].endswith(".bin"):
        return "its place (shard, offset, length) cannot be one"
    return None


def problems(lines: list) -> dict[int, str]:
    """line_problem of each line that has one, by its place in `lines`. A million lines are most of
    a resume's plan, so the usual index (every line well formed) is judged in bulk, a column at a time
    in C; any doubt and each line is judged alone, by line_problem."""
    if _well_formed(lines):
        return {}
    return {n: why for n, r in enumerate(lines) if (why := line_problem(r)) is not None}


def _well_formed(lines: list) -> bool:
    """Every line an object with every field of its exact type (a bool is not an int), places that can be."""
    if not lines:
        return True
    if set(map(type, lines)) != {dict}:
        return False
    try:
        for k, t in LINE_FIELDS.items():
            if set(map(type, map(itemgetter(k), lines))) != {t}:
                return False
    except KeyError:
        return False
    return (min(map(itemgetter("offset"), lines)) >= 0 and min(map(itemgetter("length"), lines)) >= 1
            and all("/" not in s and s.endswith(".bin") for s in set(map(itemgetter("shard"), lines))))  # fmt: skip


@dataclass(frozen=True)
class Checked:
    """The index to keep and what was done to get it."""

    kept: list[dict]
    dropped: list[tuple[str, str]] = field(default_factory=list)  # (sample id, why): redone
    cuts: list[tuple[str, int, int]] = field(default_factory=list)  # (shard, cut at, bytes dropped)
    left: list[tuple[str, str]] = field(default_factory=list)  # (shard, why its bytes stay as they are)
    ends: dict[str, int] = field(default_factory=dict)  # per shard, where its last kept record ends
    reindexed: list[tuple[str, str]] = field(default_factory=list)  # (sample id, what its line had wrong)
    recovered: list[str] = field(default_factory=list)  # ids indexed from records no line named
    changed: bool = False  # the index must be written again


def _mapped(path: Path):
    if not path.is_file() or path.is_symlink():
        return None
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if os.fstat(f.fileno()).st_size else None


def record_ends(records) -> dict[str, int]:
    """Per shard, where its last indexed record ends."""
    ends: dict[str, int] = {}
    for r in records:
        ends[r["shard"]] = max(ends.get(r["shard"], 0), r["offset"] + r["length"])
    return ends


def tiles(recs: list[dict], size: int) -> bool:
    """The lines cover the shard exactly: from 0, each record where the last one ended, up to its size."""
    at = 0
    for r in (
        recs
        if all(a["offset"] < b["offset"] for a, b in zip(recs, recs[1:]))
        else sorted(recs, key=lambda r: r["offset"])
    ):
        if r["offset"] != at:
            return False
        at += r["length"]
    return at == size


def _names_its_record(m, r: dict) -> bool:
    try:
        header = framing.record_header(m[r["offset"] : r["offset"] + min(r["length"], framing.HEAD_BYTES)])
    except CorruptRecord:
        return False
    return header["meta"].get("id") == r["id"] and header["meta"].get("key", r["key"]) == r["key"]


def trusted(m, recs: list[dict], size: int) -> bool:
    """The cheap check: the lines tile the shard and its first and last record are theirs."""
    return m is not None and tiles(recs, size) and all(_names_its_record(m, r) for r in (recs[0], recs[-1]))


def check(shard_dir: Path, lines: list, deep: bool = False, suspect: set[str] = frozenset(),
          foreign: Foreign | None = None) -> Checked:  # fmt: skip
    """`lines`: the index as read (malformed lines included). `suspect`: shards walked whatever the
    cheap check says. `foreign` (belonging.judge): why a record no line names is not the set's own."""
    bad = problems(lines)
    valid = [r for n, r in enumerate(lines) if n not in bad] if bad else lines
    dropped = [(str(lines[n].get("id")) if type(lines[n]) is dict else "?", f"malformed index line ({why})")
               for n, why in bad.items()]  # fmt: skip
    by_shard: dict[str, list[dict]] = {}
    for name, run in groupby(valid, key=itemgetter("shard")):  # a shard's lines mostly come in one run
        by_shard.setdefault(name, []).extend(run)
    disk = {f.name: f for f in shard_dir.glob("*.bin")} if shard_dir.is_dir() else {}  # merged: setNNN-shard-*
    ids_twice = _ids_listed_twice(valid)
    walked, ends = {}, {}
    for name in sorted(set(disk) | set(by_shard)):
        recs, m = by_shard.get(name, []), _mapped(shard_dir / name)
        size = len(m) if m is not None else 0
        doubt = deep or dropped or name in suspect or (ids_twice and any(r["id"] in ids_twice for r in recs))
        if recs and not doubt and trusted(m, recs, size):
            ends[name] = size
            m.close()
        elif m is not None or recs:
            walked[name] = Walk.of(name, m, recs, deep)
    if not walked and not ids_twice:  # every line kept as it is, each id once
        return Checked(list(valid), dropped, ends=ends, changed=bool(dropped))
    out, dropped = _in_index_order(valid, walked, dropped)
    got = Checked(out, dropped, ends=ends, reindexed=[x for w in walked.values() for x in w.reindexed])
    named: dict[str, set] = {}
    for r in valid:
        named.setdefault(r["id"], set()).add(r["crc32"])
    return _recover_and_cut(got, walked, named, foreign)


def _ids_listed_twice(lines: list[dict]) -> set[str]:
    if len(set(map(itemgetter("id"), lines))) == len(lines):
        return set()
    seen, twice = set(), set()
    for r in lines:
        (twice if r["id"] in seen else seen).add(r["id"])
    return twice


@dataclass
class Walk:
    """One shard read along its framing: its whole records, and the lines that name them."""

    name: str
    m: object
    found: dict  # offset -> (length, header) of every whole record reached
    keep: dict[int, dict]  # id() of a line -> the line kept for it (itself, or re-indexed)
    dropped: list[tuple[str, str]]
    reindexed: list[tuple[str, str]]
    lines_end: int  # the furthest byte any line (kept or not) names

    @classmethod
    def of(cls, name: str, m, recs: list[dict], deep: bool) -> "Walk":
        size, found = (len(m) if m is not None else 0), {}
        if m is not None:
            framing.walk(m, 0, found)
            for r in recs:  # past a damaged record, the walk picks up again at the next line's place
                if r["offset"] < size:
                    framing.walk(m, r["offset"], found)
        w = cls(name, m, found, {}, [], [], max((r["offset"] + r["length"] for r in recs), default=0))
        for r in recs:
            w.judge(r, size, deep)
        return w

    def judge(self, r: dict, size: int, deep: bool) -> None:
        """Keep, re-index or drop one line, by the record at its place."""
        got = self.found.get(r["offset"])
        if got is None:
            why = "its shard is missing" if self.m is None else "its shard is cut short" if (
                r["offset"] + r["length"] > size) else "no whole record starts at its place"  # fmt: skip
            self.dropped.append((r["id"], why))
            return
        length, header = got
        meta, tokens = header["meta"], framing.tokens_of(header)
        same = (length, meta.get("id"), meta.get("key", r["key"]), tokens or r["tokens"]) == (
            r["length"], r["id"], r["key"], r["tokens"])  # fmt: skip
        if same and not deep:
            self.keep[id(r)] = r
            return
        if framing.crc_of(self.m, r["offset"], length) != r["crc32"]:
            self.dropped.append(
                (r["id"], "crc32 mismatch" if same else f"the record at its place is sample {meta.get('id')}")
            )
        elif same:
            self.keep[id(r)] = r
        else:
            self.reindex(r, length)

    def reindex(self, r: dict, length: int) -> None:
        try:
            line = {**r, **framing.line_of(self.m, self.name, r["offset"], length)}
        except CorruptRecord as e:
            self.dropped.append((r["id"], str(e)))
            return
        wrong = [k for k in ("id", "key", "length", "tokens", "raw_bytes", "loss_tokens") if r.get(k) != line.get(k)]
        self.reindexed.append((line["id"], "its line had another " + ", ".join(wrong)))
        self.keep[id(r)] = line


def _in_index_order(valid: list[dict], walked: dict, dropped: list) -> tuple[list[dict], list]:
    """The lines kept, in index order, each sample id once (its first line that holds)."""
    out, seen = [], set()
    for r in valid:
        w = walked.get(r["shard"])
        x = r if w is None else w.keep.get(id(r))
        if x is None:
            continue
        if x["id"] in seen:
            dropped.append((x["id"], "listed twice in the index"))
            continue
        seen.add(x["id"])
        out.append(x)
    return out, dropped + [d for w in walked.values() for d in w.dropped]


def _recover_and_cut(got: Checked, walked: dict, named: dict, foreign: Foreign | None) -> Checked:
    """Whole records no kept line names are indexed from themselves: one whose sample some line
    names only if its bytes are the ones that line committed (its crc32), and only if it is the set's
    own (`foreign`). Then each walked shard's end is judged. `named`: sample id -> the crc32s its lines give."""
    kept, ids = list(got.kept), {r["id"] for r in got.kept}
    recovered, cuts, left, ends = [], [], [], dict(got.ends)
    places: dict[str, set] = {}
    strangers: dict[str, str] = {}  # shard -> why its unnamed records are another set's
    damaged: list[tuple[str, str]] = []  # (sample id, why) of unnamed records that do not decode
    for r in kept:
        if r["shard"] in walked:
            places.setdefault(r["shard"], set()).add(r["offset"])
    for name, w in walked.items():
        size = len(w.m) if w.m is not None else 0
        claimed = places.get(name, set())
        for at in sorted(w.found):
            rid = w.found[at][1]["meta"].get("id")
            if at in claimed or rid in ids:
                continue
            try:
                line = framing.line_of(w.m, name, at, w.found[at][0])
            except CorruptRecord as e:  # framed whole, but its bytes do not decode: named, and redone
                damaged.append((str(rid), f"its record in {name} at {at} is damaged ({e})"))
                continue
            if rid in named and line["crc32"] not in named[rid]:
                continue  # damaged since that line committed it: its bytes stay, the sample is redone
            why = foreign(w.m[at : at + w.found[at][0]], w.found[at][1]) if foreign else None
            if why is not None:
                strangers.setdefault(name, why)
                continue
            kept.append(line)
            ids.add(rid)
            recovered.append(rid)
            claimed.add(at)
        end = max((at + w.found[at][0] for at in claimed), default=0)  # every kept place was found
        ends[name] = end
        cut, why = _judge_end(w, max(end, w.lines_end), size)
        if cut is not None:
            cuts.append((name, cut, size - cut))
            size = cut
        if name in strangers:
            left.append((name, f"it holds records of another set or model ({strangers[name]}): never indexed"))
        elif size > end:
            left.append((name, why or f"bytes {end}..{size} hold no record the index can name (damaged or foreign)"))
        if w.m is not None:
            w.m.close()
    changed = bool(got.dropped or got.reindexed or recovered) or len(kept) != len(got.kept)
    lost = got.dropped + [d for d in damaged if d[0] not in ids and d[0] not in {x for x, _ in got.dropped}]
    return Checked(kept, lost, cuts, left, ends, got.reindexed, recovered, changed)


def _judge_end(w: Walk, at: int, size: int) -> tuple[int | None, str | None]:
    """(where to cut, None) when the bytes from `at` to the shard's end are a torn append; else
    (None, why those bytes stay)."""
    if at >= size:
        return None, None
    if framing.torn(w.m, at):
        return at, None
    if framing.record_at(w.m, at) is not None:
        sid = framing.record_at(w.m, at)[1]["meta"].get("id")
        return None, f"the bytes after offset {at} hold sample {sid}, which the index places elsewhere"
    return None, f"{size - at} bytes after offset {at} are not a record"
