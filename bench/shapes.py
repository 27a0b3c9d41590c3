"""Target shapes the GPU benchmarks build: a real model's config with init-scale random weights (normal,
std 0.02; norm weights 1), drawn on the GPU and saved once as bf16 safetensors under the checkpoint's
own names. Such weights give activations that compress about as trained ones do (shared/gpu/README.md:
1.43x against 1.44-1.47x), where `--load-format dummy` gives 2.8x.

  llama-8b     Llama-3.1-8B's shape (about 16 GB), the product bench's default
  gpt-oss-20b  gpt-oss-20b's shape with its experts in bf16 (the checkpoint ships MXFP4): about 42 GB
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    bos_token_id=128000,
    eos_token_id=128001,
    hidden_act="silu",
)

GPT_OSS_20B = dict(
    architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
    num_experts_per_tok=4, experts_per_token=4, vocab_size=201088, max_position_embeddings=131072,
    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 12, swiglu_limit=7.0,
    rms_norm_eps=1e-5, attention_bias=True, tie_word_embeddings=False, torch_dtype="bfloat16", hidden_act="silu",
    rope_theta=150000, initial_context_length=4096,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096},
    bos_token_id=199998, eos_token_id=200002, pad_token_id=199999,
)  # fmt: skip


def llama_layer(c: dict, i: int, w, ones) -> dict:
    H, F = c["hidden_size"], c["intermediate_size"]
    kv = H // c["num_attention_heads"] * c["num_key_value_heads"]
    p = f"model.layers.{i}."
    return {p + "self_attn.q_proj.weight": w(H, H), p + "self_attn.k_proj.weight": w(kv, H),
            p + "self_attn.v_proj.weight": w(kv, H), p + "self_attn.o_proj.weight": w(H, H),
            p + "mlp.gate_proj.weight": w(F, H), p + "mlp.up_proj.weight": w(F, H), p + "mlp.down_proj.weight": w(H, F),
            p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H)}  # fmt: skip


def gpt_oss_layer(c: dict, i: int, w, ones) -> dict:
    """One layer under GPT-OSS's bf16 checkpoint names: biased attention with sinks, a router with a bias,
    the experts fused (gate_up [E, H, 2F], down [E, F, H]) with their biases."""
    H, F, E, D = c["hidden_size"], c["intermediate_size"], c["num_local_experts"], c["head_dim"]
    q, kv, p = c["num_attention_heads"] * D, c["num_key_value_heads"] * D, f"model.layers.{i}."
    return {p + "self_attn.q_proj.weight": w(q, H), p + "self_attn.q_proj.bias": w(q),
            p + "self_attn.k_proj.weight": w(kv, H), p + "self_attn.k_proj.bias": w(kv),
            p + "self_attn.v_proj.weight": w(kv, H), p + "self_attn.v_proj.bias": w(kv),
            p + "self_attn.o_proj.weight": w(H, q), p + "self_attn.o_proj.bias": w(H),
            p + "self_attn.sinks": w(c["num_attention_heads"]), p + "mlp.router.weight": w(E, H),
            p + "mlp.router.bias": w(E), p + "mlp.experts.gate_up_proj": w(E, H, 2 * F),
            p + "mlp.experts.gate_up_proj_bias": w(E, 2 * F), p + "mlp.experts.down_proj": w(E, F, H),
            p + "mlp.experts.down_proj_bias": w(E, H), p + "input_layernorm.weight": ones(H),
            p + "post_attention_layernorm.weight": ones(H)}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    config: dict
    layer: object  # (config, i, w, ones) -> that layer's tensors
    model: str  # the recipe's conf/model option for it
    attention: str  # an attention backend the host's slim kernel wheel has that the model accepts


SHAPES = {
    "llama-8b": Shape(LLAMA_8B, llama_layer, "llama-3.1-8b", "flashinfer"),
    "gpt-oss-20b": Shape(GPT_OSS_20B, gpt_oss_layer, "gpt-oss-20b", "triton"),  # sinks: triton, fa3, trtllm_mha
}


def make_weights(model_dir: Path, shape: str = "llama-8b") -> None:
    """config.json and the weights, drawn on the GPU, one file per layer, once (kept between calls)."""
    import torch
    from safetensors.torch import save_file

    s, model_dir = SHAPES[shape], Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(s.config))
    if (model_dir / "model.safetensors.index.json").exists():
        return
    c, g = s.config, torch.Generator(device="cuda").manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    V, H = c["vocab_size"], c["hidden_size"]
    top = ("model-top.safetensors", lambda: {"model.embed_tokens.weight": w(V, H), "lm_head.weight": w(V, H),
                                             "model.norm.weight": ones(H)})  # fmt: skip
    layers = [(f"model-{i:03d}.safetensors", lambda i=i: s.layer(c, i, w, ones)) for i in range(c["num_hidden_layers"])]
    weight_map = {}
    for name, make in [top, *layers]:  # one file's tensors in memory at a time
        tensors = make()
        save_file(tensors, str(model_dir / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
