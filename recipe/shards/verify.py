"""`python -m recipe.shards verify DIR [--workers N]`: every checksum, frame and count of a shard set.

The index and the manifest are checked in this process; the records are decoded in ranges of index
order, over `workers` processes (one checks ~2 GB/s of raw data on 64 MB samples, docs/benchmarks.md:
a terabyte set takes about 8 minutes on one core), with a line every PROGRESS_EVERY_S seconds once it
runs that long.
"""

from __future__ import annotations

import collections
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import units
from ..errors import CorruptFile
from ..procs import in_order
from . import coverage, tokencounts
from .codec import CorruptRecord, Recycler, check_tokens, hidden_shape
from .reader import ShardReader, check_record, manifest_needs
from .repair import record_ends
from .store import SHARD_DIR, read_identity

RANGE_RECORDS = 4096  # records per task: few tasks for a million short chats
RANGE_RAW_BYTES = 256 << 20  # and few bytes (~0.2 s of decode), so that long samples spread evenly
PROGRESS_EVERY_S = 10.0
VERIFY_NEEDS = {"capture": ("slots",), "model": ("hidden_size",), "totals": ("samples", "tokens")}
REDO = "the command that made the set, run again with shards.deep_check=true, redoes them"
REDO_MERGED = "a merged set: the job that made them redoes them, then merge again"


def verify(root: Path, out=None, workers: int = 1, log=None) -> list[str]:
    """All problems found (empty = good). Names the sample and shard of each. `out` (the verdict and
    notes) and `log` (progress) default to stdout and stderr as they are at the call."""
    out, log = out or sys.stdout, log or sys.stderr
    problems = []
    try:
        r = ShardReader(root, refuse_duplicates=False)  # reported below, with the rest
        for part, keys in VERIFY_NEEDS.items():
            manifest_needs(root, r.manifest, part, keys)
    except (FileNotFoundError, ValueError) as e:  # no set, a damaged manifest, a malformed or lost index
        return [str(e)]
    try:
        read_identity(root)
    except CorruptFile as e:
        problems.append(str(e))
    for kind in ("id", "key"):
        dup = [k for k, n in collections.Counter(x[kind] for x in r.records).items() if n > 1]
        problems += [f"duplicate {kind} {k} in index" for k in dup]
    sizes = {f.name: f.stat().st_size for f in (root / SHARD_DIR).glob("*.bin") if f.is_file()}
    for f in sorted((root / SHARD_DIR).glob("*.bin")):
        if not f.is_file() or f.is_symlink():
            print(f"note: {f} is not a shard file (a folder or a link): never read; move it out of shards/", file=out)
    merged = bool((r.manifest.get("counts") or {}).get("merged"))
    redo = REDO_MERGED if merged else REDO
    lost = collections.defaultdict(list)
    for rec in r.records:
        if rec["offset"] + rec["length"] > sizes.get(rec["shard"], -1):
            lost[rec["shard"]].append(rec["id"])
    for shard, ids in lost.items():
        what = "is missing" if shard not in sizes else f"is cut short at {sizes[shard]} bytes"
        problems.append(f"{shard} {what}: {len(ids)} samples lost ({redo}): {', '.join(ids)}")
    gone = frozenset(i for ids in lost.values() for i in ids)  # only those: the rest of a cut shard is checked
    found, counts = record_problems(r, gone, workers, log)
    problems += [f"{p} ({redo.replace('them', 'it')})" for p in found]
    ends = record_ends(r.records)
    found, notes = coverage.unindexed(root, r.records, sizes, frozenset(lost))
    problems += found
    for x in notes:
        print(f"note: {x}", file=out)
    problems += manifest_problems(r.manifest, r.records)
    counted = None if problems else tokencounts.problem(root, r.records, counts)  # damaged ones give none
    problems += [counted] if counted else []
    verdict = "OK" if not problems else f"{len(problems)} problem(s)"
    print(f"verified {len(r.records)} samples in {len(ends)} shards: {verdict}", file=out)
    return problems


@dataclass(frozen=True)
class Checked:
    """What one range of records gave: its problems, in index order, and the raw bytes it covers."""

    problems: list[str]
    samples: int
    raw_bytes: int
    counts: dict  # the range's token counts (tokencounts.Counts.sparse), as a trainer's vocabulary counts them


def ranges(records: list[dict]) -> list[tuple[int, int]]:
    """Index order cut into [lo, hi) ranges of at most RANGE_RECORDS records or RANGE_RAW_BYTES raw bytes."""
    out, lo, nbytes = [], 0, 0
    for i, rec in enumerate(records):
        if i > lo and (i - lo >= RANGE_RECORDS or nbytes + rec.get("raw_bytes", 0) > RANGE_RAW_BYTES):
            out.append((lo, i))
            lo, nbytes = i, 0
        nbytes += rec.get("raw_bytes", 0)
    return out + ([(lo, len(records))] if lo < len(records) else [])


