"""Which checkpoint architectures the patched SGLang dumps: decided from config.json before any GPU work.

SGLang picks a model class by `architectures[0]` of the checkpoint's config.json. The seam (seam.py)
switches capture on through the class's own `set_eagle3_layers_to_capture`, so a class without one
would load, answer every request and dump only its final state, or nothing: a whole run's GPU time
spent for failed samples. Such a class is refused here, in one line that names it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import UserError

log = logging.getLogger(__name__)

# The entry classes of SGLang 0.5.16 that define or inherit `set_eagle3_layers_to_capture`, its drafts
# (Eagle, NextN, MTP, Assistant) and MindSpore's (Ascend NPUs) left out. tests/test_architectures.py
# derives the same set from the pinned wheel's source; tests/test_seam.py runs each class's own switch.
DUMPED = frozenset(
    {
        "ApertusForCausalLM",
        "BailingMoEForCausalLM",
        "BailingMoeForCausalLM",
        "BailingMoeV2ForCausalLM",
        "DeepseekV2ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "ExaoneMoEForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Gemma4ForCausalLM",
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM",
        "IQuestCoderForCausalLM",
        "InternLM3ForCausalLM",
        "InternS1ProForConditionalGeneration",
        "InternS2PreviewForConditionalGeneration",
        "KimiK25ForConditionalGeneration",
        "Llama4ForCausalLM",
        "Llama4ForConditionalGeneration",
        "LlamaForCausalLM",
        "LongcatFlashForCausalLM",
        "MellumForCausalLM",
        "MiniMaxM2ForCausalLM",
        "MiniMaxM3SparseForCausalLM",
        "Ministral3ForCausalLM",
        "MistralForCausalLM",
        "MistralLarge3ForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM",
        "Qwen2_5_VLForConditionalGeneration",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "SarvamMoEForCausalLM",
        "TeleFLMForCausalLM",
    }
)
# Classes whose dumps through the one seam were compared with HF layer by layer on a GPU: the families
# scenario (tests/gpu/families.py) on one H200, docs/gpu-results/2026-12-05-families, and on one H100,
# docs/gpu-results/2026-12-06-families-new and (Gemma-4) 2026-12-06-gemma4-and-prefill-only.
PROVEN: frozenset[str] = frozenset(
    {
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "Gemma3ForCausalLM",
        "Glm4MoeForCausalLM",
        "GlmMoeDsaForCausalLM",
        "Gemma4ForConditionalGeneration",
        "GptOssForCausalLM",
        "KimiK25ForConditionalGeneration",
        "Llama4ForConditionalGeneration",
        "LlamaForCausalLM",
        "MiniMaxM2ForCausalLM",
        "MistralForCausalLM",
        "Phi3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3VLForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
    }
)


class UnsupportedArchitecture(UserError, ValueError):
    pass


def architecture(model_dir: Path) -> str | None:
    """`architectures[0]` of the checkpoint's config.json, or None when it names none."""
    names = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or []
    return str(names[0]) if names else None


def refuse_undumped(model_dir: Path) -> str:
    """The architecture SGLang will serve, if the patched server dumps it; a one-line refusal if not."""
    name = architecture(model_dir)
    if name is None:
        raise UnsupportedArchitecture(
            f"{model_dir}/config.json names no architectures: SGLang cannot pick a model class for it"
        )
    if name not in DUMPED:
        raise UnsupportedArchitecture(
            f"{name} is not dumped by the patched SGLang 0.5.16 (it has no set_eagle3_layers_to_capture); "
            f"backend=sglang dumps {', '.join(sorted(DUMPED))}; backend=hf runs any architecture"
        )
    if name not in PROVEN:
        log.warning(
            "%s: its dumps through the patched SGLang have not been compared with HF on a GPU; the run's "
            "self-check compares the final slot with the server's own logprobs (client.self_check)",
            name,
        )
    return name
