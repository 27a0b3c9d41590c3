"""builtin:tiny-qwen3.5-moe: Qwen3.5's MoE layout (Qwen3.5-35B-A3B, Qwen3.5-397B-A17B), scaled down: the
multimodal wrapper Qwen3_5MoeForConditionalGeneration around tiny-qwen3.5's hybrid text model, with a
routed MoE and a gated shared expert in every layer. ChatML."""

from .qwen3_5 import PROCESSOR, REAL, SPECIALS, TEMPLATE, TEXT, wrapper  # noqa: F401  (the dense model's, but the MLP)

ARCH = "Qwen3_5MoeForConditionalGeneration"
MODELS = {"tiny-qwen3.5-moe": {}}


def config(vocab: int, ids: dict):
    import transformers

    text = transformers.Qwen3_5MoeTextConfig(vocab_size=vocab, moe_intermediate_size=32,
                                             shared_expert_intermediate_size=32, num_experts=4,
                                             num_experts_per_tok=2, **TEXT, **ids)  # fmt: skip
    cfg = wrapper(transformers.Qwen3_5MoeConfig, text.to_dict(), transformers.Qwen3_5MoeVisionConfig)
    cfg.architectures = [ARCH]
    return cfg
