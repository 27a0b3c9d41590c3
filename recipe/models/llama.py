"""builtin:tiny-llama (the embedded default's target) and tiny-llama-256: Llama's layout, scaled down.

The byte tokenizer carries the markers of two template families: ChatML (the default here) and
Llama-3's (the draft benchmark's target); DeepSeek-V3's tiny model shares it.
"""

ARCH = "LlamaForCausalLM"
SPECIALS = ["<|begin_of_text|>", "<|endoftext|>", "<pad>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATE = CHATML
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
SIZES = {
    "tiny-llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4),
    "tiny-llama-256": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6),
}
MODELS = {name: {"size": name} for name in SIZES}


def config(vocab: int, ids: dict, size: str = "tiny-llama"):
    import transformers

    return transformers.LlamaConfig(vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False,
                                    num_attention_heads=4, num_key_value_heads=2, **SIZES[size], **ids)  # fmt: skip
