"""The in-server side: the hook the patched SGLang calls on every pass, in every TP worker.

seam.py installs it on the target model's logits processor once the model is loaded (the patch adds
that call and the hook's call in `LogitsProcessor.forward`, nothing else). Everything else is in this
package, where CPU tests reach it: the settings the recipe passes in the server's environment
(settings.py), the pinned pool and the host copy (hostcopy.py), the writer threads
(writer_threads.py), the hook's timings (hookstats.py).

What a call does, on an exact EXTEND pass that holds at least one of the recipe's requests, in every
rank of an attention-TP group (TP ranks hold identical states; with DP attention each DP group has
its own group), for the rank's own share of the pass's T rows (`share`: rank r of n takes rows
[T*r/n, T*(r+1)/n), so no rank holds up the others' all-reduce with the whole pass's work):
split the K aux captures and the final state into byte planes, written straight into one
[2, rows, K+1, H] tensor, start its copy into a pinned host buffer (from a pool the writer gives back)
on a side stream, and hand it to the writer threads through a bounded queue. The GPU stream never
waits for the disk; the forward pass only blocks when the queue is full, i.e. when the writers fall
behind: held back by the dump budget (the packer is behind), or slower than the GPU.
"""

from __future__ import annotations

import atexit
import logging
import time

from .hookstats import Stats, allocator_counts
from .hostcopy import GpuTimer, HostCopy, PinnedPool
from .settings import HookSettings
from .writer import CaptureWriter
from .writer_threads import CopiedPass, WriterThreads

log = logging.getLogger("recipe.sglang_hook")


def sglang_group() -> tuple[int, int]:
    """(rank, size) in the attention-TP group: ranks that hold the same states (plain TP: all of them)."""
    from sglang.srt.distributed import (
        get_attn_tensor_model_parallel_rank,
        get_attn_tensor_model_parallel_world_size,
    )

    return get_attn_tensor_model_parallel_rank(), get_attn_tensor_model_parallel_world_size()


def share(pre: list[int], ext: list[int], rank: int, size: int):
    """Rank `rank` of `size`'s share of a pass: rows [lo, hi) of its sum(ext), split evenly, and the
    requests in them as (indices into the pass's requests, prefix lengths, extend lengths), cut to the
    share. A request cut by a share's edge gives one piece per side (the packer orders pieces by offset)."""
    T = sum(ext)
    lo, hi = T * rank // size, T * (rank + 1) // size
    idx, pre2, ext2 = [], [], []
    start = 0
    for i, (p, n) in enumerate(zip(pre, ext)):
        a, b = max(start, lo), min(start + n, hi)
        if a < b:
            idx.append(i)
            pre2.append(p + a - start)
            ext2.append(b - a)
        start += n
    return lo, hi, idx, pre2, ext2


def aux_parts(aux, hidden: int) -> list:
    """The K aux captures as [T, H] each: SGLang hands over a list of them (0.5.16) or, in the models it
    moved to its packer (0.5.23), one [T, K*H] tensor of them side by side."""
    if aux is None:
        return []
    if isinstance(aux, (list, tuple)):
        return list(aux)
    return list(aux.split(hidden, dim=-1))


