"""builtin:tiny-gpt-oss: GPT-OSS's layout (gpt-oss-20b/120b), scaled down: attention sinks, sliding and
full attention alternating, qkv and o biases, a top-k MoE with clamped SwiGLU, YaRN rope, and a
Harmony-shaped chat template. Experts in bf16 (the real checkpoint ships them in MXFP4)."""

ARCH = "GptOssForCausalLM"
SPECIALS = ["<|startoftext|>", "<|return|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>",
            "<|channel|>", "<|call|>", "<|constrain|>"]  # fmt: skip
TEMPLATE = (
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Reasoning: medium\n\n# Valid channels: analysis, commentary, final.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'system' %}<|start|>developer<|message|># Instructions\n\n{{ m['content'] }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
# gpt-oss-20b's config.json: what SGLang 0.5.16 reads that transformers' GptOssConfig leaves out
REAL = {"swiglu_limit": 7.0, "experts_per_token": 2, "initial_context_length": 4096, "rope_theta": 150000}
MODELS = {"tiny-gpt-oss": {}}


def config(vocab: int, ids: dict):
    import transformers

    yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 4096}  # fmt: skip
    return transformers.GptOssConfig(
        vocab_size=vocab, max_position_embeddings=131072, tie_word_embeddings=False, hidden_size=64,
        intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=16, swiglu_limit=7.0, rope_parameters=yarn,
        **ids,
    )  # fmt: skip
