"""builtin:tiny-qwen3-next: Qwen3-Next's hybrid layout, scaled down: three gated-DeltaNet (linear
attention) layers then one gated full-attention layer, (1 + w) RMSNorms, partial rotary, and a
sparse MoE with a gated shared expert; ChatML."""

ARCH = "Qwen3NextForCausalLM"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|im_start|>", "<think>", "</think>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3-Next-80B-A3B's config.json: SGLang 0.5.16 places full attention by full_attention_interval
REAL = {"full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25}
MODELS = {"tiny-qwen3-next": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.Qwen3NextConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, hidden_size=64,
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=4, num_experts_per_tok=2,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        layer_types=["linear_attention"] * 3 + ["full_attention"], **ids,
    )  # fmt: skip
