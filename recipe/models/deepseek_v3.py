"""builtin:tiny-deepseek-v3: DeepSeek-V3's layout (MLA + MoE, the shapes seen served by SGLang 0.5.16),
scaled down; also the language model of builtin:tiny-kimi-k2.5."""

from .llama import SPECIALS, TEMPLATE  # noqa: F401  (the same byte tokenizer and ChatML)

ARCH = "DeepseekV3ForCausalLM"
MODELS = {"tiny-deepseek-v3": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, rope_scaling=None,
        hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=512,
        q_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        # keys real DeepSeek-V3 config.json files carry and SGLang reads
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, **ids,
    )  # fmt: skip
