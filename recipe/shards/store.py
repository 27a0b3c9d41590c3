"""The durable side of the pipeline: shard files, the index and the manifest of one output directory.

Identity: identity.json (format, model, capture, tokenizer, data) is written durably before the
first sample and checked on every open, so a resume with another configuration is refused even
after a run that was killed before it wrote any manifest.

Crash-safety order (what makes resume exact):
  1. sample frames are appended to the current shard file;
  2. commit(): the shard is fsynced, *then* their index lines are appended to index.jsonl and fsynced;
  3. on open, a torn last index line is dropped and every shard the index does not describe
     exactly is read along its own framing (repair.py): lines whose record is there are kept,
     whole records the index lost are indexed again from themselves, and only a crashed run's
     uncommitted append is cut; what is gone or damaged is redone, never cut from a shard.
manifest.json and identity.json are only ever replaced whole (temp file, fsync, rename, fsync of the
folder). Shard names are never reused: a new shard is numbered past every name on disk and in the
index. Nothing in the set is written through a symbolic link.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import CorruptFile, OutputDirError, UserError
from . import belonging, tokencounts
from . import repair as repair_mod
from .codec import scan_json

INDEX = "index.jsonl"
MANIFEST = "manifest.json"
IDENTITY = "identity.json"
SHARD_DIR = "shards"
# What a shard set *is*; a resume must agree on every field of the identity (see recipe.provenance).
PROVENANCE_KEYS = ("format", "model_fingerprint", "capture")


class ProvenanceMismatch(UserError, RuntimeError):
    pass


def identity_diff(
    old: dict, new: dict, prefix: str = "", names=("on disk", "this run"), ignore=frozenset()
) -> list[str]:
    """Human-readable differences between two identities, one 'key: on disk X, this run Y' each
    (`names`: what old and new are). The one comparison a resume and a merge make: a merge passes
    the job split as `ignore` (dotted keys), a resume nothing."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if f"{prefix}{k}" in ignore:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            out += identity_diff(a, b, f"{prefix}{k}.", names, ignore)
        elif a != b:
            out.append(f"{prefix}{k}: {names[0]} {json.dumps(a)}, {names[1]} {json.dumps(b)}")
    return out


def shard_number(name: str) -> int:
    return int(name.split("-")[-1].split(".")[0])


class OutputLocked(UserError, RuntimeError):
    pass


NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
NEXT_FIX = "it holds the next shard number only: delete it and the next run writes it again"