def record_problems(r: ShardReader, lost: frozenset, workers: int = 1, log=None) -> tuple[list, tokencounts.Counts]:
    """Every record but the `lost` ids (named already) checked as the reader decodes it (its checksum, frames, its
    own id) and its shapes against the manifest, and its tokens counted (read once, with the rest, over
    the workers): in this process, or over `workers` spawned ones, each handed its ranges' index lines."""
    tasks = [(r.records[lo:hi], lost) for lo, hi in ranges(r.records)]
    progress = Progress(len(r), sum(x.get("raw_bytes", 0) for x in r.records), log)
    problems, counts = [], tokencounts.Counts()
    with in_order(check_range, tasks, workers, _open_worker_reader, (str(r.root),), r) as parts:
        for part in parts:  # in index order, as each finishes
            problems += part.problems
            counts.extend(tokencounts.Counts.of_sparse(part.counts))
            progress.add(part)
    return problems, counts


_WORKER_READER: ShardReader | None = None  # a worker's shards and manifest (its records come with each range)


def _open_worker_reader(root: str) -> None:
    global _WORKER_READER
    _WORKER_READER = ShardReader(root, refuse_duplicates=False, index=False)


def check_range(recs: list[dict], lost: frozenset, r: ShardReader | None = None) -> Checked:
    r = _WORKER_READER if r is None else r
    problems, nbytes, tokens = [], 0, []
    recycler = Recycler()  # one sample's memory, reused for every sample
    for rec in recs:
        nbytes += rec.get("raw_bytes", 0)
        why, got = (None, None) if rec["id"] in lost else check_one(r, rec, recycler)
        if why is not None:
            problems.append(f"sample {rec['id']} ({rec['shard']} @ {rec['offset']}): {why}")
        tokens.append(got or NO_TOKENS)  # one line each: a damaged record's counts are never used
    counts = tokencounts.Counts()
    counts.add_many(tokens)
    for shard in {rec["shard"] for rec in recs}:  # its pages, read through, need not stay in this process
        r.let_go(shard)
    return Checked(problems, len(recs), nbytes, counts.sparse())


NO_TOKENS = ((), ())


def check_one(r: ShardReader, rec: dict, recycler: Recycler) -> tuple[str | None, tuple | None]:
    """(why the record is not what its line and the manifest say, or None; its ids and loss mask)."""
    try:  # what the reader's decode refuses, without joining the planes into words
        header, tokens = check_tokens(r.read_frame(rec), rec["crc32"], recycler)
        shapes = {t["name"]: tuple(t["shape"]) for t in header["tensors"]}
        check_record(rec, header["meta"], shapes["input_ids"][0], r.slots)
    except (CorruptRecord, OSError) as e:
        return str(e), None
    h, want = hidden_shape(header), (rec["tokens"], len(r.slots), r.manifest["model"]["hidden_size"])
    if h != want:
        return f"hidden shape {h}, expected {want}", None
    if shapes["input_ids"][0] != rec["tokens"] or shapes["loss_mask"][0] != rec["tokens"]:
        return f"ids/mask length differ from {rec['tokens']} tokens", None
    return None, tokens


class Progress:
    """A line every PROGRESS_EVERY_S seconds (none for a verify shorter than that): samples, raw
    bytes and their rate, problems so far, ETA."""

    def __init__(self, samples: int, raw_bytes: int, log):
        self.total, self.total_bytes, self.log = samples, raw_bytes, log
        self.samples = self.nbytes = self.problems = 0
        self.t0 = self.last = time.monotonic()

    def add(self, part: Checked) -> None:
        self.samples, self.nbytes = self.samples + part.samples, self.nbytes + part.raw_bytes
        self.problems += len(part.problems)
        now = time.monotonic()
        if self.log is None or now - self.last < PROGRESS_EVERY_S or self.samples == self.total:
            return
        self.last, rate = now, self.nbytes / max(now - self.t0, 1e-9)
        eta = units.duration((self.total_bytes - self.nbytes) / rate) if rate else "unknown"
        print(
            f"verify: {self.samples}/{self.total} samples, {units.size(self.nbytes)} of "
            f"{units.size(self.total_bytes)} raw, {units.rate(rate)} | {self.problems} problem(s) so far | ETA {eta}",
            file=self.log,
            flush=True,
        )


def manifest_problems(m: dict, records: list[dict]) -> list[str]:
    """The manifest's totals against the index, and its counts against themselves."""
    problems = []
    t, tokens = m["totals"], sum(x["tokens"] for x in records)
    if t["samples"] != len(records) or t["tokens"] != tokens:
        problems.append(
            f"manifest totals {t['samples']} samples/{t['tokens']} tokens disagree with the index "
            f"({len(records)}/{tokens})"
        )
    c = m.get("counts")
    if c and not c.get("merged"):
        accounted = c["ok"] + sum(c["skipped"].values()) + sum(c["failed"].values()) + c.get("not_done", 0)
        if accounted != c["input"]:
            problems.append(f"accounting: ok+skipped+failed+not_done = {accounted} != input {c['input']}")
        if c["ok"] > len(records):
            problems.append(f"manifest counts {c['ok']} ok samples but the index holds {len(records)}")
    return problems
