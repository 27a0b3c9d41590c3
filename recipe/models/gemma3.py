"""builtin:tiny-gemma-3: Gemma-3's text layout (gemma-3-1b's Gemma3ForCausalLM), scaled down: (1 + w)
RMSNorms before and after attention and MLP, q/k norms, sliding-window layers with one global layer,
two rope bases, a tied embedding scaled by sqrt(hidden), and Gemma's turn template (system folded into
the first user turn, the assistant called `model`)."""

ARCH = "Gemma3ForCausalLM"
SPECIALS = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set rest = messages[1:] %}{% else %}{% set first = '' %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ (first if loop.first else '') + m['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
REAL = {"sliding_window_pattern": 4, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0}
MODELS = {"tiny-gemma-3": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.Gemma3TextConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=16, query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 3 + ["full_attention"],
        architectures=[ARCH], **ids,
    )  # fmt: skip
