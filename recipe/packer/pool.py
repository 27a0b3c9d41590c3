"""The packing processes. Each owns a shard file (a fresh one once it is full) and appends to it:
compression scales with cores (no GIL), and only small messages cross between processes."""

from __future__ import annotations

import collections
import multiprocessing as mp
import os

from ..shards.codec import Codec
from .messages import PackTask, Result
from .worker import worker_main

QUEUED = 2  # tasks per worker process at once


class WorkerPool:
    def __init__(self, n: int, codec: Codec, store, sync: bool = True):
        self.n, self.codec, self.store, self.sync = max(1, n), codec, store, sync
        self.procs: list = []
        self.inboxes: list = []
        self.outbox = None
        self.shards: dict[int, list] = {}  # worker -> [shard path, bytes assigned]

    def start(self) -> None:
        # fork: workers start in milliseconds and need nothing but numpy and zstd; each dies with us
        ctx = mp.get_context("fork")
        self.outbox = ctx.SimpleQueue()
        for _ in range(self.n):
            inbox = ctx.SimpleQueue()
            p = ctx.Process(target=worker_main, args=(inbox, self.outbox, self.codec, os.getpid(), self.sync))
            p.daemon = True
            p.start()
            self.procs.append(p)
            self.inboxes.append(inbox)

    def pick(self, busy: collections.Counter) -> int | None:
        """The least busy worker (busy: tasks in flight per worker), None if each has QUEUED: the
        shard sizes it rolls over on stay current, and nothing piles up in the pipes."""
        w = min(range(self.n), key=lambda k: busy[k])
        return None if busy[w] >= QUEUED else w

    def shard_for(self, w: int) -> str:
        shard = self.shards.get(w)
        if shard is None or shard[1] >= self.store.max_shard_bytes:
            shard = self.shards[w] = list(self.store.take_shard())
        return str(shard[0])

    def submit(self, w: int, task: PackTask) -> None:
        self.inboxes[w].put(task)

    def packed_to(self, w: int, shard: str, end: int) -> None:
        """A record of worker w ends at `end` of `shard` (unless w has rolled over since)."""
        if self.shards[w][0].name == shard:
            self.shards[w][1] = end

    def results(self):
        """What the workers have sent back so far, without waiting."""
        while not self.outbox.empty():
            result: Result = self.outbox.get()
            yield result

    def stop(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)
        for p in self.procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
        self.procs, self.inboxes = [], []
