"""Built-in models made locally with deterministic random weights: nothing is downloaded.

`builtin:tiny-llama` is the embedded default's target (runs in seconds on a CPU). The GPU proof
builds larger ones (`tiny-llama-256`, `tiny-deepseek-v3`) the same way, on the GPU machine, so
SGLang and HF load the very same safetensors.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .errors import ModelDirError

log = logging.getLogger(__name__)

# A byte-level tokenizer: every UTF-8 byte is a token, plus the chat markers of two template
# families. Tiny, needs no training, and tokenizes any text.
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<pad>",
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3}
VOCAB = 272  # 256 bytes + 8 specials, rounded up

SPECS = {
    "tiny-llama": dict(
        arch="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "tiny-llama-256": dict(
        arch="llama",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # MLA + MoE as in DeepSeek-V3 / Kimi-K2.5, scaled down (shapes seen served by SGLang 0.5.16)
    "tiny-deepseek-v3": dict(
        arch="deepseek_v3",
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        first_k_dense_replace=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        kv_lora_rank=512,
        q_lora_rank=256,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        # keys real DeepSeek-V3 config.json files carry and SGLang reads
        moe_layer_freq=1,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        ep_size=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    # Kimi-K2.5's layout (recipe/tiny_kimi.py): the DeepSeek-V3 language model above under text_config,
    # a small MoonViT vision tower, a remote-code tokenizer and a thinking/instant chat template
    "tiny-kimi-k2.5": dict(arch="kimi_k25", text="tiny-deepseek-v3"),
    # the same with its routed experts in INT4, packed as the real checkpoint's (recipe/int4.py)
    "tiny-kimi-k2.5-int4": dict(arch="kimi_k25", text="tiny-deepseek-v3", int4=True),
}


def cache_dir() -> Path:
    return Path(os.environ.get("RECIPE_CACHE", Path.home() / ".cache" / "hs-recipe"))


def make_tokenizer(template: str = "chatml"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|endoftext|>", pad_token="<pad>"
    )
    fast.add_special_tokens(
        {"additional_special_tokens": [s for s in SPECIALS if s not in ("<|begin_of_text|>", "<|endoftext|>", "<pad>")]}
    )
    fast.chat_template = TEMPLATES[template]
    return fast


def make_model(name: str, seed: int = 0):
    import torch
    import transformers

    spec = dict(SPECS[name])
    arch = spec.pop("arch")
    tok = make_tokenizer()
    common = dict(
        vocab_size=VOCAB,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, **spec)
    else:
        cfg = transformers.DeepseekV3Config(**common, **spec, rope_scaling=None)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    # Trained models' RMSNorm weights are far from HF's init of 1. Ones hide every bug that applies
    # a norm twice or to the wrong state (it did: a speculators export), so draw them in [0.25, 2.5].
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.25, 2.5)
    return model


def materialize(name: str, dest: Path | None = None, template: str = "chatml") -> Path:
    """Build model + tokenizer into dest (default: the cache) once; atomic, so a crash leaves nothing."""
    if name not in SPECS:
        raise ModelDirError(f"unknown built-in model {name!r}; have {sorted(SPECS)}")
    dest = Path(dest) if dest else cache_dir() / f"{name}-v3"  # v2: norm weights != 1; v3: per-expert names
    if (dest / "config.json").exists() and intact(dest):
        return dest
    if dest.exists():  # a cache cut short (disk full, a copy interrupted) or edited: built again
        log.warning("the built-in model cache %s is damaged; building it again", dest)
        shutil.rmtree(dest, ignore_errors=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=dest.parent))
    try:
        if SPECS[name]["arch"] == "kimi_k25":
            from .tiny_kimi import write_tiny_kimi

            write_tiny_kimi(tmp, make_model(SPECS[name]["text"]), int4=SPECS[name].get("int4", False))
        else:
            make_model(name).save_pretrained(tmp, safe_serialization=True)
            make_tokenizer(template).save_pretrained(tmp)
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
