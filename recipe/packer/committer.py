"""The committer: packed samples made durable in batches, in order, in a thread of its own so that
dispatching goes on while the disk syncs. A batch: the shards fsynced, then its index lines
appended and fsynced (ShardStore.commit); only then are its samples' raw pieces deleted. After the
first failure nothing more is committed (the packer's drain raises it; resume redoes the rest)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

COMMIT_BYTES = 1 << 30  # raw bytes of stored-but-uncommitted samples that force a commit


class Committer:
    def __init__(self, store, lock: threading.Lock, every: int, every_s: float, stopped):
        self.store, self.lock, self.every, self.every_s = store, lock, every, every_s
        self.stopped = stopped  # () -> bool: the run failed elsewhere, commit nothing more
        self.waiting: list[tuple[object, list[Path]]] = []  # packed, not yet handed over: (Pending, pieces)
        self.raw = 0
        self.batches: collections.deque = collections.deque()  # handed over, not yet durable
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="committer", daemon=True)
        self.last = time.monotonic()
        self.ok = 0
        self.error: BaseException | None = None

    def add(self, p, raw: int) -> None:
        self.waiting.append((p, [piece.path for piece in p.pieces.values()]))
        self.raw += raw

    def held(self) -> int:
        """Samples packed but not yet durable (call under the lock)."""
        return len(self.waiting) + sum(len(done) for _, done in self.batches)

    def holds(self, rid: str) -> bool:
        return any(rid == p.rid for p, _ in self.waiting)

    def maybe_commit(self, force: bool = False, workers_busy: bool = True) -> None:
        # Batched while samples stream in (one fsync for many), but never left waiting on the timer
        # when no worker is busy (the end of a run, a lull), nor holding more than COMMIT_BYTES of raw
        # pieces in the dump directory: they are deleted only once committed.
        if not self.waiting:
            return
        if (
            force
            or not workers_busy
            or len(self.waiting) >= self.every
            or self.raw >= COMMIT_BYTES
            or time.monotonic() - self.last > self.every_s
        ):
            item = (self.store.take_pending(), self.waiting)
            with self.lock:
                self.batches.append(item)
            self.queue.put(item)
            self.waiting, self.raw, self.last = [], 0, time.monotonic()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        if self.thread.is_alive():
            self.thread.join()

    def _loop(self) -> None:
        for batch, done in iter(self.queue.get, None):
            if self.error is not None or self.stopped():
                continue
            try:
                self.store.commit(batch)
            except BaseException as e:
                log.error("commit failed: %s", e)
                self.error = e
                continue
            for _, paths in done:  # only now is the raw copy redundant
                for path in paths:
                    path.unlink(missing_ok=True)
            with self.lock:
                self.ok += len(done)
                self.batches.popleft()
