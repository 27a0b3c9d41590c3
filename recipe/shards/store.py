"""The durable side of the pipeline: shard files, the index and the manifest of one output directory.

Identity: identity.json (format, model, capture, tokenizer, data) is written durably before the
first sample and checked on every open, so a resume with another configuration is refused even
after a run that was killed before it wrote any manifest.

Crash-safety order (what makes resume exact):
  1. sample frames are appended to the current shard file;
  2. commit(): the shard is fsynced, *then* their index lines are appended to index.jsonl and fsynced;
  3. on open, a torn last index line is dropped and each shard is truncated to the end of its last
     indexed record, so bytes written after the last commit vanish and are redone;
  4. indexed samples whose shard is missing or cut short are dropped from the index (and redone).
manifest.json and identity.json are only ever replaced whole (temp file, fsync, rename). Shard names
are never reused: a new shard is numbered past every name on disk and in the index.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptFile, UserError
from . import repair
from .codec import scan_json

INDEX = "index.jsonl"
MANIFEST = "manifest.json"
IDENTITY = "identity.json"
SHARD_DIR = "shards"
# What a shard set *is*; a resume must agree on every field of the identity (see recipe.provenance).
PROVENANCE_KEYS = ("format", "model_fingerprint", "capture")


class ProvenanceMismatch(UserError, RuntimeError):
    pass


def identity_diff(old: dict, new: dict, prefix: str = "", names=("on disk", "this run")) -> list[str]:
    """Human-readable differences between two identities, one 'key: on disk X, this run Y' each
    (`names`: what old and new are)."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += identity_diff(a, b, f"{prefix}{k}.", names)
        elif a != b:
            out.append(f"{prefix}{k}: {names[0]} {json.dumps(a)}, {names[1]} {json.dumps(b)}")
    return out


def shard_number(name: str) -> int:
    return int(name.split("-")[-1].split(".")[0])


class OutputLocked(UserError, RuntimeError):
    pass


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_json(path: Path, obj) -> None:
    """A small JSON file the recipe owns (identity, manifest), replaced whole."""
    atomic_write(path, (json.dumps(obj, indent=2) + "\n").encode())


def index_lines(records: list[dict]) -> bytes:
    """Index records as index.jsonl holds them: one compact JSON line each."""
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def index_line(line: str) -> dict:
    """One index line. The C scanner straight away: json.loads adds an encoding check and two
    whitespace matches per call, a third of the time over a million lines; it still reads anything
    unusual (and raises JSONDecodeError for what is not JSON)."""
    try:
        obj, end = scan_json(line)
        if end == len(line):
            return obj
    except json.JSONDecodeError:
        pass
    return json.loads(line)


COMMAS = bytes.maketrans(b"\n", b",")


def all_lines(raw: bytes, cut: int) -> list | None:
    """Index lines raw[:cut] (complete ones) read as one JSON array, in one call of the C scanner ->
    their records, or None where that is not one value per line (a blank line, bad UTF-8, what is
    not JSON): the line-by-line read then names the line. Over a million lines it takes half the time
    (no Python per line, and the cyclic GC no longer walks the growing list) and 40 % less memory (the
    scanner shares each key's string across records). Lines that are each one JSON value read as those
    values; lines that are not but happen to join into as many values could as well have been written
    as valid lines: each record is checked against its line when read."""
    if cut == 0:
        return []
    text = bytearray(cut + 1)  # "[" + the lines, their last newline "]", then every other one a comma
    text[0:1], text[1:] = b"[", memoryview(raw)[:cut]
    text[-1:] = b"]"
    try:
        text = text.translate(COMMAS).decode("utf-8")
        records, end = scan_json(text)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return records if end == len(text) and len(records) == raw.count(b"\n", 0, cut) else None


def read_index(root: Path, repair: bool = False) -> list[dict]:
    """Index records in order. Bytes after the last newline are a torn append (crash): dropped,
    and with repair truncated on disk. A bad *complete* line is real corruption and raises."""
    path = root / INDEX
    if not path.exists():
        return []
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    records = all_lines(raw, cut)
    if records is None:
        records = lines_one_by_one(raw[:cut], path, root)
    if repair and cut != len(raw):
        with open(path, "r+b") as f:
            f.truncate(cut)
            os.fsync(f.fileno())
    return records


def lines_one_by_one(lines: bytes, path: Path, root: Path) -> list[dict]:
    """Complete index lines read one at a time -> their records; raises CorruptFile naming the first
    line that is not JSON."""

    def corrupt(n: int) -> CorruptFile:
        return CorruptFile(
            f"{path}: line {n} is not JSON; the index is corrupt (`python -m recipe.shards rebuild-index "
            f"{root}` rebuilds it from the shards)"
        )

    try:
        text = lines.decode("utf-8")
    except UnicodeDecodeError as e:
        raise corrupt(lines.count(b"\n", 0, e.start) + 1) from None
    records = []
    for n, line in enumerate(text.split("\n"), 1):
        if line:
            try:
                records.append(index_line(line))
            except json.JSONDecodeError:
                raise corrupt(n) from None
    return records


