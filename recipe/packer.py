"""The packer: dump directory -> validated, compressed, durable shard records. Runs beside the backend.

Per sample, in stages:
  scan      (packer thread)  find the raw pieces of each announced request; hand it on once the pieces
                             cover the whole prompt [0, n) *and* the server has answered
  assemble  (worker process) the pieces' headers and token ids, in prompt order
  validate  (worker)         token ids equal what was sent
  encode    (worker)         the byte planes (split on the GPU) stream block by block from the pieces
                             into the record: the high plane through zstd, the low plane raw
                             (recipe.shards.codec); each block is checked for NaN/Inf and all-zero
                             slots on the way, and a refused sample's bytes are cut off the shard again
  append    (worker)         the record goes to the end of the worker's own shard file and is flushed
                             to the disk (the workers in parallel, keeping the disk busy)
  commit    (committer thread) fsync those shards, then append and fsync the index lines; only then
                             are the sample's raw pieces deleted. Its own thread: dispatching goes on
                             while the disk syncs
Workers are processes that own their shard files: compression scales with cores (no GIL), and only
small records cross between processes. A request that answered but whose dump never completes within
`dump_timeout_s` is a failed sample: this is what catches a CUDA-graph replay (Python hooks do not
run) or a mis-set server flag.
"""

from __future__ import annotations

import collections
import itertools
import json
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import units
from .capture import records
from .errors import UserError
from .procs import die_with_parent
from .shards.codec import Codec, RecordWriter, crc32

log = logging.getLogger(__name__)


@dataclass
class Pending:
    sample: object  # recipe.data.Sample
    rid: str
    responded_at: float | None = None
    pieces: dict = field(default_factory=dict)  # offset -> (path, n, slots, hidden)


class Progress:
    """Throughput while it runs, counted from the capture's start (`start()`: the server ready, the
    model loaded), not from the process's: samples/s, tokens/s, raw and stored bytes/s, ratio, ETA."""

    FIRST_SAMPLE_NOTE_S = 30.0  # no sample by then: say why the run looks stuck

    def __init__(self, total: int, every_s: float = 10.0, dump_dir: Path | None = None, budget: int = 0):
        self.total, self.every_s, self.dump_dir, self.budget = total, every_s, dump_dir, budget
        self.t0 = self.last = time.monotonic()
        self.samples = self.tokens = self.raw = self.stored = self.failed = 0
        self.noted = False
        self.capturing = False  # until start(): the backend says what it waits for (model, server)

    def start(self) -> None:
        self.t0 = self.last = time.monotonic()
        self.capturing = True

    def add(self, tokens: int, raw: int, stored: int) -> None:
        self.samples += 1
        self.tokens += tokens
        self.raw += raw
        self.stored += stored
        self.maybe_log()

    def line(self) -> str:
        dt = max(time.monotonic() - self.t0, 1e-9)
        done = self.samples + self.failed
        eta = f" | ETA {units.duration((self.total - done) * dt / done)}" if 0 < done < self.total else ""
        ratio = f"{self.raw / self.stored:.3f}x" if self.stored else "n/a"
        shm = ""
        if self.dump_dir is not None and self.dump_dir.exists():
            shm = f" | dump {units.size(records.dir_bytes(self.dump_dir))} of {units.size(self.budget)}"
        return (
            f"packed {self.samples}/{self.total} (failed {self.failed}) in {units.duration(dt)} | "
            f"{self.samples / dt:.1f} samples/s | {units.rate(self.tokens / dt, 'tok')} | raw "
            f"{units.rate(self.raw / dt)}, stored {units.rate(self.stored / dt)} (ratio {ratio}){eta}{shm}"
        )

    def maybe_log(self, force: bool = False) -> None:
        if not (self.capturing or force):
            return
        now = time.monotonic()
        if self.capturing and not self.noted and not self.samples and now - self.t0 > self.FIRST_SAMPLE_NOTE_S:
            self.noted = True
            log.info(
                "no sample packed %.0f s into the capture: the first large batch compiles kernels on a fresh "
                "machine (minutes at most); later runs start at once",
                now - self.t0,
            )
        if force or now - self.last >= self.every_s:
            self.last = now
            log.info(self.line())


