"""builtin:tiny-mistral: Mistral's layout (Llama-like, head_dim set apart, no sliding window as in the
newer Mistral checkpoints), scaled down, with its [INST] template."""

ARCH = "MistralForCausalLM"
SPECIALS = ["<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ m['content'] }}[/INST]"
    "{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)
REAL = {"rope_theta": 1000000.0}
MODELS = {"tiny-mistral": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.MistralConfig(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
                                      hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      sliding_window=None, **ids)  # fmt: skip