def summarize(records: list[dict]) -> dict:
    """The manifest's `totals` and `shards`, derived from index records."""
    shards = {}
    for r in records:
        s = shards.setdefault(r["shard"], {"samples": 0, "bytes": 0})
        s["samples"] += 1
        s["bytes"] = max(s["bytes"], r["offset"] + r["length"])
    return {
        "totals": {
            "samples": len(records),
            "tokens": sum(r["tokens"] for r in records),
            "raw_bytes": sum(r["raw_bytes"] for r in records),
            "stored_bytes": sum(r["length"] for r in records),
        },
        "shards": shards,
    }


def read_owned(path: Path, parse, fix: str):
    """A small file the recipe owns, parsed; damage is one line naming the file and the fix."""
    try:
        return parse(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CorruptFile(f"{path} is damaged ({type(e).__name__}: {str(e)[:80]}); {fix}") from None


def read_manifest(root: Path) -> dict | None:
    p = Path(root) / MANIFEST
    fix = "the same command run again rewrites it from the index"
    return read_owned(p, json.loads, fix) if p.exists() else None


def read_identity(root: Path) -> dict | None:
    p = Path(root) / IDENTITY
    fix = "it records the configuration the set was made with: restore it from a copy, or use another output_dir"
    return read_owned(p, json.loads, fix) if p.exists() else None


def check_identity(root: Path, identity: dict) -> None:
    """Refuse a set made with another configuration; record the identity of a set that has none."""
    old = read_identity(root)
    if old is None:  # a set from before identity.json: its manifest holds the keys that mattered then
        manifest = read_manifest(root)
        if manifest is None and read_index(root):
            raise ProvenanceMismatch(
                f"{root} holds samples but neither identity.json nor manifest.json: "
                "its configuration is unknown; use another output_dir"
            )
        old = {k: manifest.get(k) for k in PROVENANCE_KEYS} if manifest else None
        identity_to_check = {k: identity.get(k) for k in PROVENANCE_KEYS}
        if old is not None and old != identity_to_check:
            raise ProvenanceMismatch(mismatch_message(root, identity_diff(old, identity_to_check)))
        atomic_write_json(root / IDENTITY, identity)
        return
    diff = identity_diff(old, identity)
    if diff:
        raise ProvenanceMismatch(mismatch_message(root, diff))


def mismatch_message(root: Path, diff: list[str]) -> str:
    return (
        f"{root} holds shards made with another configuration; resuming would mix them:\n  "
        + "\n  ".join(diff)
        + f"\nResume with the configuration on disk ({root / IDENTITY}), or write to another output_dir=..."
    )


@dataclass(frozen=True)
class Repaired:
    """What opening a set kept and cut: `lost` (id, why) are redone; `left` (shard, why) are never
    appended to again; `cuts` (shard, bytes cut) were proven uncommitted tails."""

    records: list[dict]
    lost: list[tuple[str, str]]
    left: list[tuple[str, str]]
    cuts: list[tuple[str, int]]
    ends: dict[str, int]  # per shard, where its last kept record ends


def repair_on_open(root: Path, records: list[dict], deep: bool) -> Repaired:
    """Keep what repair.check proves (the rest is redone), cut only proven uncommitted tails."""
    checked = repair.check(root / SHARD_DIR, records, deep)
    if len(checked.kept) != len(records):
        atomic_write(root / INDEX, index_lines(checked.kept))
    cuts = []
    for name, at, extra in checked.cuts:
        with open(root / SHARD_DIR / name, "r+b") as fh:
            fh.truncate(at)
            os.fsync(fh.fileno())
        cuts.append((name, extra))
    return Repaired(checked.kept, checked.dropped, checked.left, cuts, checked.ends)


def shard_names(root: Path, records: list[dict]) -> list[str]:
    disk = [f.name for f in (root / SHARD_DIR).glob("shard-*.bin")]
    return sorted(set(disk) | {r["shard"] for r in records}, key=shard_number)


def open_tails(root: Path, ends: dict[str, int], left: set[str], max_bytes: int) -> list[tuple[Path, int]]:
    """(shard, size) a resume appends to rather than starting new files: each ends exactly where its
    last kept record ends (`ends`; the repair cut any uncommitted tail) and has room; none the repair
    left alone."""
    out = []
    for f in sorted((root / SHARD_DIR).glob("shard-*.bin"), key=lambda f: shard_number(f.name)):
        size = f.stat().st_size
        if f.name not in left and size == ends.get(f.name, 0) and size < max_bytes:
            out.append((f, size))
    return out


class ShardStore:
    """Single writer of one output directory (an flock enforces it): hands out shard files to the
    writers (packer workers), records what they wrote, and commits it durably to the index."""

    def __init__(self, root: str | Path, identity: dict, provenance: dict | None = None,
                 max_shard_bytes: int = 4 << 30, deep_check: bool = False):  # fmt: skip
        self.root = Path(root)
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        self._lock = open(self.root / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise OutputLocked(f"{self.root} is being written by another process (.lock held)") from None
        self.provenance = {**identity, **(provenance or {})}
        self.max_shard_bytes = max_shard_bytes
        try:
            check_identity(self.root, identity)
        except BaseException:
            self._lock.close()
            raise
        fixed = repair_on_open(self.root, read_index(self.root, repair=True), deep_check)
        self.records, self.lost, self.left, self.repaired = fixed.records, fixed.lost, fixed.left, fixed.cuts
        self.keys = {r["key"] for r in self.records}
        self.ids = {r["id"] for r in self.records}
        self._reusable = open_tails(self.root, fixed.ends, {n for n, _ in self.left}, max_shard_bytes)
        self._pending: list[dict] = []
        self._index = open(self.root / INDEX, "ab", buffering=0)  # no buffer that could replay a failed append

    def take_shard(self) -> tuple[Path, int]:
        """A shard for one writer to append to, and its size: an open tail of this set first, each
        handed out once (no two writers ever share a file), then a new one."""
        return self._reusable.pop(0) if self._reusable else (self.new_shard_path(), 0)

    def new_shard_path(self) -> Path:
        """Numbered past every shard name on disk, in the index and ever handed out (shards/NEXT,
        written before the file is made): a name is never reused, even after a shard was deleted."""
        names = shard_names(self.root, self.records)
        nxt = self.root / SHARD_DIR / "NEXT"
        fix = "it holds the next shard number only: delete it and the next run writes it again"
        n = max(shard_number(names[-1]) + 1 if names else 0, read_owned(nxt, int, fix) if nxt.exists() else 0)
        atomic_write(nxt, f"{n + 1}\n".encode())
        return self.root / SHARD_DIR / f"shard-{n:05d}.bin"

    def add(self, sample_id: str, key: str, shard: str, offset: int, length: int, crc32: int, tokens: int,
            raw_bytes: int, **extra) -> None:  # fmt: skip
        """Record a frame already written to `shard` (by a packer worker that owns that file)."""
        self._check_new(sample_id, key)
        self._pending.append({"id": sample_id, "key": key, "shard": shard, "offset": offset, "length": length,
                              "tokens": tokens, "raw_bytes": raw_bytes, "crc32": crc32, **extra})  # fmt: skip
        self.keys.add(key)
        self.ids.add(sample_id)

    def _check_new(self, sample_id: str, key: str) -> None:
        if key in self.keys or sample_id in self.ids:
            raise ValueError(f"sample {sample_id} (key {key}) is already stored")

    def _fsync_shards(self, names: set[str]) -> None:
        """Every shard the pending records name is on disk before the index names them."""
        for name in sorted(names):
            fsync_path(self.root / SHARD_DIR / name)

    def take_pending(self) -> list[dict]:
        """The records not yet committed, handed over (to a committer thread) as one batch."""
        batch, self._pending = self._pending, []
        return batch

    def commit(self, batch: list[dict] | None = None) -> list[dict]:
        """Make a batch of recorded samples durable (default: all pending). Returns it."""
        if batch is None:
            batch = self.take_pending()
        if not batch:
            return []
        try:
            self._fsync_shards({r["shard"] for r in batch})
            end = os.fstat(self._index.fileno()).st_size
            try:
                self._index.write(index_lines(batch))
                self._index.flush()
                os.fsync(self._index.fileno())
            except OSError:  # e.g. ENOSPC: take back what reached the file, so a retry appends cleanly
                with contextlib.suppress(OSError):
                    os.ftruncate(self._index.fileno(), end)
                raise
        except OSError:
            self._pending[:0] = batch  # still pending: a later commit (or the resume) retries them
            raise
        self.records.extend(batch)
        return batch

    def write_manifest(self, fields: dict) -> dict:
        manifest = {**self.provenance, **fields, **summarize(self.records)}
        atomic_write_json(self.root / MANIFEST, manifest)
        return manifest

    def __enter__(self) -> "ShardStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock.closed:
            return
        try:
            self.commit()
        except OSError:  # nothing uncommitted is lost for good: resume cuts the tail and redoes it
            self._pending = []
        self._index.close()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
