"""The durable side of the pipeline: shard files, the index and the manifest of one output directory.

Crash-safety order (what makes resume exact):
  1. sample frames are appended to the current shard file;
  2. commit(): the shard is fsynced, *then* their index lines are appended to index.jsonl and fsynced;
  3. on open, a torn last index line is dropped and each shard is truncated to the end of its last
     indexed record, so bytes written after the last commit vanish and are redone.
manifest.json is only ever replaced whole (temp file, fsync, rename).
"""
from __future__ import annotations

import fcntl
import json
import os
import zlib
from pathlib import Path

INDEX = "index.jsonl"
MANIFEST = "manifest.json"
SHARD_DIR = "shards"
# A resumed run must capture the same thing: these manifest fields must match exactly.
PROVENANCE_KEYS = ("format", "model_fingerprint", "capture")


class ProvenanceMismatch(RuntimeError):
    pass


class OutputLocked(RuntimeError):
    pass


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index(root: Path, repair: bool = False) -> list[dict]:
    """Index records in order. Bytes after the last newline are a torn append (crash): dropped,
    and with repair truncated on disk. A bad *complete* line is real corruption and raises."""
    path = root / INDEX
    if not path.exists():
        return []
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    records = []
    for n, line in enumerate(raw[:cut].split(b"\n"), 1):
        if line:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}: line {n} is not JSON; the index is corrupt") from None
    if repair and cut != len(raw):
        with open(path, "r+b") as f:
            f.truncate(cut)
            os.fsync(f.fileno())
    return records


def summarize(records: list[dict]) -> dict:
    """The manifest's `totals` and `shards`, derived from index records."""
    shards = {}
    for r in records:
        s = shards.setdefault(r["shard"], {"samples": 0, "bytes": 0})
        s["samples"] += 1
        s["bytes"] = max(s["bytes"], r["offset"] + r["length"])
    return {"totals": {"samples": len(records), "tokens": sum(r["tokens"] for r in records),
                       "raw_bytes": sum(r["raw_bytes"] for r in records),
                       "stored_bytes": sum(r["length"] for r in records)},
            "shards": shards}


def read_manifest(root: Path) -> dict | None:
    p = Path(root) / MANIFEST
    return json.loads(p.read_text()) if p.exists() else None


class ShardStore:
    """Single writer of one output directory (an flock enforces it)."""

    def __init__(self, root: str | Path, provenance: dict, max_shard_bytes: int = 4 << 30):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / SHARD_DIR).mkdir(exist_ok=True)
        self._lock = open(self.root / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputLocked(f"{self.root} is being written by another process (.lock held)") from None
        self.provenance = provenance
        self.max_shard_bytes = max_shard_bytes
        old = read_manifest(self.root)
        if old is not None:
            for k in PROVENANCE_KEYS:
                if old.get(k) != provenance.get(k):
                    raise ProvenanceMismatch(
                        f"{self.root} holds shards made with a different {k!r}:\n  on disk: {old.get(k)}\n"
                        f"  this run: {provenance.get(k)}\nUse another output_dir, or the same config to resume.")
        self.records = read_index(self.root, repair=True)
        self.keys = {r["key"] for r in self.records}
        self._repair_shards()
        self._pending: list[dict] = []
        self._index = open(self.root / INDEX, "ab")
        self._open_shard()

    # -- resume ------------------------------------------------------------------------------
    def _repair_shards(self) -> None:
        ends: dict[str, int] = {}
        for r in self.records:
            ends[r["shard"]] = max(ends.get(r["shard"], 0), r["offset"] + r["length"])
        self.repaired = []
        for f in sorted((self.root / SHARD_DIR).glob("shard-*.bin")):
            size, want = f.stat().st_size, ends.get(f.name, 0)
            if size < want:
                raise ValueError(f"{f} is shorter ({size} B) than its indexed records ({want} B): data lost")
            if size > want:  # bytes after the last commit: an interrupted run; they are redone
                with open(f, "r+b") as fh:
                    fh.truncate(want)
                    os.fsync(fh.fileno())
                self.repaired.append((f.name, size - want))

    def _open_shard(self) -> None:
        existing = sorted((self.root / SHARD_DIR).glob("shard-*.bin"))
        # continue the last shard while it has room; never reopen older ones
        if existing and existing[-1].stat().st_size < self.max_shard_bytes:
            path = existing[-1]
        else:
            path = self.root / SHARD_DIR / f"shard-{len(existing):05d}.bin"
        self._shard_path = path
        self._shard = open(path, "ab")
        self._shard_size = self._shard.tell()

    # -- writing -----------------------------------------------------------------------------
    def append(self, sample_id: str, key: str, frame: bytes, tokens: int, raw_bytes: int, **extra) -> None:
        if key in self.keys:
            raise ValueError(f"sample {sample_id} (key {key}) is already stored")
        if self._shard_size and self._shard_size + len(frame) > self.max_shard_bytes:
            self.commit()
            self._shard.close()
            n = len(list((self.root / SHARD_DIR).glob("shard-*.bin")))
            self._shard_path = self.root / SHARD_DIR / f"shard-{n:05d}.bin"
            self._shard = open(self._shard_path, "ab")
            self._shard_size = 0
        self._shard.write(frame)
        rec = {"id": sample_id, "key": key, "shard": self._shard_path.name, "offset": self._shard_size,
               "length": len(frame), "tokens": tokens, "raw_bytes": raw_bytes, "crc32": zlib.crc32(frame), **extra}
        self._shard_size += len(frame)
        self._pending.append(rec)
        self.keys.add(key)

    def commit(self) -> list[dict]:
        """Make every appended sample durable. Returns the records committed now."""
        if not self._pending:
            return []
        self._shard.flush()
        os.fsync(self._shard.fileno())
        self._index.write(b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in self._pending))
        self._index.flush()
        os.fsync(self._index.fileno())
        done, self._pending = self._pending, []
        self.records.extend(done)
        return done

    def write_manifest(self, fields: dict) -> dict:
        manifest = {**self.provenance, **fields, **summarize(self.records)}
        atomic_write(self.root / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=False) + "\n").encode())
        return manifest

    def close(self) -> None:
        try:
            self.commit()
        except OSError:  # nothing uncommitted is lost for good: resume cuts the tail and redoes it
            self._pending = []
        self._shard.close()
        self._index.close()
        fcntl.flock(self._lock, fcntl.LOCK_UN)
        self._lock.close()
