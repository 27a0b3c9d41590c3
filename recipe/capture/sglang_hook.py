"""The in-server side: called from the patched `...ForCausalLM` (patches/sglang/), in every TP worker.

The patch adds two things to a model class and nothing else:
  __init__: `self.hs_dump = install(self)` when SGLANG_HS_DUMP_DIR is set
  forward:  `self.hs_dump(forward_batch, hidden_states, aux_hidden_states)` once both are in hand
Everything else is here, where CPU tests reach it.

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
import json
import logging
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass

from .writer import CaptureWriter

log = logging.getLogger("recipe.sglang_hook")

ENV_DIR = "SGLANG_HS_DUMP_DIR"
ENV_LAYERS = "SGLANG_HS_LAYERS"  # "3,31,59": residual stream entering those layers
ENV_FINAL = "SGLANG_HS_FINAL"  # "1": also the final post-norm state
ENV_PREFIX = "SGLANG_HS_RID_PREFIX"
ENV_BUDGET = "SGLANG_HS_BUDGET_BYTES"
ENV_QUEUE = "SGLANG_HS_QUEUE"
ENV_WRITERS = "SGLANG_HS_WRITERS"  # writer threads: one copies ~2 GB/s into /dev/shm, TP=2 emits more
ENV_NO_WRITE = "SGLANG_HS_NO_WRITE"  # benchmark arm: capture and copy, but write nothing
ENV_TRACE = "SGLANG_HS_TRACE"  # a folder: each writing process lists what it wrote (the TP/DP proofs)
ENV_PASS_TOKENS = "SGLANG_HS_PASS_TOKENS"  # most tokens one pass holds (chunked_prefill_size): sizes the pool
ENV_STATS = "SGLANG_HS_STATS"  # a file: the hook's own timings, kept current (benchmarks)
# how many of an attention-TP group's first ranks share the writing (0: all). A server over several
# nodes writes from the packer's node only: the others' /dev/shm is not the one the packer reads
ENV_SHARE = "SGLANG_HS_SHARE_RANKS"


def env_for(
    dump_dir,
    layers,
    final: bool,
    rid_prefix: str,
    budget_bytes: int,
    queue_size: int = 4,
    pass_tokens: int = 0,
    writers: int = 2,
    share_ranks: int = 0,
) -> dict:
    """The server's environment that switches the dump on (the recipe's side of the contract)."""
    return {
        ENV_DIR: str(dump_dir),
        ENV_LAYERS: ",".join(str(int(i)) for i in layers),
        ENV_FINAL: "1" if final else "0",
        ENV_PREFIX: rid_prefix,
        ENV_BUDGET: str(int(budget_bytes)),
        ENV_QUEUE: str(int(queue_size)),
        ENV_PASS_TOKENS: str(max(0, int(pass_tokens or 0))),
        ENV_WRITERS: str(max(1, int(writers))),
        ENV_SHARE: str(max(0, int(share_ranks))),
    }


def install(model, env=os.environ):
    """Switch on aux capture with exactly the configured layers; return the hook (or None).

    The layer list is set on the model directly: `set_eagle3_layers_to_capture` shifts ids by +1
    (always in Llama, only when the first id is 1 in DeepSeek), the field's classic off-by-one.
    """
    if not env.get(ENV_DIR):
        return None
    layers = [int(x) for x in env.get(ENV_LAYERS, "").split(",") if x.strip()]
    pp = getattr(model, "pp_group", None)
    if pp is not None and getattr(pp, "world_size", 1) > 1:
        raise RuntimeError("hidden-state dump does not support pipeline parallelism (pp_size > 1)")
    if layers:
        if layers != sorted(set(layers)) or layers[0] < 1:
            raise ValueError(f"{ENV_LAYERS}={layers}: need ascending ids >= 1 (SGLang cannot capture layer 0)")
        model.capture_aux_hidden_states = True
        model.model.layers_to_capture = list(layers)
    final = env.get(ENV_FINAL, "1") == "1"
    hook = DumpHook(
        env[ENV_DIR],
        layers,
        final,
        env.get(ENV_PREFIX, "hsx-"),
        int(env.get(ENV_BUDGET, str(8 << 30))),
        int(env.get(ENV_QUEUE, "4")),
        write=env.get(ENV_NO_WRITE, "0") != "1",
        trace_dir=env.get(ENV_TRACE) or None,
        pass_tokens=int(env.get(ENV_PASS_TOKENS, "0") or 0),
        stats_path=env.get(ENV_STATS) or None,
        writers=int(env.get(ENV_WRITERS, "2")),
        share_ranks=int(env.get(ENV_SHARE, "0") or 0),
    )
    log.info("hidden-state dump on: layers %s (+final: %s) -> %s", layers, hook.final, env[ENV_DIR])
    return hook


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


@dataclass
class Stats:
    """Where the time goes on rank 0 (SGLANG_HS_STATS; bench/prefill.py reports it): every rank of a
    TP group does an equal share. forward_s is the hook's wall time in the forward thread: all it
    starts on the GPU is asynchronous, so this is what the scheduler loses to it on the host, pinning
    and waits for a free buffer included; split_gpu_s is the GPU time of the plane split; copy_wait_s
    and write_s are summed over the writer threads."""

    passes: int = 0
    tokens: int = 0
    bytes: int = 0
    forward_s: float = 0.0
    pin_allocs: int = 0
    pin_alloc_s: float = 0.0
    put_wait_s: float = 0.0
    split_gpu_s: float = 0.0
    copy_wait_s: float = 0.0
    write_s: float = 0.0
    budget_wait_s: float = 0.0
    # the CUDA caching allocators' counters over the captured passes (from the first one on): a
    # device or pinned-host allocation in a pass, or a retry that syncs every stream, stalls the GPU
    device_allocs: int = 0
    alloc_retries: int = 0
    sync_all_streams: int = 0
    host_allocs: int = 0


def allocator_counts(device) -> dict[str, int]:
    """Stats' allocator fields as the counters stand now (cumulative since the process started);
    zeros where this torch cannot say (diagnostics must never fail a capture)."""
    import torch

    try:
        dev = torch.cuda.memory_stats(device)
        host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    except Exception:
        dev, host = {}, {}
    return {
        "device_allocs": int(dev.get("num_device_alloc", 0)),
        "alloc_retries": int(dev.get("num_alloc_retries", 0)),
        "sync_all_streams": int(dev.get("num_sync_all_streams", 0)),
        "host_allocs": int(host.get("num_host_alloc", 0)),
    }


class DumpHook:
    """Selects the passes to dump and snapshots them; HostCopy moves them off the GPU and
    WriterThreads write them, so the forward pass never waits for the disk."""

    def __init__(
        self,
        dump_dir,
        layers,
        final: bool,
        rid_prefix: str,
        budget_bytes: int,
        queue_size: int = 4,
        group=sglang_group,
        write: bool = True,
        trace_dir=None,
        pass_tokens: int = 0,
        stats_path=None,
        writers: int = 2,
        share_ranks: int = 0,
    ):
        self.layers, self.final, self.prefix = list(layers), final, rid_prefix
        self.writer = CaptureWriter(dump_dir, budget_bytes, rid_prefix, trace_dir=trace_dir)
        self._group, self._share_ranks = group, share_ranks
        self._rank: tuple[int, int] | None = None  # (rank, ranks sharing), known from the first EXTEND on
        self.stats = Stats()
        self._time_gpu = stats_path is not None  # two CUDA events per pass, only when someone reads them
        # every buffer that can be in flight: the queue's, the writers', the one being filled
        self.copy = HostCopy(PinnedPool(max(1, queue_size) + max(1, writers) + 1, self.stats))
        self._pass_tokens = int(pass_tokens)
        self.thread = WriterThreads(
            self.writer, rid_prefix, queue_size, write, self.stats, stats_path, self.copy.pool, writers
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
        rids = list(forward_batch.rids or [])
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
        parts = list(aux_hidden_states or [])
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
        self.thread.put((done, buf, timer, rids, pre, ext, idx, host_ids, host, host_orig))
        self.stats.put_wait_s += time.perf_counter() - t0

    def flush(self) -> None:
        self.thread.flush()

    def close(self) -> None:
        self.thread.close()


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

    def put(self, item) -> None:
        self.queue.put(item)

    def _drain(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                self._save_stats()
                return
            done, buf, timer, rids, pre, ext, idx, ids, host, orig = item
            t0 = time.perf_counter()
            t1, written, gpu_s = t0, 0, 0.0
            try:
                if done is not None:
                    done.synchronize()
                t1 = time.perf_counter()
                gpu_s = timer.seconds()
                if not self.write:
                    continue
                lasts = None
                if orig is not None and idx and len(orig) > idx[-1]:  # the prompt's full length, per request
                    o = orig.tolist()
                    lasts = [p + n == o[i] for i, p, n in zip(idx, pre, ext)]
                written = self.writer.write_pass(rids, pre, ext, ids, host, lasts)
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
