"""Built-in models made locally with deterministic random weights: nothing is downloaded.

One module per architecture, the same shape in each (common.py says what it holds). `builtin:tiny-llama`
is the embedded default's target (seconds on a CPU); the others have the checkpoint layout, config keys
and chat template of the targets people train EAGLE-3 drafts for, scaled down, so the HF backend runs
them on a CPU and SGLang and HF load the very same safetensors on a GPU.

    python -m recipe model.path=builtin:tiny-gpt-oss
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelDirError
from . import (  # noqa: I001
    common,
    deepseek_v3,
    deepseek_v32,
    gemma3,
    gemma4,
    glm4_moe,
    glm5,
    gpt_oss,
    kimi_k25,
    llama,
    llama4,
    minimax_m2,
    mistral,
    phi3,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
    qwen3_vl,
)

log = logging.getLogger(__name__)

FAMILIES = (llama, qwen3, deepseek_v3, kimi_k25, qwen2, gpt_oss, glm4_moe, minimax_m2, llama4, gemma3, qwen3_next,
            mistral, qwen3_moe, qwen3_5, qwen3_5_moe, gemma4, deepseek_v32, glm5, phi3, qwen3_vl)  # fmt: skip
BUILTIN = {name: (family, variant) for family in FAMILIES for name, variant in family.MODELS.items()}
VOCAB = common.vocab_size(llama.SPECIALS)  # the default tokenizer's (tiny-llama, tiny-deepseek-v3)
CACHE_VERSION = "v6"  # v2: norm weights != 1; v3: per-expert names; v4: one module per family, zero vectors drawn;
# v5: one rope theta per checkpoint, Llama-4's real chunk; v6: multimodal wrappers' processor files,
# Qwen3-MoE's head_dim 64


def cache_dir() -> Path:
    return Path(os.environ.get("RECIPE_CACHE", Path.home() / ".cache" / "hs-recipe"))


def make_tokenizer(template: str = "chatml"):
    """The default byte tokenizer (tiny-llama's), with ChatML or Llama-3's template."""
    return common.tokenizer(llama.SPECIALS, llama.TEMPLATES[template])


def make_model(name: str, seed: int = 0):
    """A built-in model's transformers module, not saved (Kimi's: its DeepSeek-V3 language model)."""
    family, variant = BUILTIN[name]
    if family is kimi_k25:
        family, variant = deepseek_v3, {}
    return common.model(family, seed, **variant)


def materialize(name: str, dest: Path | None = None) -> Path:
    """Build model + tokenizer into dest (default: the cache) once; atomic, so a crash leaves nothing."""
    if name not in BUILTIN:
        raise ModelDirError(f"unknown built-in model {name!r}; have {sorted(BUILTIN)}")
    dest = Path(dest) if dest else cache_dir() / f"{name}-{CACHE_VERSION}"
    if (dest / "config.json").exists() and intact(dest):
        return dest
    if dest.exists():  # a cache cut short (disk full, a copy interrupted) or edited: built again
        log.warning("the built-in model cache %s is damaged; building it again", dest)
        shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        family, variant = BUILTIN[name]
        getattr(family, "build", lambda d, **v: common.build(family, d, **v))(tmp, **variant)
        (tmp / "recipe_builtin.json").write_text(json.dumps({"name": name, "seed": 0}))
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race: theirs is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def intact(dest: Path) -> bool:
    """A cached built-in model as materialize left it: its marker, config and readable weights."""
    from safetensors import safe_open

    try:
        json.loads((dest / "config.json").read_text())
        json.loads((dest / "recipe_builtin.json").read_text())
        weights = list(dest.glob("*.safetensors"))
        for w in weights:
            with safe_open(w, "pt") as f:
                for k in f.keys():
                    f.get_slice(k)
        return bool(weights) and all(w.stat().st_size > 0 for w in weights)
    except Exception:  # whatever cannot be read back: the cache is rebuilt, not trusted
        return False


def resolve_model_path(path: str) -> Path:
    if path.startswith("builtin:"):
        return materialize(path.split(":", 1)[1])
    p = Path(path).expanduser()
    if not (p / "config.json").exists():
        raise ModelDirError(
            f"model.path={path!r} is not a local model directory (no config.json); "
            "the recipe never downloads weights: mount them and point model.path there"
        )
    return p
