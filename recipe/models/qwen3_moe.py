"""builtin:tiny-qwen3-moe: Qwen3-MoE's layout (Qwen3-30B-A3B, Qwen3-235B-A22B), scaled down: per-head q/k
RMSNorm, GQA, a routed MoE in every layer (decoder_sparse_step 1, no dense layers, no shared expert)
with normalized top-k weights; ChatML and Qwen3's thinking markers."""

from .qwen3 import SPECIALS, TEMPLATE  # noqa: F401  (Qwen3's tokenizer markers and template)

ARCH = "Qwen3MoeForCausalLM"
# Qwen3-30B-A3B's config.json: every layer sparse, none dense
REAL = {"rope_theta": 1000000.0, "decoder_sparse_step": 1, "mlp_only_layers": []}
MODELS = {"tiny-qwen3-moe": {}}


# what tests/gpu/moe_nan.py varies: the shape a user reported NaN final states for differs in these
SHAPE = dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[])


def config(vocab: int, ids: dict, **shape):
    """head_dim 64: SGLang writes Qwen3-MoE's KV cache from its fused rotary kernel, which has only head sizes
    64, 128, 256 and 512 (recipe/capture/unservable.py); the real checkpoints use 128."""
    import transformers

    return transformers.Qwen3MoeConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64, norm_topk_prob=True,
        decoder_sparse_step=1, rope_theta=1000000.0, **{**SHAPE, **shape}, **ids,
    )  # fmt: skip
