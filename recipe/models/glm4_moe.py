"""builtin:tiny-glm-4.5: GLM-4.5's layout (GLM-4.5 / GLM-4.5-Air), scaled down: partial rotary (half the
head), qkv bias, a first dense layer then sigmoid-routed MoE with a shared expert and score
correction, and GLM's [gMASK]<sop> template."""

ARCH = "Glm4MoeForCausalLM"
SPECIALS = ["[gMASK]", "<|endoftext|>", "<|pad|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
            "<|observation|>", "<think>", "</think>"]  # fmt: skip
TEMPLATE = (
    "[gMASK]<sop>{% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|>\n<think></think>\n"
    "{{ m['content'] }}{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# GLM-4.5-Air's config.json beside transformers' class
REAL = {"rope_theta": 1000000, "num_nextn_predict_layers": 1, "moe_layer_freq": 1, "topk_method": "noaux_tc"}
MODELS = {"tiny-glm-4.5": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.Glm4MoeConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.5, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False, **ids,
    )  # fmt: skip
