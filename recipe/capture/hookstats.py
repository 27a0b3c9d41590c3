"""The hook's own timings, kept by rank 0 and saved for the benchmarks (SGLANG_HS_STATS)."""

from __future__ import annotations

from dataclasses import dataclass


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