def open_owned(path: Path, flags: int, mode: int = 0o644) -> int:
    """A file of the set opened without following a symbolic link: the recipe writes only files it
    made, never through a link into another set or a file the user owns. One line if it is a link."""
    try:
        return os.open(path, flags | NOFOLLOW, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OutputDirError(
                f"{path} is a symbolic link: the recipe writes only files it made; "
                "replace it with the file it points to, or use another output_dir"
            ) from None
        raise


def owned_file(path: Path, mode: str, **kw):
    """open(path, mode) as open_owned opens it: a file object, never through a link."""
    return open(path, mode, opener=lambda p, flags: open_owned(Path(p), flags), **kw)


def atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with owned_file(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # a link at `path` is replaced, never followed
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


class Unreadable(str):
    """An index line that is not JSON, kept in its place by a lenient read (the resume drops it)."""


def repair_hint(root: Path) -> str:
    return f"`python -m recipe.shards repair {root}` rebuilds it from the shards"


def read_index(root: Path, repair: bool = False, lenient: bool = False) -> list:
    """Index records in order. Bytes after the last newline are a torn append (crash): dropped,
    and with repair truncated on disk. A complete line that is not JSON, or not an index line the
    recipe writes, raises CorruptFile naming it; with `lenient` it is returned as it is (a line not
    JSON as Unreadable), for the resume's repair to judge."""
    path = root / INDEX
    if not path.exists():
        return []
    raw = path.read_bytes()
    cut = raw.rfind(b"\n") + 1
    records = all_lines(raw, cut)
    if records is None:
        records = lines_one_by_one(raw[:cut], path, root, lenient)
    if not lenient:
        bad = repair_mod.problems(records)
        if bad:
            n, why = min(bad.items())
            raise CorruptFile(f"{path}: line {n + 1} is {why}; the index is damaged ({repair_hint(root)})")
    if repair and cut != len(raw):
        fd = open_owned(path, os.O_RDWR)
        try:
            os.ftruncate(fd, cut)
            os.fsync(fd)
        finally:
            os.close(fd)
    return records


def lines_one_by_one(lines: bytes, path: Path, root: Path, lenient: bool = False) -> list:
    """Complete index lines read one at a time -> their records; raises CorruptFile naming the first
    line that is not JSON (with `lenient`, that line is kept as Unreadable)."""

    def corrupt(n: int) -> CorruptFile:
        return CorruptFile(f"{path}: line {n} is not JSON; the index is corrupt ({repair_hint(root)})")

    try:
        text = lines.decode("utf-8")
    except UnicodeDecodeError as e:
        if not lenient:
            raise corrupt(lines.count(b"\n", 0, e.start) + 1) from None
        text = lines.decode("utf-8", errors="replace")  # its line then disagrees with its record
    records = []
    for n, line in enumerate(text.split("\n"), 1):
        if line:
            try:
                records.append(index_line(line))
            except json.JSONDecodeError:
                if not lenient:
                    raise corrupt(n) from None
                records.append(Unreadable(line))
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


def json_object(text: str) -> dict:
    obj = json.loads(text)
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object")
    return obj


def read_manifest(root: Path) -> dict | None:
    p = Path(root) / MANIFEST
    fix = "the same command run again rewrites it from the index"
    return read_owned(p, json_object, fix) if p.exists() else None


def read_identity(root: Path) -> dict | None:
    p = Path(root) / IDENTITY
    fix = "it records the configuration the set was made with: restore it from a copy, or use another output_dir"
    return read_owned(p, json_object, fix) if p.exists() else None


def check_identity(root: Path, identity: dict) -> None:
    """Refuse a set made with another configuration; record the identity of a set that has none.
    Where identity.json is gone, the manifest's copy of it (or, in a set from before that copy, its
    provenance keys) is what the run must agree with: a lost file never lets other settings in."""
    old = read_identity(root)
    if old is not None:
        diff = identity_diff(old, identity)
        if diff:
            raise ProvenanceMismatch(mismatch_message(root, diff))
        return
    manifest = read_manifest(root)
    if manifest is None and holds_samples(root):
        raise ProvenanceMismatch(
            f"{root} holds samples but neither identity.json nor manifest.json: "
            "its configuration is unknown; use another output_dir"
        )
    if manifest is not None:
        saved = manifest.get("identity")  # the copy the manifest keeps; a set from before it: its keys
        keys = list(saved) if isinstance(saved, dict) else PROVENANCE_KEYS
        old = saved if isinstance(saved, dict) else manifest
        old, new = {k: old.get(k) for k in keys}, {k: identity.get(k) for k in keys}
        if old != new:
            raise ProvenanceMismatch(mismatch_message(root, identity_diff(old, new)))
    atomic_write_json(root / IDENTITY, identity)


def holds_samples(root: Path) -> bool:
    """Any index line or any shard byte: a set, not an empty folder."""
    shards = root / SHARD_DIR
    on_disk = shards.is_dir() and any(f.stat().st_size for f in shards.glob("shard-*.bin") if f.is_file())
    return on_disk or bool(read_index(root, lenient=True))


# the setting behind each identity field, so that a refusal says what to change
SETTING_OF = {"codec": "shards.codec", "model_fingerprint": "model.path", "tokenizer": "model.path's tokenizer",
              "capture.dtype": "model.dtype", "format": "the recipe's version"}  # fmt: skip


def setting_of(line: str) -> str:
    """`data.max_length: on disk 4096, ...` -> `data.max_length`; `tokenizer.sha256: ...` -> model.path's tokenizer."""
    key = line.split(":", 1)[0]
    for k, setting in SETTING_OF.items():
        if key == k or key.startswith(k + "."):
            return setting
    return key


def mismatch_message(root: Path, diff: list[str]) -> str:
    settings = ", ".join(dict.fromkeys(setting_of(x) for x in diff))
    return (
        f"{root} holds shards made with another configuration; resuming would mix them:\n  "
        + "\n  ".join(diff)
        + f"\nThis run differs in {settings}: set it as on disk ({root / IDENTITY}) to resume, or give this run "
        "a folder of its own with output_dir=... (a sweep, -m, gives each job its own)"
    )


@dataclass(frozen=True)
class Repaired:
    """What opening a set did (repair.Checked): `lost` (id, why) are redone; `left` (shard, why) are
    never appended to again; `cuts` (shard, bytes cut) were a crashed run's uncommitted appends;
    `reindexed` lines were rewritten from their records, `recovered` ids indexed from records the
    index had lost."""

    records: list[dict]
    lost: list[tuple[str, str]]
    left: list[tuple[str, str]]
    cuts: list[tuple[str, int]]
    ends: dict[str, int]  # per shard, where its last kept record ends
    reindexed: list[tuple[str, str]]
    recovered: list[str]


def earlier_manifest(root: Path) -> dict | None:
    """The manifest a run found (None where there is none, or it is damaged: the run rewrites it)."""
    try:
        return read_manifest(root)
    except CorruptFile:
        return None


def committed_ends(root: Path) -> dict[str, int] | None:
    """Per shard, the bytes the manifest says were committed when it was written, or left as they
    are by a resume (None: no readable manifest): verify names a torn record inside them as damage,
    not as a crashed run's append."""
    try:
        m = read_manifest(root)
    except CorruptFile:
        return None
    if not isinstance(m, dict):
        return None
    ends: dict[str, int] = {}
    for part in ("shards", "left"):  # "left": bytes an earlier resume left as they are, with why
        for k, v in (m.get(part) if isinstance(m.get(part), dict) else {}).items():
            if isinstance(v, dict) and type(v.get("bytes")) is int:
                ends[k] = max(ends.get(k, 0), v["bytes"])
    return ends


def repair_on_open(root: Path, deep: bool, suspect: set[str] = frozenset()) -> Repaired:
    """The index read, then judged against the shards' own bytes (repair.check): it is rewritten
    where it changed, and only a crashed run's uncommitted appends are cut."""
    lines = read_index(root, repair=True, lenient=True)
    checked = repair_mod.check(root / SHARD_DIR, lines, deep, suspect, belonging.of_set(root))
    if checked.changed or len(checked.kept) != len(lines):
        atomic_write(root / INDEX, index_lines(checked.kept))
    cuts, left = [], list(checked.left)
    for name, at, extra in checked.cuts:
        fd = open_owned(root / SHARD_DIR / name, os.O_RDWR)
        try:
            if os.fstat(fd).st_nlink > 1:  # a merge's hard link: the other set's live run may be appending
                left.append((name, SHARED_TAIL))
                continue
            os.ftruncate(fd, at)
            os.fsync(fd)
        finally:
            os.close(fd)
        cuts.append((name, extra))
    return Repaired(checked.kept, checked.dropped, left, cuts, checked.ends, checked.reindexed,
                    checked.recovered)  # fmt: skip


SHARED_TAIL = ("its bytes past the last record are not cut: the file has another name (a merge's hard link), "
               "whose set may still be appending to it")  # fmt: skip


def refuse_links(root: Path) -> None:
    """No file or folder of the set is a symbolic link (the recipe would write through it)."""
    owned = [root / n for n in (SHARD_DIR, INDEX, MANIFEST, IDENTITY, ".lock", tokencounts.FILE)]
    owned += [root / SHARD_DIR / "NEXT"]
    shards = root / SHARD_DIR
    if shards.is_dir() and not shards.is_symlink():
        owned += sorted(shards.glob("shard-*.bin"))
    for p in owned:
        if p.is_symlink():
            raise OutputDirError(
                f"{p} is a symbolic link: the recipe writes only files it made; "
                "replace it with what it points to, or use another output_dir"
            )


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


def other_key(root: Path, ids: list[str]) -> ProvenanceMismatch:
    return ProvenanceMismatch(
        f"{root}: sample {ids[0]} ({len(ids)} in all) is stored under another key than this run computes for "
        "it: the set was made with other settings than identity.json records; use another output_dir"
    )


def left_bytes(root: Path, left: list) -> dict:
    """{shard: {bytes, why}} for every shard left as it is, now (`left`) or by an earlier resume."""
    try:
        before = (read_manifest(root) or {}).get("left") or {}
    except CorruptFile:
        before = {}
    kept = {k: v for k, v in before.items() if isinstance(v, dict) and (root / SHARD_DIR / k).exists()}
    for name, why in left:
        kept[name] = {"bytes": (root / SHARD_DIR / name).stat().st_size, "why": why}
    return kept


class ShardStore:
    """Single writer of one output directory (an flock enforces it): hands out shard files to the
    writers (packer workers), records what they wrote, and commits it durably to the index."""

    def __init__(self, root: str | Path, identity: dict | None, provenance: dict | None = None,
                 max_shard_bytes: int = 4 << 30, deep_check: bool = False):  # fmt: skip
        self.root = Path(root)
        refuse_links(self.root)
        (self.root / SHARD_DIR).mkdir(parents=True, exist_ok=True)
        self._lock = owned_file(self.root / ".lock", "a")  # never truncated: it may be a file the user owns
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise OutputLocked(f"{self.root} is being written by another process (.lock held)") from None
        self.identity, self.provenance = identity, {**(identity or {}), **(provenance or {})}
        self.max_shard_bytes = max_shard_bytes
        try:
            if identity is not None:  # None: `repair`, which keeps the set's own
                check_identity(self.root, identity)
            self.earlier_manifest = earlier_manifest(self.root)  # what a run adds its figures to
            self.next_number()
            fixed = repair_on_open(self.root, deep_check)
        except BaseException:
            self._lock.close()
            raise
        self.lost, self.left, self.repaired, self.reindexed, self.recovered = [], [], [], [], []
        self._opened(fixed)
        self._pending: list[dict] = []

    def _opened(self, fixed: Repaired) -> None:
        """The set as the repair left it: its records, what was done, the tails writers may extend."""
        self.records = fixed.records
        self.lost, self.left, self.repaired = self.lost + fixed.lost, self.left + fixed.left, self.repaired + fixed.cuts
        self.reindexed, self.recovered = self.reindexed + fixed.reindexed, self.recovered + fixed.recovered
        self.keys, self.ids = {r["key"] for r in self.records}, {r["id"] for r in self.records}
        self.counter = tokencounts.Keeper(self.root, self.records)  # exactly the samples the index lists
        self._reusable = open_tails(self.root, fixed.ends, {n for n, _ in self.left}, self.max_shard_bytes)
        self._index = owned_file(self.root / INDEX, "ab", buffering=0)  # no buffer that could replay a failed append

    def settle(self, samples) -> None:
        """Samples this run would store whose id the index already holds under another key: the lines
        are checked against their records (an edited line is re-indexed from its record). A record
        that itself holds another key was made with other settings than the identity says: refused."""
        clash = {s.id: s.key for s in samples if s.key not in self.keys and s.id in self.ids}
        if not clash:
            return
        self._index.close()
        shards = {r["shard"] for r in self.records if r["id"] in clash}
        self._opened(repair_on_open(self.root, False, shards))
        still = sorted(i for i, k in clash.items() if i in self.ids and k not in self.keys)
        if still:
            raise other_key(self.root, still)

    def take_shard(self) -> tuple[Path, int]:
        """(shard, size) for one writer: an open tail of this set, each handed out once, then a new one."""
        return self._reusable.pop(0) if self._reusable else (self.new_shard_path(), 0)

    def new_shard_path(self) -> Path:
        """Numbered past every shard name on disk, in the index and ever handed out (shards/NEXT,
        written before the file is made): a name is never reused, even after a shard was deleted."""
        names = shard_names(self.root, self.records)
        n = max(shard_number(names[-1]) + 1 if names else 0, self.next_number())
        atomic_write(self.root / SHARD_DIR / "NEXT", f"{n + 1}\n".encode())
        return self.root / SHARD_DIR / f"shard-{n:05d}.bin"

    def next_number(self) -> int:
        """shards/NEXT, read (at open too: a damaged one is refused before any work, not mid-run)."""
        nxt = self.root / SHARD_DIR / "NEXT"
        return read_owned(nxt, int, NEXT_FIX) if nxt.exists() else 0

    def add(self, sample_id: str, key: str, shard: str, offset: int, length: int, crc32: int, tokens: int,
            raw_bytes: int, token_ids=None, **extra) -> None:  # fmt: skip
        """Record a frame already written to `shard` (by a packer worker that owns that file);
        token_ids: its (input ids, loss mask), which the token counts take once it is committed (else
        they read them back from the record)."""
        self._check_new(sample_id, key)
        self.counter.add(key, token_ids)
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
        self.counter.committed(self.records, atomic_write)
        return batch

    def write_manifest(self, fields: dict) -> dict:
        """The manifest, with a copy of the identity (what a resume checks if identity.json is lost)
        and the shards whose bytes past their last record were left as they are (`left`: never
        taken for an uncommitted append later, and named by verify as left)."""
        self.counter.save(self.records, atomic_write)
        manifest = {**self.provenance, **fields, **summarize(self.records), "identity": self.identity,
                    "left": left_bytes(self.root, self.left),
                    "token_counts": self.counter.counts.summary()}  # fmt: skip
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
            self.counter.save(self.records, atomic_write)
        except OSError:  # nothing uncommitted is lost for good: resume cuts the tail and redoes it
            self._pending = []
        finally:  # whatever was raised (a refusal too), the lock goes with the store
            self._index.close()
            fcntl.flock(self._lock, fcntl.LOCK_UN)
            self._lock.close()