# -- the worker's stages (run in the worker processes; plain functions, tested directly) -------
class PlaneCheck:
    """No NaN/Inf and no all-zero slot, decided on byte planes as they stream past in row blocks:
    high plane first, then the low one. The high byte holds the sign and 7 exponent bits; the low
    plane is looked at only where the high byte leaves the answer open."""

    def __init__(self, slots: int):
        self.peak = np.zeros(slots, np.uint8)  # per slot, the largest high byte without its sign
        self.open: dict[int, np.ndarray] = {}  # row -> where exponent bits 7..1 are all set
        self.nonzero = np.zeros(slots, bool)
        self.bad: str | None = None

    def high(self, row: int, hi: np.ndarray) -> None:  # hi: [k, slots, H] from `row`
        mag = np.bitwise_and(hi, 0x7F)
        peak = mag.max(axis=(0, 2))
        np.maximum(self.peak, peak, out=self.peak)
        if (peak == 0x7F).any():  # Inf/NaN iff exponent bit 0 (the low byte's top bit) is set too
            self.open[row] = mag == 0x7F

    def low(self, row: int, lo: np.ndarray) -> None:
        top = self.open.get(row)
        if top is not None:
            if (lo[top] >= 0x80).any():
                self.bad = self.bad or "non_finite"
        zero = self.peak == 0  # high bytes all 0x00/0x80: the slot is all zero iff its low bytes are too
        if zero.any():
            self.nonzero[zero] |= lo[:, zero].any(axis=(0, 2))

    def result(self) -> str | None:
        if self.bad:
            return self.bad
        for s in np.flatnonzero((self.peak == 0) & ~self.nonzero):
            return f"all_zero_slot_{int(s)}"
        return None


def check_planes(hi: np.ndarray, lo: np.ndarray) -> str | None:
    """hi/lo byte planes [T, slots, H] of bf16 words, whole: a reason if any value is NaN/Inf or any
    slot is all zeros."""
    c = PlaneCheck(hi.shape[1])
    c.high(0, hi)
    c.low(0, lo)
    return c.result()


QUEUED = 2  # tasks per worker process at once
COMMIT_BYTES = 1 << 30  # raw bytes of stored-but-uncommitted samples that force a commit
BLOCK = 1 << 19  # bytes of a plane per read: each block is checked and coded while in cache
_buf: list = []  # per process, reused: a sample costs no fresh pages


@dataclass
class Piece:
    path: str
    n: int  # tokens
    base: int  # where its ids start; the high plane follows them, then the low plane


def assemble(pieces: list[tuple[str, int]], n: int, slots: int, hidden: int) -> tuple[np.ndarray, list[Piece]]:
    """The pieces (path, tokens), in prompt order: their headers checked against the sample and
    their token ids read. The planes are not read here but streamed by `planes`."""
    ids, out, row = np.empty(n, np.int32), [], 0
    for path, k in pieces:
        h = records.read_header(Path(path))
        if h["n"] != k or h["slots"] != slots or h["hidden"] != hidden or row + k > n:
            raise ValueError(f"{path}: piece of {h['n']}x{h['slots']}x{h['hidden']} does not fit")
        with open(path, "rb", buffering=0) as f:
            f.seek(h["base"])
            f.readinto(memoryview(ids[row : row + k]).cast("B"))
        out.append(Piece(path, k, h["base"]))
        row += k
    return ids[:row], out


