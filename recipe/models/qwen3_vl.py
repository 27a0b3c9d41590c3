"""builtin:tiny-qwen3-vl: Qwen3-VL's dense layout (Qwen3-VL-8B), scaled down: the multimodal wrapper
Qwen3VLForConditionalGeneration, its Qwen3 text model (q/k norm, GQA, interleaved multimodal rotary)
under `model.language_model.`, a vision tower with deepstack mergers under `model.visual.`; requests are
text-only. ChatML with Qwen's vision markers."""

from .qwen3_5 import PROCESSOR, SPECIALS, TEMPLATE, special  # noqa: F401  (Qwen's markers, template, processor)

ARCH = "Qwen3VLForConditionalGeneration"
REAL = {"rope_theta": 5000000}  # Qwen3-VL-8B's
MODELS = {"tiny-qwen3-vl": {}}


def config(vocab: int, ids: dict):
    import transformers

    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_interleaved": True, "mrope_section": [2, 3, 3]}
    text = transformers.Qwen3VLTextConfig(
        vocab_size=vocab, max_position_embeddings=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_parameters=rope, **ids,
    )  # fmt: skip
    vision = transformers.Qwen3VLVisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                                              out_hidden_size=64, num_position_embeddings=64,
                                              deepstack_visual_indexes=[0, 1])  # fmt: skip
    return transformers.Qwen3VLConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False, architectures=[ARCH],
        image_token_id=special("<|image_pad|>"), video_token_id=special("<|video_pad|>"),
        vision_start_token_id=special("<|vision_start|>"), vision_end_token_id=special("<|vision_end|>"),
    )  # fmt: skip
