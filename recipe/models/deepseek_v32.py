"""builtin:tiny-deepseek-v3.2: DeepSeek-V3.2's layout (MLA with the lightning indexer of its sparse
attention, then DeepSeek-V3's MoE), scaled down; DeepSeek's <｜User｜>/<｜Assistant｜> template in its
non-thinking form. Prompts shorter than index_topk attend to every earlier token, as dense MLA does."""

ARCH = "DeepseekV32ForCausalLM"
SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>",
            "<think>", "</think>"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% else %}<｜Assistant｜></think>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}"
)
MODELS = {"tiny-deepseek-v3.2": {}}


def config(vocab: int, ids: dict):
    import transformers

    return transformers.DeepseekV32Config(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=False, hidden_size=256,
        intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=8, num_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, kv_lora_rank=512, q_lora_rank=256, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, index_topk=2048, index_head_dim=128, index_n_heads=4,
        # keys real DeepSeek-V3.2 config.json files carry and SGLang reads
        moe_layer_freq=1, topk_method="noaux_tc", scoring_func="sigmoid", ep_size=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, **ids,
    )  # fmt: skip