def planes(pieces: list[Piece], which: int, slots: int, hidden: int):
    """Yields (row, [k, slots, H] block) of one plane (0: high, 1: low) over all pieces in order,
    read block by block into one reused buffer (valid until the next block)."""
    width = slots * hidden
    rows = max(1, BLOCK // width)
    if not _buf or _buf[0].size < rows * width:
        _buf[:] = [np.empty(rows * width, np.uint8)]
    row = 0
    for p in pieces:
        fd = os.open(p.path, os.O_RDONLY)
        try:
            start = p.base + 4 * p.n + which * p.n * width
            for r in range(0, p.n, rows):
                k = min(rows, p.n - r)
                block = _buf[0][: k * width]
                if os.preadv(fd, [block], start + r * width) != block.size:
                    raise ValueError(f"{p.path}: piece is shorter than its header says")
                yield row + r, block.reshape(k, slots, hidden)
        finally:
            os.close(fd)
        row += p.n


def validate(ids: np.ndarray, expected: np.ndarray, slots: int, n_slots: int) -> str | None:
    if ids.shape[0] != expected.shape[0]:
        return f"token_count_mismatch ({ids.shape[0]} captured, {expected.shape[0]} sent)"
    if slots != n_slots:
        return f"slot_count_mismatch ({slots} captured, {n_slots} configured)"
    if not np.array_equal(ids, expected):
        return "token_ids_mismatch"
    return None


class ShardAppender:
    """The end of a shard file that one worker owns: counts and checksums what passes through."""

    def __init__(self, fd: int):
        self.fd, self.length, self.crc = fd, 0, 0

    def write(self, b) -> int:
        self.writev([b])
        return len(b)

    def writev(self, bufs) -> None:
        views = [memoryview(b).cast("B") for b in bufs]
        for v in views:
            self.crc = crc32(v, self.crc)
            self.length += len(v)
        while views:
            done = os.writev(self.fd, views[:1024])  # IOV_MAX
            while views and done >= len(views[0]):
                done -= len(views.pop(0))
            if done:
                views[0] = views[0][done:]


def pack(task: dict, codec: Codec, sink) -> str | int:
    """assemble -> validate -> encode into `sink`, checking the values as they stream past. Returns
    the raw bytes packed, or a failure reason (the caller then drops what reached the sink)."""
    n, slots, hidden = task["n"], task["slots"], task["hidden"]
    ids, pieces = assemble(task["pieces"], n, slots, hidden)
    bad = validate(ids, task["input_ids"], slots, task["n_slots"])
    if bad:
        return bad
    mask = task["loss_mask"]
    shape = (ids.shape[0], slots, hidden)
    rec = RecordWriter(
        codec,
        sink,
        task["meta"],
        {
            "input_ids": ("int32", ids.shape, "none"),
            "loss_mask": ("uint8", mask.shape, "none"),
            "hidden": ("bfloat16", shape, "byteplane"),
        },
    )
    rec.write(ids)
    rec.write(mask)
    check = PlaneCheck(slots)
    for row, hi in planes(pieces, 0, slots, hidden):
        check.high(row, hi)
        rec.write(hi)
    for row, lo in planes(pieces, 1, slots, hidden):
        check.low(row, lo)
        rec.write_tail(lo)
    rec.close()
    return check.result() or int(ids.nbytes + mask.nbytes + 2 * np.prod(shape))


def worker_main(inbox, outbox, codec: Codec, parent: int, sync: bool = True) -> None:
    """One packing process: owns the shard file its tasks name and appends each frame to it.
    sync: flush each record to the disk as it is appended, the workers in parallel, rather than
    leave the whole batch to the committer's fsync (which then finds little left). On the H200
    host's disk this cut the wait after the last response from 1.25 s to 0.44 s (docs/benchmarks.md);
    on /dev/shm it costs nothing."""
    die_with_parent(parent)()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the recipe coordinates the stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, path, size = None, None, 0
    for task in iter(inbox.get, None):
        tid = task["tid"]
        try:
            if task["shard"] != path:
                if fd is not None:
                    os.close(fd)
                path = task["shard"]
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                size = os.fstat(fd).st_size
            out = ShardAppender(fd)
            res = pack(task, codec, out)
            if isinstance(res, str):
                if out.length:  # refused after streaming: its bytes leave the shard again
                    os.ftruncate(fd, size)
                outbox.put((tid, "fail", res))
                continue
            if sync:
                os.fdatasync(fd)
            outbox.put((tid, "ok", (os.path.basename(path), size, out.length, out.crc, res)))
            size += out.length
        except OSError as e:  # e.g. ENOSPC: the packer stops the run, resume redoes the sample
            size = os.fstat(fd).st_size if fd is not None else 0
            outbox.put((tid, "oserror", (e.errno, e.strerror, e.filename)))
        except Exception:  # a bug: the run stops loudly; the shard keeps only whole records
            if fd is not None:
                os.ftruncate(fd, size)
            outbox.put((tid, "error", traceback.format_exc()))
    if fd is not None:
        os.close(fd)


# -- the packer --------------------------------------------------------------------------------
class Packer:
    """Use as a context manager: workers start on entry; on exit the packer thread finishes, the
    workers stop, and the last records are committed."""

    def __init__(
        self,
        dump_dir,
        store,
        codec: Codec,
        slots: list[str],
        workers: int = 2,
        dump_timeout_s: float = 120.0,
        commit_every: int = 64,
        commit_every_s: float = 2.0,
        progress: Progress | None = None,
        poll_s: float = 0.01,
        sync_records: bool = True,
    ):
        self.dump_dir = Path(dump_dir)
        self.sync_records = sync_records
        self.store, self.codec, self.slots = store, codec, slots
        self.dump_timeout_s, self.commit_every, self.commit_every_s, self.poll_s = (
            dump_timeout_s,
            commit_every,
            commit_every_s,
            poll_s,
        )
        self.progress = progress or Progress(0)
        self.n_workers = max(1, workers)
        self.pending: dict[str, Pending] = {}
        self.inflight: dict[int, tuple[Pending, int]] = {}  # task id -> (request, worker)
        self.uncommitted: list[tuple[Pending, list[Path]]] = []
        self.committing: collections.deque = collections.deque()  # batches handed to the committer
        self._commits: queue.Queue = queue.Queue()
        self._committer = threading.Thread(target=self._commit_loop, name="committer", daemon=True)
        self.ok = 0
        self.failed: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="packer", daemon=True)
        self._last_commit = time.monotonic()
        self._uncommitted_raw = 0
        self._tids = itertools.count()
        self._procs, self._inboxes, self._outbox = [], [], None
        self._shard = {}  # worker -> [shard path, bytes assigned]

    # -- the backend's side ------------------------------------------------------------------
    def expect(self, rid: str, sample) -> None:
        with self._lock:
            self.pending[rid] = Pending(sample, rid)

    def responded(self, rid: str) -> None:
        with self._lock:
            if rid in self.pending:
                self.pending[rid].responded_at = time.monotonic()

    def fail(self, rid: str, reason: str) -> None:
        with self._lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            self._count_failure(p, reason)
            self._delete(p)

    def forget(self, rid: str) -> None:
        """A superseded attempt (the client retries under a new rid): dropped, not counted."""
        with self._lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            self._delete(p)

    def outstanding(self) -> int:
        return sum(self.stages_left().values())

    def stages_left(self) -> dict[str, int]:
        """Samples each stage still holds: waiting for their dump (or a free worker), being packed,
        packed but not yet committed."""
        with self._lock:
            return {
                "waiting": len(self.pending),
                "packing": len(self.inflight),
                "committing": len(self.uncommitted) + sum(len(done) for _, done in self.committing),
            }

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "Packer":
        # fork: workers start in milliseconds and need nothing but numpy and zstd; each dies with us
        ctx = mp.get_context("fork")
        self._outbox = ctx.SimpleQueue()
        for _ in range(self.n_workers):
            inbox = ctx.SimpleQueue()
            p = ctx.Process(
                target=worker_main, args=(inbox, self._outbox, self.codec, os.getpid(), self.sync_records), daemon=True
            )
            p.start()
            self._procs.append(p)
            self._inboxes.append(inbox)
        self._committer.start()
        self._thread.start()
        return self

    def __enter__(self) -> "Packer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every expected request is stored or failed (raises the packer's own error)."""
        t0 = time.monotonic()
        while self.outstanding():
            if self.error:
                self._raise_error()
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"packer still has {self.outstanding()} samples after {timeout_s}s")
            time.sleep(self.poll_s)
        if self.error:
            self._raise_error()

    def _raise_error(self):
        if isinstance(self.error, UserError):  # the user's to fix: as it was raised, one line
            raise self.error
        raise RuntimeError("packer failed") from self.error

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._commits.put(None)
        if self._committer.is_alive():
            self._committer.join()
        for inbox in self._inboxes:
            inbox.put(None)
        for p in self._procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        self._procs, self._inboxes = [], []
        try:
            self.store.commit()
        except OSError as e:  # e.g. the disk is full: what was not committed is redone on resume
            log.error("final commit failed: %s", e)

    # -- the packer thread: scan, dispatch, collect, commit -------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._scan()
                busy |= self._collect()
                self._maybe_commit()
                self.progress.maybe_log()
                if not busy:
                    time.sleep(self.poll_s)
            while self.inflight and self.error is None:  # the workers' last results
                if not self._collect():
                    time.sleep(self.poll_s)
            self._maybe_commit(force=True)
        except UserError as e:  # a damaged or foreign output folder: the user's, one line (drain raises it)
            self.error = e
        except BaseException as e:  # surfaced by drain(); never a silent hole
            log.exception("packer thread died")
            self.error = e

    def _scan(self) -> bool:
        busy = False
        try:
            names = os.listdir(self.dump_dir)
        except FileNotFoundError:
            return False
        now = time.monotonic()
        with self._lock:
            for name in names:
                if name.endswith(records.ERROR_SUFFIX):
                    busy |= self._capture_error(name)
                    continue
                parsed = records.parse_name(name)
                if parsed is None:
                    continue
                rid, off = parsed
                p = self.pending.get(rid)
                if p is None:
                    if not self._in_progress(rid):
                        (self.dump_dir / name).unlink(missing_ok=True)  # a superseded attempt or a stale run
                    continue
                if off not in p.pieces:
                    h = records.read_header(self.dump_dir / name)
                    p.pieces[off] = (self.dump_dir / name, h["n"], h["slots"], h["hidden"])
                    busy = True
            for rid, p in list(self.pending.items()):
                n = len(p.sample.input_ids)
                covered = 0
                for off in sorted(p.pieces):
                    if off != covered:
                        break
                    covered += p.pieces[off][1]
                if covered >= n and p.responded_at is not None:  # the client vetted the response first
                    if self._dispatch(p):  # else every worker is busy: it waits here, ready
                        del self.pending[rid]
                        busy = True
                elif p.responded_at is not None and now - p.responded_at > self.dump_timeout_s:
                    del self.pending[rid]
                    why = (
                        "no_dump"
                        if not p.pieces
                        else (
                            f"incomplete_dump ({covered}/{n} tokens; pieces at {sorted(p.pieces)[:8]}; "
                            f"{now - p.responded_at:.1f} s after the response)"
                        )
                    )
                    self._count_failure(p, why)
                    self._delete(p)
        return busy

    def _capture_error(self, name: str) -> bool:
        rid = name[: -len(records.ERROR_SUFFIX)]
        p = self.pending.pop(rid, None)
        reason = "capture_error"
        try:
            reason += ": " + json.loads((self.dump_dir / name).read_text())["reason"]
        except (OSError, ValueError, KeyError):
            pass
        if p is not None:
            self._count_failure(p, reason)
            self._delete(p)
        (self.dump_dir / name).unlink(missing_ok=True)
        return True

    def _in_progress(self, rid: str) -> bool:
        return any(rid == q.rid for q, _ in self.inflight.values()) or any(rid == q.rid for q, _ in self.uncommitted)

    def _dispatch(self, p: Pending) -> bool:
        """To the least busy worker, into its own shard (a fresh one once it is full). At most QUEUED
        tasks per worker: the shard sizes it rolls over on stay current, and nothing piles up in the
        pipes. False when every worker is that busy."""
        load = collections.Counter(w for _, w in self.inflight.values())
        w = min(range(self.n_workers), key=lambda k: load[k])
        if load[w] >= QUEUED:
            return False
        first = min(p.pieces)
        _, _, slots, hidden = p.pieces[first]
        shard = self._shard.get(w)
        if shard is None or shard[1] >= self.store.max_shard_bytes:
            shard = self._shard[w] = [self.store.new_shard_path(), 0]
        s = p.sample
        tid = next(self._tids)
        self.inflight[tid] = (p, w)
        self._inboxes[w].put(
            {
                "tid": tid,
                "shard": str(shard[0]),
                "n": len(s.input_ids),
                "slots": slots,
                "hidden": hidden,
                "n_slots": len(self.slots),
                "pieces": [(str(p.pieces[o][0]), p.pieces[o][1]) for o in sorted(p.pieces)],
                "input_ids": np.asarray(s.input_ids, dtype=np.int32),
                "loss_mask": np.asarray(s.loss_mask, np.uint8),
                "meta": {
                    "id": s.id,
                    "key": s.key,
                    "source": s.source,
                    "slots": self.slots,
                    "dtypes": {"input_ids": "int32", "loss_mask": "uint8", "hidden": "bfloat16"},
                },
            }
        )
        return True

    def _collect(self) -> bool:
        busy = False
        while not self._outbox.empty():
            tid, kind, res = self._outbox.get()
            with self._lock:
                p, w = self.inflight.pop(tid)
            busy = True
            if kind == "fail":
                self._count_failure(p, res)
                self._delete(p)
            elif kind == "oserror":
                raise OSError(*res)
            elif kind == "error":  # a bug in a worker: kill the run loudly
                raise RuntimeError(f"packer worker failed on sample {p.sample.id}:\n{res}")
            else:
                shard, offset, length, crc, raw = res
                if self._shard[w][0].name == shard:  # not a result from before a rollover
                    self._shard[w][1] = offset + length
                s = p.sample
                self.store.add(
                    s.id,
                    s.key,
                    shard,
                    offset,
                    length,
                    crc,
                    tokens=len(s.input_ids),
                    raw_bytes=raw,
                    loss_tokens=int(np.asarray(s.loss_mask).sum()),
                    source=s.source,
                )
                self.uncommitted.append((p, [v[0] for v in p.pieces.values()]))
                self._uncommitted_raw += raw
                self.progress.add(len(s.input_ids), raw, length)
        return busy

    def _maybe_commit(self, force: bool = False) -> None:
        if not self.uncommitted:
            return
        # Batched while samples stream in (one fsync for many), but never left waiting on the timer
        # when no worker is busy (the end of a run, a lull), nor holding more than COMMIT_BYTES of raw
        # pieces in the dump directory: they are deleted only once committed.
        if (
            force
            or not self.inflight
            or len(self.uncommitted) >= self.commit_every
            or self._uncommitted_raw >= COMMIT_BYTES
            or time.monotonic() - self._last_commit > self.commit_every_s
        ):
            item = (self.store.take_pending(), self.uncommitted)
            with self._lock:
                self.committing.append(item)
            self._commits.put(item)
            self.uncommitted = []
            self._uncommitted_raw = 0
            self._last_commit = time.monotonic()

    def _commit_loop(self) -> None:
        """The committer: one batch at a time, in order; a failure stops the run (drain raises)."""
        for batch, done in iter(self._commits.get, None):
            if self.error is not None:
                continue  # after a failure nothing more is committed; resume redoes the rest
            try:
                self.store.commit(batch)
            except BaseException as e:
                log.error("commit failed: %s", e)
                self.error = e
                continue
            for p, paths in done:  # only now is the raw copy redundant
                for path in paths:
                    path.unlink(missing_ok=True)
            with self._lock:
                self.ok += len(done)
                self.committing.popleft()

    def _count_failure(self, p: Pending, reason: str) -> None:
        key = reason.split(" (")[0].split(":")[0]
        self.failed[key] += 1
        self.progress.failed += 1
        if len(self.examples[key]) < 5:
            self.examples[key].append(f"{p.sample.source} id={p.sample.id}: {reason}")
        log.warning("sample %s failed: %s", p.sample.id, reason)

    def _delete(self, p: Pending) -> None:
        for path, *_ in p.pieces.values():
            path.unlink(missing_ok=True)
