"""Which checkpoint architectures the patched SGLang dumps: decided from config.json before any GPU work.

SGLang picks a model class by `architectures[0]` of the checkpoint's config.json. Only a class whose
forward pass runs one of the patched forwards (patches/sglang/v0.5.16) ever writes a dump; any other
would load, answer every request and write nothing, a whole run's GPU time spent for failed samples.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..errors import UserError

log = logging.getLogger(__name__)

# Entry classes of SGLang 0.5.16 that run a patched `__init__` and `forward`: the four patched
# classes and their subclasses that keep both (tests/test_architectures.py derives the same set from the
# pinned wheel's source, drafts left out), and Kimi-K2.5's wrapper, which serves a
# DeepseekV3ForCausalLM as its language model.
DUMPED = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "IQuestCoderForCausalLM",
        "InternLM3ForCausalLM",
        "Llama4ForCausalLM",
        "LlamaForCausalLM",
        "Ministral3ForCausalLM",
        "MistralForCausalLM",
        "MistralLarge3ForCausalLM",
        "Phi3ForCausalLM",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "TeleFLMForCausalLM",
    }
)
WRAPPERS = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}
# the ones whose dumps were compared with HF layer by layer on an H200 (docs/gpu-results/)
PROVEN = frozenset({"LlamaForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"})


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
    if name not in DUMPED and name not in WRAPPERS:
        raise UnsupportedArchitecture(
            f"{name} is not dumped by the patched SGLang 0.5.16 (it runs none of the patched model files); "
            f"backend=sglang dumps {', '.join(sorted(DUMPED | set(WRAPPERS)))}; backend=hf runs any architecture"
        )
    if name not in PROVEN:
        log.warning(
            "%s runs the patched SGLang code but its dumps have not been compared with HF on a GPU; "
            "a request that leaves no dump still counts as a failed sample (no_dump)",
            name,
        )
    return name
