"""`builtin:tiny-kimi-k2.5`: Kimi-K2.5's checkpoint layout, scaled down, built locally.

What the real repository has and this copies in small (public model card; SGLang 0.5.16's
`configs/kimi_k25.py`, `models/kimi_k25.py`, `multimodal/processors/kimi_k25.py`):
- config.json: `KimiK25ForConditionalGeneration`, `model_type: kimi_k25`, the DeepSeek-V3 language
  model under `text_config`, a MoonViT `vision_config` (both the canonical keys MoonViT reads and the
  `vt_*` keys SGLang's projector reads, as the published config carries);
- weights: the language model under `language_model.`, the vision tower under `vision_tower.` and the
  projector under `mm_projector.` with the checkpoint's own names (`wqkv`, `wo`, `proj.0`, `proj.2`);
- a tokenizer that loads only through remote code (`auto_map` to `tokenization_kimi.py`, a slow
  Python class as Kimi's tiktoken one is) and a processor SGLang loads at start-up;
- a chat template built like Kimi's: `<|im_user|>user<|im_middle|>…<|im_end|>`, a default system
  turn, thinking mode (`<think>` opens the answer) and instant mode (`thinking=false`: an empty
  `<think></think>`), and earlier turns' reasoning dropped once a later user turn follows.
`builtin:tiny-kimi-k2.5-int4` is the same model with its routed experts in INT4 as the real
checkpoint ships them (recipe/int4.py: compressed-tensors `pack-quantized`, group 32, the
`quantization_config` under `text_config`). Not copied: the image pipeline.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

ASSETS = Path(__file__).parent.parent / "assets" / "kimi"
MODELS = {"tiny-kimi-k2.5": {"int4": False}, "tiny-kimi-k2.5-int4": {"int4": True}}


def build(dest: Path, int4: bool = False, seed: int = 0) -> None:
    """Its own build: the DeepSeek-V3 language model (deepseek_v3.py) inside Kimi-K2.5's layout."""
    from . import common, deepseek_v3

    write_tiny_kimi(dest, common.model(deepseek_v3, seed), int4=int4)


KIMI_TEMPLATE = (
    "{%- set thinking = thinking if thinking is defined else true -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if messages[0]['role'] != 'system' -%}"
    "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if loop.index0 > ns.last_user and thinking -%}<think>{{ m.get('reasoning_content', '') }}</think>"
    "{%- else -%}<think></think>{%- endif -%}"
    "{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking -%}<think>{%- else -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)

VISION = {  # MoonViT, scaled down; keys as in the published config (canonical + vt_* aliases)
    "model_type": "kimi_k25",
    "patch_size": 14,
    "init_pos_emb_height": 4,
    "init_pos_emb_width": 4,
    "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 2,
    "vt_hidden_size": 64,
    "vt_intermediate_size": 128,
    "merge_kernel_size": [2, 2],
    "video_attn_type": "spatial_temporal",
    "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmerger",
    "mm_hidden_size": 64,
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
}
MEDIA = {  # what SGLang's Kimi processor reads from preprocessor_config.json at start-up
    "patch_size": 14,
    "merge_kernel_size": 2,
    "in_patch_limit": 1024,
    "patch_limit_on_one_side": 64,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}


def vision_weights(text_hidden: int, seed: int = 1) -> dict:
    """The vision tower and projector under the checkpoint's names, random at init scale."""
    import torch

    g = torch.Generator().manual_seed(seed)
    v, p = VISION, VISION["patch_size"]
    h, m = v["hidden_size"], v["intermediate_size"]
    merged = h * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n):
        return torch.ones(n, dtype=torch.bfloat16)

    out = {
        "vision_tower.patch_embed.proj.weight": w(h, 3, p, p),
        "vision_tower.patch_embed.proj.bias": w(h),
        "vision_tower.patch_embed.pos_emb.weight": w(v["init_pos_emb_height"], v["init_pos_emb_width"], h),
        "vision_tower.encoder.final_layernorm.weight": ones(h),
        "vision_tower.encoder.final_layernorm.bias": w(h),
        "mm_projector.pre_norm.weight": ones(h),
        "mm_projector.pre_norm.bias": w(h),
        "mm_projector.proj.0.weight": w(merged, merged),
        "mm_projector.proj.0.bias": w(merged),
        "mm_projector.proj.2.weight": w(text_hidden, merged),
        "mm_projector.proj.2.bias": w(text_hidden),
    }
    for i in range(v["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        out.update(
            {
                b + "norm0.weight": ones(h),
                b + "norm0.bias": w(h),
                b + "norm1.weight": ones(h),
                b + "norm1.bias": w(h),
                b + "wqkv.weight": w(3 * h, h),
                b + "wqkv.bias": w(3 * h),
                b + "wo.weight": w(h, h),
                b + "wo.bias": w(h),
                b + "mlp.fc0.weight": w(m, h),
                b + "mlp.fc0.bias": w(m),
                b + "mlp.fc1.weight": w(h, m),
                b + "mlp.fc1.bias": w(h),
            }
        )
    return out


def write_tiny_kimi(dest: Path, language_model, int4: bool = False) -> None:
    """A DeepseekV3ForCausalLM (deepseek_v3.py) -> the Kimi-K2.5 layout in dest (int4: its experts too)."""
    from safetensors.torch import save_file

    dest = Path(dest)
    for f in ("tokenization_kimi.py", "processing_kimi_k25.py"):
        shutil.copy(ASSETS / f, dest / f)
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "TikTokenTokenizer",
                "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
                "chat_template": KIMI_TEMPLATE,
                "model_max_length": 8192,
            },
            indent=2,
        )
    )
    (dest / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "KimiK25Processor",
                "auto_map": {"AutoProcessor": "processing_kimi_k25.KimiK25Processor"},
                "media_proc_cfg": MEDIA,
            },
            indent=2,
        )
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(dest, trust_remote_code=True)
    text = language_model.config.to_dict()
    text.update(
        vocab_size=language_model.config.vocab_size,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    text["architectures"] = ["DeepseekV3ForCausalLM"]  # SGLang reads it off text_config, as in the real one
    language = {"language_model." + k: t for k, t in checkpoint_tensors(language_model).items()}
    if int4:
        from ..int4 import QUANTIZATION_CONFIG, quantize

        text["quantization_config"] = QUANTIZATION_CONFIG
        language = quantize(language)
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {**VISION, "text_hidden_size": text["hidden_size"]},
        "media_placeholder_token_id": tok.convert_tokens_to_ids("<|media_pad|>"),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    weights = {**language, **vision_weights(text["hidden_size"])}
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})


def checkpoint_tensors(model) -> dict:
    """The model's tensors under its checkpoint names. Not `state_dict()`: transformers 5 holds MoE
    experts fused (`mlp.experts.gate_up_proj`), while checkpoints, the real Kimi-K2.5 included, name
    each expert (`mlp.experts.0.gate_proj.weight`). SGLang does not load the fused names, and a tiny
    checkpoint with them served an MoE without its experts; save_pretrained writes checkpoint names."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tensors = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            tensors.update(load_file(f))
    return tensors
