"""builtin:tiny-minimax-m2: MiniMax-M2's layout, scaled down: q/k RMSNorm over all heads, partial rotary,
sigmoid routing with a routing bias, experts named w1/w2/w3, and MiniMax's ]~b] template."""

ARCH = "MiniMaxM2ForCausalLM"
SPECIALS = ["]~!b[", "[e~[", "<pad>", "]~b]", "<think>", "</think>"]
TEMPLATE = (
    "]~!b[]~b]system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}You are a helpful assistant.{% endif %}[e~[\n"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}]~b]ai\n{{ m['content'] }}[e~[\n"
    "{% elif m['role'] != 'system' %}]~b]{{ m['role'] }}\n{{ m['content'] }}[e~[\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}]~b]ai\n{% endif %}"
)
HEAD_DIM = 16
# MiniMax-M2's config.json: what SGLang 0.5.16 reads that transformers' MiniMaxM2Config leaves out
REAL = {"scoring_func": "sigmoid", "use_routing_bias": True, "rotary_dim": HEAD_DIM // 2, "use_qk_norm": True,
        "qk_norm_type": "per_layer", "partial_rotary_factor": 0.5, "rope_theta": 5000000}  # fmt: skip
MODELS = {"tiny-minimax-m2": {}}


def config(vocab: int, ids: dict):
    import transformers

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}
    return transformers.MiniMaxM2Config(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, hidden_size=64,
        intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM,
        num_local_experts=4, num_experts_per_tok=2, rope_parameters=rope, **ids,
    )  # fmt: skip
