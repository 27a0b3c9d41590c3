"""builtin:tiny-gemma-4: Gemma-4's dense layout (Gemma-4-31B), scaled down: the multimodal wrapper
Gemma4ForConditionalGeneration (text model under `model.language_model.`, a vision tower beside it) whose
text model has (1 + w) RMSNorms around attention and MLP, q/k norms, sliding-window layers with one
global layer of wider heads, fewer kv heads and keys reused as values, proportional partial rotary on
the global layer, a tied embedding scaled by sqrt(hidden) and a soft-capped head. Requests are
text-only. Gemma-4's <|turn> template (the assistant called `model`)."""

from .common import BYTES

ARCH = "Gemma4ForConditionalGeneration"
SPECIALS = ["<bos>", "<eos>", "<pad>", "<|turn>", "<turn|>", "<|image>", "<image|>", "<|image|>", "<|video|>",
            "<|audio>", "<audio|>", "<|audio|>"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<|turn>{{ role }}\n{{ m['content'] | trim }}<turn|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|turn>model\n{% endif %}"
)
MODELS = {"tiny-gemma-4": {}}
# the markers Gemma4Processor reads by name, and its processor file (image, audio and video parts at their
# defaults): SGLang builds the processor at start-up for any multimodal class
NAMED = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>", "audio_token": "<|audio|>",
         "boa_token": "<|audio>", "eoa_token": "<audio|>"}  # fmt: skip
PROCESSOR = {
    "processor_config.json": {
        "processor_class": "Gemma4Processor", "image_seq_length": 280, "audio_seq_length": 750,
        "audio_ms_per_token": 40, "image_processor": {"image_processor_type": "Gemma4ImageProcessor"},
        "feature_extractor": {"feature_extractor_type": "Gemma4AudioFeatureExtractor"},
        "video_processor": {"video_processor_type": "Gemma4VideoProcessor"},
    }
}  # fmt: skip


def special(token: str) -> int:
    return BYTES + SPECIALS.index(token)


def config(vocab: int, ids: dict):
    """Head sizes 64 and 128 (the real 256 and 512, scaled down): sizes SGLang's fused rotary kernels take."""
    import transformers

    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }
    text = transformers.Gemma4TextConfig(
        vocab_size=vocab, max_position_embeddings=8192, tie_word_embeddings=True, hidden_size=64,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        global_head_dim=128, num_global_key_value_heads=1, attention_k_eq_v=True, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=vocab, sliding_window=16, final_logit_softcapping=30.0, rope_parameters=rope,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], **ids,
    )  # fmt: skip
    vision = transformers.Gemma4VisionConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=16)  # fmt: skip
    return transformers.Gemma4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), audio_config=None, architectures=[ARCH],
        boi_token_id=special("<|image>"), eoi_token_id=special("<image|>"), image_token_id=special("<|image|>"),
        video_token_id=special("<|video|>"), boa_token_id=special("<|audio>"), eoa_token_index=special("<audio|>"),
        audio_token_id=special("<|audio|>"),
    )  # fmt: skip
