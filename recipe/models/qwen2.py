"""builtin:tiny-qwen2.5: Qwen2.5's layout (qkv bias, GQA, untied head as in 7B/72B), scaled down, with its
ChatML template and default system turn."""

ARCH = "Qwen2ForCausalLM"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|im_start|>"]
TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\n"
    "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5-7B-Instruct's config.json (transformers 5 writes rope_parameters instead of rope_theta)
REAL = {"rope_theta": 1000000.0, "sliding_window": 131072, "use_sliding_window": False, "max_window_layers": 28}
MODELS = {"tiny-qwen2.5": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.Qwen2Config(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
                                    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, rope_theta=1000000.0, **ids)  # fmt: skip
