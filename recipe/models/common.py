"""What every built-in model shares: a byte-level tokenizer with a family's chat markers, random weights
at init scale with norms far from 1, and the save that writes a checkpoint as the real one is laid out.

A family module (one per architecture, the same shape in each) names its `ARCH`, chat `TEMPLATE`,
`SPECIALS` (bos, eos, pad first), the `REAL` keys its published config.json carries that transformers'
config class leaves out, and `config(vocab, tok, **variant)`; `build(family, dest)` does the rest.
"""

from __future__ import annotations

import json
from pathlib import Path

BYTES = 256  # every UTF-8 byte is a token: tiny, needs no training, tokenizes any text


def tokenizer(specials: list[str], template: str, named: dict | None = None):
    """Byte-level BPE with no merges plus the family's markers (specials[:3] = bos, eos, pad); `named`
    gives markers the attribute names a processor reads (Gemma-4's `image_token`, `boi_token`, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={byte_chars[b]: b for b in range(BYTES)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)  # ids BYTES + index, in the family's order, before any is named
    return fast_tokenizer(tok, specials, template, named)


def fast_tokenizer(tok, specials: list[str], template: str, named: dict | None = None):
    """A trained `tokenizers` object as transformers loads it: specials[:3] = bos, eos, pad, the other
    markers special too, and the chat template."""
    from transformers import PreTrainedTokenizerFast

    bos, eos, pad = specials[:3]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=pad,
                                   extra_special_tokens=named or {})  # fmt: skip
    fast.add_special_tokens({"additional_special_tokens": [s for s in specials if s not in (bos, eos, pad)]})
    fast.chat_template = template
    return fast


def family_tokenizer(family):
    """A family module's tokenizer: its markers, template and named markers."""
    return tokenizer(family.SPECIALS, family.TEMPLATE, getattr(family, "NAMED", None))


def vocab_size(specials: list[str]) -> int:
    return padded(BYTES + len(specials))


def padded(n: int) -> int:
    return -(-n // 16) * 16  # rounded up, as real vocabularies are padded


def token_ids(tok) -> dict:
    return {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}


def randomize(model, seed: int = 0) -> None:
    """Init-scale weights as transformers draws them, then what init leaves at a constant made random:
    RMSNorm scales in [0.25, 2.5] (ones hide any bug that applies a norm twice or to the wrong state:
    one did, in a speculators export), zero-centered norms ((1 + w): Gemma, Qwen3-Next) the same
    effective range, and zero vectors (router biases, attention sinks, score corrections) small noise,
    so that a loader that drops one of them is seen."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, t in model.named_parameters():  # the global generator, right after init, as before
            if name.endswith("norm.weight") and t.ndim == 1:
                offset = 1.0 if torch.all(t == 0) else 0.0  # (1 + w) norms start at zero
                t.uniform_(0.25, 2.5).sub_(offset)
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_floating_point() and t.ndim == 1 and torch.all(t == 0) and "inv_freq" not in name:
                t.copy_(torch.randn(t.shape, generator=g) * 0.02)


def save_processor(family, dest: Path) -> None:
    """A multimodal wrapper's processor files, as its real checkpoint ships them: SGLang loads the processor
    of a multimodal class at start-up, also for a server sent token ids alone, and dies without them."""
    for name, content in getattr(family, "PROCESSOR", {}).items():
        (Path(dest) / name).write_text(json.dumps(content, indent=2))


def save(model, tok, dest: Path, real: dict | None = None) -> None:
    """Weights under their checkpoint names (save_pretrained writes per-expert names where the real
    checkpoint has them), the tokenizer, and config.json completed with the published keys."""
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    if real:
        path = Path(dest) / "config.json"
        cfg = json.loads(path.read_text())
        inner = cfg.setdefault("text_config", {}) if "text_config" in cfg else cfg
        inner.update({k: v for k, v in real.items() if k not in inner or inner[k] is None})
        # transformers 5 keeps rope values under rope_parameters, SGLang 0.5.16 reads the top-level
        # keys: a checkpoint that says two thetas is served with one and checked against the other.
        rope = inner.get("rope_parameters") or {}
        rope.update({k: real[k] for k in ("rope_theta", "partial_rotary_factor") if k in real and k in rope})
        path.write_text(json.dumps(cfg, indent=2))


def model(family, seed: int = 0, **variant):
    """A family's transformers module at init scale, randomized as `randomize` says."""
    import torch
    import transformers

    tok = family_tokenizer(family)
    cfg = family.config(vocab_size(family.SPECIALS), token_ids(tok), **variant)
    torch.manual_seed(seed)
    m = getattr(transformers, family.ARCH)._from_config(cfg, dtype=torch.bfloat16)
    randomize(m, seed)
    return m


def build(family, dest: Path, seed: int = 0, **variant) -> None:
    """A family's tiny model into dest: tokenizer, random weights, config.json with the real keys."""
    tok = family_tokenizer(family)
    save(model(family, seed, **variant), tok, dest, getattr(family, "REAL", None))
    save_processor(family, dest)
