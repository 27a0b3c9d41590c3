"""builtin:tiny-llama-4: Llama-4's checkpoint layout (Llama-4-Scout/Maverick), scaled down: the multimodal
wrapper Llama4ForConditionalGeneration with its text model under `language_model.` (MoE with a shared
expert in every layer, fused experts as the checkpoint stores them, chunked attention, no-rope layers,
q/k norm) and a small vision tower; requests are text-only. Llama-4's header template."""

from .common import BYTES

ARCH = "Llama4ForConditionalGeneration"
SPECIALS = ["<|begin_of_text|>", "<|eot|>", "<|finetune_right_pad|>", "<|header_start|>", "<|header_end|>",
            "<|end_of_text|>", "<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>"]  # fmt: skip
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n"
    "{{ m['content'] | trim }}<|eot|>{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)
# The real chunk: SGLang's triton attention attends past it (only fa3 and trtllm chunk), so a shorter
# one here would measure SGLang's attention, not the capture.
REAL = {"rope_theta": 500000.0, "attention_chunk_size": 8192}
MODELS = {"tiny-llama-4": {}}


def special(token: str) -> int:
    return BYTES + SPECIALS.index(token)


def config(vocab: int, ids: dict):
    import transformers

    text = transformers.Llama4TextConfig(
        vocab_size=vocab, max_position_embeddings=8192, hidden_size=64, intermediate_size=64,
        intermediate_size_mlp=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=1, attention_chunk_size=8192,
        no_rope_layer_interval=4, use_qk_norm=True, **ids,
    )  # fmt: skip
    vision = transformers.Llama4VisionConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, image_size=56,
        patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64,
    )  # fmt: skip
    return transformers.Llama4Config(
        text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False,
        boi_token_index=special("<|image_start|>"), eoi_token_index=special("<|image_end|>"),
        image_token_index=special("<|image|>"), architectures=[ARCH],
    )  # fmt: skip
