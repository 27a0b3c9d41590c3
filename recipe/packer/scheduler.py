"""The packer thread: scan the dump folder, dispatch what is complete, collect what the workers
packed, hand it to the committer. `Packer` is what the backend and the run see."""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from pathlib import Path

import numpy as np

from ..errors import UserError, disk_full
from ..schema import CaptureConfig, ShardsConfig
from ..shards.codec import Codec
from .books import Books, Pending, drop_pieces
from .committer import Committer
from .messages import DiskError, Packed, PackTask, Refused
from .pool import WorkerPool
from .progress import Progress
from .scan import DumpScanner

log = logging.getLogger(__name__)


class Packer:
    """Use as a context manager: workers start on entry; on exit the packer thread finishes, the
    workers stop, and the last records are committed."""

    def __init__(
        self,
        dump_dir,
        store,
        codec: Codec,
        slots: list[str],
        workers: int = ShardsConfig.workers,  # defaults: the schema's, one home for each
        dump_timeout_s: float = CaptureConfig.dump_timeout_s,
        commit_every: int = ShardsConfig.commit_every,
        commit_every_s: float = 2.0,
        progress: Progress | None = None,
        poll_s: float = 0.01,
        sync_records: bool = True,
    ):
        self.dump_dir, self.store, self.slots = Path(dump_dir), store, slots
        self.dump_timeout_s, self.poll_s = dump_timeout_s, poll_s
        self.progress = progress or Progress(0)
        self.books = Books(self.progress)
        self.pool = WorkerPool(workers, codec, store, sync_records)
        failed = lambda: self._error is not None  # noqa: E731  (the committer stops committing)
        self.committer = Committer(store, self.books.lock, commit_every, commit_every_s, failed)
        self.inflight: dict[int, tuple[Pending, int]] = {}  # task id -> (request, worker)
        self.scanner = DumpScanner(self.dump_dir, self.books, dump_timeout_s, self._in_progress, self._dispatch)
        self._error: BaseException | None = None
        self._stop, self._thread = threading.Event(), threading.Thread(target=self._run, name="packer", daemon=True)
        self._tids = itertools.count()
        self.codec_error = np.zeros((2, len(slots)))  # fp8: per slot, squared error and squared norm stored
        b = self.books  # the backend's side: what it sent, what answered, what failed or was retried
        self.expect, self.responded, self.fail, self.forget = b.expect, b.responded, b.fail, b.forget

    ok = property(lambda self: self.committer.ok)
    failed = property(lambda self: self.books.failed)
    examples = property(lambda self: self.books.examples)
    error = property(lambda self: self._error or self.committer.error)

    def outstanding(self) -> int:
        return sum(self.stages_left().values())

    def stages_left(self) -> dict[str, int]:
        """Samples each stage still holds: waiting for their dump (or a free worker), being packed,
        packed but not yet committed."""
        with self.books.lock:
            return {
                "waiting": len(self.books.pending),
                "packing": len(self.inflight),
                "committing": self.committer.held(),
            }

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> "Packer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Packer":
        self.pool.start()
        self.committer.start()
        self._thread.start()
        return self

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every expected request is stored or failed (raises the packer's own error)."""
        t0 = time.monotonic()
        while self.outstanding():
            if self.error:
                raise_for(self.error)
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"packer still has {self.outstanding()} samples after {timeout_s}s")
            time.sleep(self.poll_s)
        if self.error:
            raise_for(self.error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.committer.stop()
        self.pool.stop()
        try:
            self.store.commit()
        except OSError as e:  # e.g. the disk is full: what was not committed is redone on resume
            log.error("final commit failed: %s", e)

    # -- the packer thread: scan, dispatch, collect, commit -------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self.scanner.scan()
                busy |= self._collect()
                self.committer.maybe_commit(workers_busy=bool(self.inflight))
                self.progress.maybe_log()
                if not busy:
                    time.sleep(self.poll_s)
            while self.inflight and self.error is None:  # the workers' last results
                if not self._collect():
                    time.sleep(self.poll_s)
            self.committer.maybe_commit(force=True)
        except UserError as e:  # a damaged or foreign output folder: the user's, one line (drain raises it)
            self._error = e
        except BaseException as e:  # surfaced by drain(); never a silent hole
            log.exception("packer thread died")
            self._error = e

    def _in_progress(self, rid: str) -> bool:
        return any(rid == q.rid for q, _ in self.inflight.values()) or self.committer.holds(rid)

    def _dispatch(self, p: Pending) -> bool:
        """To the least busy worker, into its own shard. False when every worker is busy."""
        w = self.pool.pick(collections.Counter(w for _, w in self.inflight.values()))
        if w is None:
            return False
        tid = next(self._tids)
        self.inflight[tid] = (p, w)
        self.pool.submit(w, task_for(p, tid, self.pool.shard_for(w), self.slots))
        self.progress.mark("dispatched")
        return True

    def _collect(self) -> bool:
        busy = False
        for res in self.pool.results():
            with self.books.lock:
                p, w = self.inflight.pop(res.tid)
            busy = True
            if isinstance(res, Refused):
                self.books.count_failure(p, res.reason)
                drop_pieces(p)
            elif isinstance(res, DiskError):
                raise OSError(res.errno, res.strerror, res.filename)
            elif not isinstance(res, Packed):  # a bug in a worker: kill the run loudly
                raise RuntimeError(f"packer worker failed on sample {p.sample.id}:\n{res.traceback}")
            else:
                self.pool.packed_to(w, res.shard, res.offset + res.length)
                self.codec_error += np.asarray(res.error) if res.error is not None else 0
                index(self.store, p.sample, res)
                self.committer.add(p, res.raw)
                self.books.early.settled(None)
                self.progress.add(len(p.sample.input_ids), res.raw, res.length)
        return busy


def raise_for(error: BaseException):
    """The packer's error as the run reports it."""
    if isinstance(error, UserError):  # the user's to fix: as it was raised, one line
        raise error
    full = disk_full(error)
    if full is not None:  # a worker's frame, the index or a commit: the run ends, resume redoes the rest
        raise full from error
    raise RuntimeError("packer failed") from error


def task_for(p: Pending, tid: int, shard: str, slots: list[str]) -> PackTask:
    """What a worker needs to pack one request: its pieces in prompt order and what was sent."""
    first, s = p.pieces[min(p.pieces)], p.sample
    meta = {"id": s.id, "key": s.key, "source": s.source, "slots": slots}
    meta["dtypes"] = {"input_ids": "int32", "loss_mask": "uint8", "hidden": "bfloat16"}
    return PackTask(
        tid=tid,
        shard=shard,
        n=len(s.input_ids),
        slots=first.slots,
        hidden=first.hidden,
        n_slots=len(slots),
        pieces=tuple((str(p.pieces[o].path), p.pieces[o].tokens) for o in sorted(p.pieces)),
        input_ids=np.asarray(s.input_ids, dtype=np.int32),
        loss_mask=np.asarray(s.loss_mask, np.uint8),
        meta=meta,
    )


def index(store, s, res: Packed) -> None:
    """The packed record into the store's index (durable once the committer commits it)."""
    store.add(
        s.id,
        s.key,
        res.shard,
        res.offset,
        res.length,
        res.crc,
        tokens=len(s.input_ids),
        raw_bytes=res.raw,
        loss_tokens=int(np.asarray(s.loss_mask).sum()),
        source=s.source,
        token_ids=(s.input_ids, s.loss_mask),
    )
