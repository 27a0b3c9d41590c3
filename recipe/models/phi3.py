"""builtin:tiny-phi-4: Phi3ForCausalLM as Phi-4 ships it, scaled down: fused qkv_proj and gate_up_proj
weights, GQA, full rotary, untied head; Phi-4's <|im_sep|> template."""

ARCH = "Phi3ForCausalLM"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|dummy_85|>", "<|im_start|>", "<|im_sep|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}<|im_sep|>{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant<|im_sep|>{% endif %}"
)
REAL = {"rope_theta": 250000}  # microsoft/phi-4's config.json
MODELS = {"tiny-phi-4": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.Phi3Config(
        vocab_size=vocab, max_position_embeddings=16384, original_max_position_embeddings=16384,
        tie_word_embeddings=False, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=250000.0, sliding_window=None, **ids,
    )  # fmt: skip
