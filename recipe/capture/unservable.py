"""Checkpoint shapes the pinned SGLang cannot serve, recognised from config.json before any GPU work.

SGLang 0.5.16's Qwen3-MoE attention writes the KV cache from inside its fused rotary kernel, which
exists only for head sizes 64, 128, 256 and 512. Any other head size takes the fallback rotary kernel,
which asserts "save kv cache is not supported" on the first forward pass: the server dies at start-up
after loading the weights (seen on an H100, docs/gpu-results/2026-12-06-families-new). Published
Qwen3-MoE checkpoints use 128.

Its Qwen3-MoE decoder also builds every layer as a routed MoE: a checkpoint with dense layers
(`mlp_only_layers`, or `decoder_sparse_step` over 1) has those layers' MLP weights never loaded, and
its states come out NaN while the logits stay finite (tests/gpu/moe_nan.py: every shape with a dense
layer, none without). Published Qwen3-MoE checkpoints have none.

ALLOW_ENV names classes to run regardless of a refusal here (a user who knows better, or a scenario that
checks a fix).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .architectures import UnsupportedArchitecture

FUSED_ROPE_HEAD_SIZES = (64, 128, 256, 512)  # Qwen3-MoE's fused rotary KV write, seen failing at 16 on a GPU
ALLOW_ENV = "HS_RECIPE_ALLOW_ARCH"  # comma-separated classes run despite a refusal here


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def dense_layers(cfg: dict) -> list[int]:
    """The layers a Qwen3-MoE checkpoint keeps dense, as transformers decides them."""
    step, only = int(cfg.get("decoder_sparse_step") or 1), set(cfg.get("mlp_only_layers") or [])
    n = int(cfg.get("num_hidden_layers", 0))
    return [i for i in range(n) if i in only or not (cfg.get("num_experts") and (i + 1) % step == 0)]


def refuse_unservable(model_dir: Path, name: str) -> None:
    """One line naming the condition, where SGLang would die on its first forward pass or serve NaN."""
    if name in os.environ.get(ALLOW_ENV, "").split(","):
        return
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    if name != "Qwen3MoeForCausalLM":
        return
    if dense_layers(cfg):
        raise UnsupportedArchitecture(
            f"{name} with dense layers {dense_layers(cfg)} (mlp_only_layers, decoder_sparse_step): SGLang 0.5.16 "
            "builds every Qwen3-MoE layer as MoE, so their weights are never loaded and its states come out NaN; "
            "backend=hf runs it"
        )
    if head_dim(cfg) not in FUSED_ROPE_HEAD_SIZES:
        raise UnsupportedArchitecture(
            f"{name} with head_dim {head_dim(cfg)}: SGLang 0.5.16 serves it only with head_dim "
            f"{', '.join(map(str, FUSED_ROPE_HEAD_SIZES))} (its fused rotary KV write has no other size); "
            "backend=hf runs it"
        )
