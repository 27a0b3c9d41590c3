"""A captured pass off the GPU without stalling it: pinned host buffers from a pool, filled on a
side stream (HostCopy), and the GPU time of the plane split (GpuTimer)."""

from __future__ import annotations

import threading
import time

from .hookstats import Stats


class GpuTimer:
    """GPU time between construction and stop() on the current stream (on a CUDA tensor `like`;
    None: not timed). Read once the pass's copy is done, so it never waits."""

    def __init__(self, like=None):
        self.events = None
        if like is not None and like.is_cuda:
            import torch

            self.events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self.events[0].record()

    def stop(self) -> None:
        if self.events:
            self.events[1].record()

    def seconds(self) -> float:
        return self.events[0].elapsed_time(self.events[1]) / 1e3 if self.events else 0.0


class PinnedPool:
    """The pinned host buffers passes are copied into, reused: pinning (cudaHostAlloc) takes tens
    of ms per 100 MB and holds the CUDA driver meanwhile, so it must not happen in the forward pass
    once the run is timed. A writer thread gives each buffer back once written; `take` waits for one
    (never while the writers' queue has room: the pool holds every buffer that can be in flight)."""

    ROUND = 64 << 20  # grown buffers are rounded up: passes vary in length

    def __init__(self, count: int, stats: Stats | None = None):
        self.count, self.stats = count, stats or Stats()
        self._free: list = []
        self._made = 0
        self._cv = threading.Condition()

    def _alloc(self, nbytes: int):
        import torch

        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
        self.stats.pin_allocs += 1
        self.stats.pin_alloc_s += time.perf_counter() - t0
        return buf

    def fill(self, nbytes: int) -> None:
        """Pin every buffer now at `nbytes` (a whole pass), before the first captured pass."""
        with self._cv:
            while self._made < self.count:
                self._free.append(self._alloc(nbytes))
                self._made += 1

    def take(self, nbytes: int):
        with self._cv:
            while not self._free and self._made >= self.count:
                self._cv.wait()
            self._free.sort(key=lambda b: b.numel())
            for i, b in enumerate(self._free):
                if b.numel() >= nbytes:  # the smallest that fits
                    return self._free.pop(i)
            if self._free:  # all too small: the smallest is replaced by a larger one
                self._free.pop(0)
            else:
                self._made += 1
        return self._alloc(-(-nbytes // self.ROUND) * self.ROUND)

    def give(self, buf) -> None:
        with self._cv:
            self._free.append(buf)
            self._cv.notify()


class HostCopy:
    """GPU tensors -> host tensors, copied on a side stream that waits for the forward's work so
    far. The first (the planes) goes into a pooled pinned buffer, the rest (small) into fresh
    pinned tensors. Returns the event that marks the copy done (None on the CPU), the pool buffer
    to give back once written, and the host tensors."""

    def __init__(self, pool: PinnedPool):
        self.pool = pool
        self._stream = None

    def __call__(self, tensors):
        import torch

        first = tensors[0]
        buf = self.pool.take(first.numel() * first.element_size())
        host0 = buf[: first.numel() * first.element_size()].view(first.dtype).view(first.shape)
        if not first.is_cuda:
            host0.copy_(first)
            return None, buf, [host0, *tensors[1:]]
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=first.device)
        self._stream.wait_stream(torch.cuda.current_stream(first.device))
        out = [host0]
        with torch.cuda.stream(self._stream):
            host0.copy_(first, non_blocking=True)
            for t in tensors[1:]:
                if t is None:
                    out.append(None)
                    continue
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                out.append(host)
            done = torch.cuda.Event()
            done.record(self._stream)
        # the caching allocator must not hand these to the next kernel before the copy ran
        for t in tensors:
            if t is not None:
                t.record_stream(self._stream)
        return done, buf, out
