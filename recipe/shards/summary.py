"""What a newcomer reads of a set: `inspect SET` (a short summary and the first samples) and `show SET ID`
(one sample: its text with the loss-masked tokens marked, each slot's shape and norm)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import UserError
from .codec import CorruptRecord
from .reader import ShardReader
from .store import summarize
from .tokencounts import read_tokens

FIRST = 5  # samples listed by inspect
WORDS = 8  # first words of each
OPEN, CLOSE = "[[", "]]"  # around the tokens the draft trains on (the loss mask)


def tokenizer_of(reader: ShardReader):
    """The target's tokenizer from the manifest's model path, or None where it is not on this machine."""
    model = reader.manifest.get("model")
    path = Path(str((model if isinstance(model, dict) else {}).get("path") or ""))
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):  # remote code, or files that do not load: ids are shown instead
        return None


def text_of(tok, ids: np.ndarray, mask: np.ndarray | None = None) -> str:
    """The sample's text (its ids where no tokenizer is here), loss-masked runs between OPEN and CLOSE."""
    if mask is None:
        mask = np.zeros(len(ids), np.uint8)
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or mask[i] != mask[start]:
            piece = tok.decode(ids[start:i].tolist()) if tok is not None else " ".join(map(str, ids[start:i]))
            out.append(f"{OPEN}{piece}{CLOSE}" if mask[start] else piece)
            start = i
    return "".join(out)


def inspect_text(root: Path) -> str:
    r = ShardReader(root)
    m, t = r.manifest, summarize(r.records)["totals"]
    model = m.get("model") if isinstance(m.get("model"), dict) else {}
    ratio = f"{t['raw_bytes'] / t['stored_bytes']:.2f}x" if t["stored_bytes"] else "-"
    c = m.get("counts") or {}
    lines = [
        f"set      {root}",
        f"model    {model.get('name')} ({model.get('num_layers')} layers, hidden {model.get('hidden_size')})",
        f"slots    {', '.join(r.slots)}  ({m['capture'].get('convention', '').split(':')[0]})",
        f"codec    {(m.get('codec') or {}).get('name', 'lossless')}",
        f"samples  {len(r)} ({sum(x.get('loss_tokens', 0) for x in r.records)} loss-masked of {t['tokens']} tokens)",
        f"bytes    {t['stored_bytes'] / 1e9:.3f} GB stored, {t['raw_bytes'] / 1e9:.3f} GB raw ({ratio})",
        f"counts   ok {c.get('ok')}, skipped {c.get('skipped')}, failed {c.get('failed')}",
        "",
        f"first {min(FIRST, len(r))} samples (python -m recipe.shards show {root} ID):",
    ]
    tok = tokenizer_of(r)
    for rec in r.records[:FIRST]:
        lines.append(f"  {rec['id']}  {rec['tokens']:6d} tokens  {first_words(r.root, rec, tok)}")
    return "\n".join(lines)


def first_words(root: Path, rec: dict, tok) -> str:
    """A listed sample's first words, from its record's first bytes (not its hidden states); a summary
    still prints where the record is damaged or its shard gone, and names the command that says why."""
    try:
        ids, _ = read_tokens(root, rec)
    except (CorruptRecord, OSError):
        return f"(unreadable: python -m recipe.shards verify {root})"
    return repr(" ".join(text_of(tok, ids[:64]).split()[:WORDS]))


def show_text(root: Path, sample_id: str) -> str:
    r = ShardReader(root)
    if sample_id not in r.by_id:
        raise UserError(f"{root} holds no sample {sample_id!r} (`python -m recipe.shards inspect {root}` lists some)")
    _, arrs = r.get_numpy(sample_id)
    ids, mask, hidden = arrs["input_ids"], arrs["loss_mask"], arrs["hidden"]
    h = hidden.astype(np.float32) if hidden.dtype != np.uint16 else _bf16(hidden)
    lines = [f"sample {sample_id}: {len(ids)} tokens, {int(mask.sum())} loss-masked (between {OPEN} {CLOSE})"]
    for k, name in enumerate(r.slots):
        norms = np.linalg.norm(h[:, k], axis=-1)
        lines.append(f"  {name:18s} [{h.shape[0]}, {h.shape[2]}]  norm per token: mean {norms.mean():.3f}, "
                     f"max {norms.max():.3f}")  # fmt: skip
    lines += ["", text_of(tokenizer_of(r), ids, mask)]
    return "\n".join(lines)


def _bf16(words: np.ndarray) -> np.ndarray:
    """bf16 stored as uint16 words, widened to float32."""
    return (words.astype(np.uint32) << 16).view(np.float32)
