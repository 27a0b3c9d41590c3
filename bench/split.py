"""The hook's plane split on the GPU, two ways, on one pass of an 8B shape: GPU ms per pass and GB/s.

  python3 bench/split.py                  # on the GPU host: --tokens 8192 --hidden 4096 --slots 4
  python3 bench/split.py --device cpu --tokens 256 --reps 3     # a plumbing check here

`bytes`: each slot's bf16 seen as bytes, the odd (high) and even (low) ones copied out (what the hook
does); `words`: each slot seen as int16 words, the high byte as `w >> 8` and the low
one as the word cast to uint8, each written in one elementwise pass. Both must give the same planes
(checked here on values including -0, Inf and NaN). Data: N(0, 0.05) in bf16, a whole chunked-prefill
pass (8192 tokens) of the 8B shape the throughput benchmark serves.
Seen on an H200 (docs/benchmarks.md, "The hook's split kernel"): `bytes` 0.625 ms per pass, `words` 0.761 ms and
*not* the same planes there (the same on the CPU), so the hook keeps `bytes`.
"""

from __future__ import annotations

import argparse
import json

import torch


def split_bytes(parts, planes) -> None:
    T = planes.shape[1]
    for k, p in enumerate(parts):
        b = p.view(torch.uint8).view(T, -1, 2)  # little-endian: byte 1 is the high byte
        planes[0, :, k] = b[..., 1]
        planes[1, :, k] = b[..., 0]


def split_words(parts, planes) -> None:
    for k, p in enumerate(parts):
        w = p.view(torch.int16)
        torch.bitwise_right_shift(w, 8, out=planes[0, :, k])  # the sign bits shifted in are cut off
        planes[1, :, k].copy_(w)  # int16 -> uint8 keeps the low byte


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    dev = torch.device(a.device)
    g = torch.Generator(device=dev).manual_seed(0)
    parts = [
        (torch.randn(a.tokens, a.hidden, generator=g, device=dev) * 0.05).to(torch.bfloat16) for _ in range(a.slots)
    ]
    parts[0][0, :4] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan")], device=dev)
    out = {}
    ref = None
    for name, f in (("bytes", split_bytes), ("words", split_words)):
        planes = torch.empty((2, a.tokens, a.slots, a.hidden), dtype=torch.uint8, device=dev)
        f(parts, planes)
        if ref is None:
            ref = planes.clone()
        same = bool(torch.equal(planes, ref))
        if dev.type == "cuda":
            torch.cuda.synchronize()
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for _ in range(a.reps):
                f(parts, planes)
            t1.record()
            t1.synchronize()
            ms = t0.elapsed_time(t1) / a.reps
        else:
            import time

            t = time.perf_counter()
            for _ in range(a.reps):
                f(parts, planes)
            ms = (time.perf_counter() - t) * 1e3 / a.reps
        moved = 2 * planes.numel()  # bytes read + bytes written
        out[name] = {"ms_per_pass": round(ms, 3), "GB_per_s_moved": round(moved / ms / 1e6, 1), "same_planes": same}
    dev_name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    print(json.dumps({"argv": vars(a), "device": dev_name, "split": out}, indent=1))


if __name__ == "__main__":
    main()
