"""builtin:tiny-qwen3.5: Qwen3.5's dense layout, scaled down: the multimodal wrapper
Qwen3_5ForConditionalGeneration (text model under `model.language_model.`, a vision tower under
`model.visual.`), whose text model is hybrid: three gated-DeltaNet (linear attention) layers, then one
gated full-attention layer with partial, interleaved multimodal rotary; requests are text-only. ChatML."""

from .common import BYTES

ARCH = "Qwen3_5ForConditionalGeneration"
SPECIALS = ["<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|im_start|>", "<think>", "</think>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]  # fmt: skip
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen3.5's config.json: SGLang 0.5.16 places full attention by full_attention_interval
REAL = {"full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25}
MODELS = {"tiny-qwen3.5": {}}
# Qwen3.5's and Qwen3-VL's processor files (16-pixel patches, 2x2 merge, 2 frames a patch): SGLang builds
# the processor at start-up for any multimodal class
VISION = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
          "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}  # fmt: skip
PROCESSOR = {
    "preprocessor_config.json": {**VISION, "image_processor_type": "Qwen2VLImageProcessor",
                                 "size": {"longest_edge": 16777216, "shortest_edge": 65536}},
    "video_preprocessor_config.json": {**VISION, "video_processor_type": "Qwen3VLVideoProcessor",
                                       "size": {"longest_edge": 25165824, "shortest_edge": 4096}},
}  # fmt: skip
# head_dim 32 x partial 0.25: 8 rotary dims, 4 frequencies over (t, h, w); text-only, all three agree
ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "mrope_interleaved": True,
        "mrope_section": [2, 1, 1]}  # fmt: skip
TEXT = dict(max_position_embeddings=8192, tie_word_embeddings=False, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, rope_parameters=ROPE,
            layer_types=["linear_attention"] * 3 + ["full_attention"])  # fmt: skip


def special(token: str) -> int:
    return BYTES + SPECIALS.index(token)


def wrapper(config_class, text: dict, vision_class):
    """The multimodal config around a text config: a one-block vision tower, the markers' ids."""
    vision = vision_class(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                          out_hidden_size=text["hidden_size"], num_position_embeddings=64)  # fmt: skip
    return config_class(
        text_config=text, vision_config=vision.to_dict(), tie_word_embeddings=False, architectures=[ARCH],
        image_token_id=special("<|image_pad|>"), video_token_id=special("<|video_pad|>"),
        vision_start_token_id=special("<|vision_start|>"), vision_end_token_id=special("<|vision_end|>"),
    )  # fmt: skip


def config(vocab: int, ids: dict):
    import transformers

    text = transformers.Qwen3_5TextConfig(vocab_size=vocab, intermediate_size=128, **TEXT, **ids)
    return wrapper(transformers.Qwen3_5Config, text.to_dict(), transformers.Qwen3_5VisionConfig)
