"""builtin:tiny-glm-5: GLM-5's layout (GlmMoeDsaForCausalLM: MLA with DeepSeek's sparse-attention indexer,
a first dense layer, then sigmoid-routed MoE with a shared expert), scaled down; GLM's [gMASK]<sop>
template, as GLM-4.5's."""

from .glm4_moe import SPECIALS, TEMPLATE  # noqa: F401  (GLM's markers and template)

ARCH = "GlmMoeDsaForCausalLM"
MODELS = {"tiny-glm-5": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.GlmMoeDsaConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, hidden_size=256,
        intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=256, qk_nope_head_dim=192,
        qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, index_head_dim=128, index_n_heads=4,
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, **ids,
    )  # fmt: skip
