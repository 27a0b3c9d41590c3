"""builtin:tiny-qwen3: Qwen3's dense layout (per-head q/k RMSNorm, no qkv bias, GQA), scaled down, with
ChatML and Qwen3's thinking markers."""

ARCH = "Qwen3ForCausalLM"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|im_start|>", "<think>", "</think>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODELS = {"tiny-qwen3": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.Qwen3Config(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
                                    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, rope_theta=1000000.0, **ids)  # fmt: skip