class DumpHook:
    """Selects the passes to dump and snapshots them; HostCopy moves them off the GPU and
    WriterThreads write them, so the forward pass never waits for the disk."""

    def __init__(self, s: HookSettings, group=sglang_group):
        self.layers, self.final, self.prefix = list(s.layers), s.final, s.rid_prefix
        self.writer = CaptureWriter(s.dump_dir, s.budget_bytes, s.rid_prefix, trace_dir=s.trace_dir)
        self._group, self._share_ranks = group, s.share_ranks
        self._rank: tuple[int, int] | None = None  # (rank, ranks sharing), known from the first EXTEND on
        self.stats = Stats()
        self._time_gpu = s.stats_path is not None  # two CUDA events per pass, only when someone reads them
        # every buffer that can be in flight: the queue's, the writers', the one being filled
        self.copy = HostCopy(PinnedPool(max(1, s.queue_size) + max(1, s.writers) + 1, self.stats))
        self._pass_tokens = int(s.pass_tokens)
        self.thread = WriterThreads(
            self.writer, s.rid_prefix, s.queue_size, s.write, self.stats, s.stats_path, self.copy.pool, s.writers
        )
        atexit.register(self.close)

    # -- in the forward pass -------------------------------------------------------------------
    def __call__(self, forward_batch, hidden_states, aux_hidden_states) -> None:
        fm = forward_batch.forward_mode
        if getattr(fm, "name", None) != "EXTEND":  # not DECODE, MIXED, IDLE, TARGET_VERIFY, ...
            return
        if self._rank is None:  # the first EXTEND is the server's own warm-up, before /health
            rank, size = self._group()
            self._rank = (rank, min(size, self._share_ranks or size))
            if rank < self._rank[1] and self._pass_tokens:  # pin the pool now, not in timed passes
                rows = -(-self._pass_tokens // self._rank[1])  # the largest share of a pass
                self.copy.pool.fill(2 * rows * (len(self.layers) + self.final) * hidden_states.shape[-1])
            if rank:  # the stats file holds rank 0's figures: every rank does an equal share
                self.thread.stats_path, self._time_gpu = None, False
        if self._rank[0] >= self._rank[1]:  # a rank that does not share the writing
            return
        rids = list(getattr(forward_batch, "rids", None) or [])  # a LogitsMetadata has none: no_dump, detected
        t0 = time.perf_counter()
        try:
            self._capture(forward_batch, rids, hidden_states, aux_hidden_states)
        except Exception as e:  # never kill the server; the packer turns the marker into a failed sample
            log.exception("hidden-state capture failed")
            for r in rids:
                if r.startswith(self.prefix):
                    self.writer.write_error(r, f"hook: {type(e).__name__}: {e}")
        self.stats.forward_s += time.perf_counter() - t0

    def _capture(self, fb, rids, hidden_states, aux_hidden_states) -> None:
        import torch

        ext = [int(x) for x in fb.extend_seq_lens_cpu]
        pre = [int(x) for x in fb.extend_prefix_lens_cpu]
        T = sum(ext)
        lo, hi, idx, pre, ext = share(pre, ext, *self._rank)
        rids = [rids[i] for i in idx]
        if not any(r.startswith(self.prefix) for r in rids):  # warm-up, health checks: nothing of ours
            return
        parts = aux_parts(aux_hidden_states, hidden_states.shape[-1])
        if len(parts) != len(self.layers):
            raise RuntimeError(f"model captured {len(parts)} layers, {len(self.layers)} configured {self.layers}")
        if self.final:
            parts.append(hidden_states)
        for p in parts:
            if p.shape[0] < T:  # e.g. attention-TP scattered states: refuse rather than write garbage
                raise RuntimeError(f"hidden states have {p.shape[0]} rows for {T} tokens in the pass")
        if self._time_gpu and parts[0].is_cuda and self.thread.probe is None:
            # counted from here on, read by the writers as they save the stats (a read costs ~0.6 ms
            # of host time: once per pass it showed in forward_s on the H200)
            dev, base = parts[0].device, allocator_counts(parts[0].device)
            self.thread.probe = lambda: {k: v - base[k] for k, v in allocator_counts(dev).items()}
        # [2, rows, slots, H]: each slot's bf16 states split into high and low bytes straight into one
        # fresh tensor (one copy, one D2H transfer); on the GPU the split is cheap (0.10 s of GPU
        # time per rank in a 36 s TP=2 run on H200s), and the packer then only streams planes
        timer = GpuTimer(parts[0] if self._time_gpu else None)
        planes = torch.empty((2, hi - lo, len(parts), parts[0].shape[-1]), dtype=torch.uint8, device=parts[0].device)
        for k, p in enumerate(parts):
            b = p[lo:hi].contiguous().view(torch.uint8).view(hi - lo, -1, 2)  # little-endian: byte 1 is high
            planes[0, :, k] = b[..., 1]
            planes[1, :, k] = b[..., 0]
        timer.stop()
        # Snapshot in stream order: SGLang refills its input buffers for the next batch (overlap
        # scheduling) before a side-stream copy of the original views would run. Seen on an H200:
        # without these clones the dumped ids belonged to the next batch.
        ids = fb.input_ids[lo:hi].clone()
        orig = getattr(fb, "orig_seq_lens", None)
        orig = orig.clone() if orig is not None else None
        done, buf, (host, host_ids, host_orig) = self.copy([planes, ids, orig])
        t0 = time.perf_counter()
        # blocks only when the writers are behind
        self.thread.put(CopiedPass(done, buf, timer, rids, pre, ext, idx, host_ids, host, host_orig))
        self.stats.put_wait_s += time.perf_counter() - t0

    def flush(self) -> None:
        self.thread.flush()

    def close(self) -> None:
        self.thread.close()
