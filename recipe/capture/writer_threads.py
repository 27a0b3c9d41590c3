"""The hook's writer threads: copied passes from a bounded queue, written as raw records into the
dump folder (recipe/capture/writer.py), their pinned buffers given back once written."""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

from .hookstats import Stats
from .hostcopy import GpuTimer, PinnedPool
from .writer import CaptureWriter

log = logging.getLogger("recipe.sglang_hook")


@dataclass(frozen=True)
class CopiedPass:
    """One pass's share, on its way from the forward pass to a writer thread."""

    done: object  # CUDA event: the host copy is complete (None on the CPU)
    buf: object  # the pooled pinned buffer `planes` lives in, given back once written
    timer: GpuTimer  # the plane split's GPU time
    rids: list[str]  # the requests in this rank's share, in pass order
    pre: list[int]  # each one's prefix length (tokens before this piece)
    ext: list[int]  # and its extend length (tokens in this piece)
    idx: list[int]  # their indices among the pass's requests
    ids: object  # host token ids of the share
    planes: object  # host [2, rows, slots, H] uint8: high and low byte planes
    orig: object  # host prompt lengths of the pass's requests (None where SGLang gives none)


class WriterThreads:
    """A bounded queue of copied passes and the threads that write them as raw records. Several:
    one thread copies ~2 GB/s into /dev/shm (seen on the H200 host), about what one rank emits at
    TP=1 on an 8B; a pass's records are independent of the others', and the
    packer orders pieces by offset, so the order passes are written in does not matter."""

    def __init__(
        self,
        writer: CaptureWriter,
        rid_prefix: str,
        queue_size: int,
        write: bool = True,
        stats: Stats | None = None,
        stats_path=None,
        pool: PinnedPool | None = None,
        threads: int = 2,
    ):
        self.writer, self.prefix, self.write = writer, rid_prefix, write
        self.stats, self.stats_path, self._stats_at = stats or Stats(), stats_path, 0.0
        self._stats_lock = threading.Lock()
        self.pool = pool
        self.probe = None  # () -> {Stats field: value}, read as the stats are saved
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, queue_size))
        self._threads = [
            threading.Thread(target=self._drain, name=f"hs-dump-writer-{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def put(self, item: CopiedPass) -> None:
        self.queue.put(item)

    def _drain(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                self._save_stats()
                return
            c: CopiedPass = item
            buf, rids, pre, ext, idx = c.buf, c.rids, c.pre, c.ext, c.idx
            t0 = time.perf_counter()
            t1, written, gpu_s = t0, 0, 0.0
            try:
                if c.done is not None:
                    c.done.synchronize()
                t1 = time.perf_counter()
                gpu_s = c.timer.seconds()
                if not self.write:
                    continue
                lasts = None
                if c.orig is not None and idx and len(c.orig) > idx[-1]:  # the prompt's full length, per request
                    o = c.orig.tolist()
                    lasts = [p + n == o[i] for i, p, n in zip(idx, pre, ext)]
                written = self.writer.write_pass(rids, pre, ext, c.ids, c.planes, lasts)
            except Exception as e:
                log.exception("hidden-state write failed")
                for r in rids:
                    if r.startswith(self.prefix):
                        try:
                            self.writer.write_error(r, f"writer: {type(e).__name__}: {e}")
                        except OSError:
                            pass
            finally:  # written (or failed): nothing reads the buffer any more
                if self.pool is not None:
                    self.pool.give(buf)
                with self._stats_lock:
                    st = self.stats
                    st.passes, st.tokens, st.bytes = st.passes + 1, st.tokens + sum(ext), st.bytes + written
                    st.copy_wait_s += t1 - t0
                    st.write_s += time.perf_counter() - t1
                    st.split_gpu_s += gpu_s
                    st.budget_wait_s = self.writer.waited_s
                self._save_stats(every_s=0.0 if self.queue.empty() else 1.0)  # fresh whenever it idles
                self.queue.task_done()

    def _save_stats(self, every_s: float = 0.0) -> None:
        with self._stats_lock:
            now = time.monotonic()
            if self.stats_path is None or now - self._stats_at < every_s:
                return
            self._stats_at = now
            for k, v in (self.probe() if self.probe else {}).items():
                setattr(self.stats, k, v)
            tmp = f"{self.stats_path}.{threading.get_ident()}.tmp"
            try:
                with open(tmp, "w") as f:
                    json.dump(asdict(self.stats), f)
                os.replace(tmp, self.stats_path)
            except OSError:
                log.warning("cannot write hook stats to %s", self.stats_path)

    def flush(self) -> None:
        self.queue.join()

    def close(self) -> None:
        alive = [t for t in self._threads if t.is_alive()]
        for _ in alive:
            self.queue.put(None)
        for t in alive:
            t.join(timeout=60)
