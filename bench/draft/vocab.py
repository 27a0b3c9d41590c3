"""A reduced draft vocabulary (--draft-vocab): the mapping users get, `python -m recipe.shards vocab-map`
on the shards (the set's own token counts, in SpecForge's form), and the other-data control's, the same
rule on another corpus's counts: the host's prose (package metadata, READMEs, licences) where the target
writes code. Each mapping's coverage: the share of the set's loss-masked tokens its kept ids hold."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from .common import ROOT, log

PROSE_BYTES = 16 << 20


def prose() -> list[str]:
    """Text that is not Python: the installed packages' METADATA, *.md, *.rst and *.txt files."""
    paths = sysconfig.get_paths()
    out, total = [], 0
    for root in sorted({Path(paths["stdlib"]), Path(paths["purelib"])}):
        for pattern in ("METADATA", "*.md", "*.rst", "*.txt"):
            for p in sorted(root.rglob(pattern)):
                if total > PROSE_BYTES:
                    return out
                try:
                    text = p.read_text("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                out.append(text)
                total += len(text)
    return out


def set_counts(work: Path):
    from recipe.shards import tokencounts
    from recipe.shards.reader import ShardReader

    reader = ShardReader(work / "shards" / "real")
    return tokencounts.load(reader.root, reader.records)


def coverage(kept, counts) -> float:
    kept = [k for k in kept if k < counts.loss.size]
    return round(float(counts.loss[kept].sum() / max(1, counts.loss.sum())), 4)


def other_mapping(work: Path, draft: int, target: int, dest: Path) -> dict:
    """SpecForge's rule (recipe.shards.vocabmap) on the prose's token counts, every token counted."""
    import numpy as np
    from transformers import AutoTokenizer

    from recipe.shards import tokencounts, vocabmap

    tok = AutoTokenizer.from_pretrained(work / "target")
    counts = tokencounts.Counts()
    for i, ids in enumerate(tok(prose(), add_special_tokens=False)["input_ids"]):
        counts.add(str(i), ids, np.ones(len(ids), np.uint8))
    dest.mkdir(parents=True, exist_ok=True)
    res = vocabmap.write_specforge(dest, counts, draft, target)
    return {"prose_tokens": int(counts.all.sum()), "kept": res["kept"]}


def mappings(work: Path, draft: int) -> dict:
    """vocab/real (the recipe's, from the shards) and vocab/other (from prose), each with its coverage
    of the set's loss tokens; made once (a resumed call reads them)."""
    info_path = work / "vocab" / "vocab.json"
    if info_path.exists():
        return json.loads(info_path.read_text())
    real, other = work / "vocab" / "real", work / "vocab" / "other"
    argv = [sys.executable, "-m", "recipe.shards", "vocab-map", str(work / "shards" / "real"),
            "--draft-vocab", str(draft), "--out", str(real)]  # fmt: skip
    subprocess.run(argv, cwd=ROOT, check=True)
    made = json.loads((real / "vocab_map.json").read_text())
    counts = set_counts(work)
    theirs = other_mapping(work, draft, made["target_vocab_size"], other)
    info = {
        "draft_vocab_size": draft,
        "target_vocab_size": made["target_vocab_size"],
        "real": {"path": str(real / "vocab_mapping.pt"), "coverage": made["specforge"]["coverage"]},
        "other_data": {
            "path": str(other / "vocab_mapping.pt"),
            "coverage": coverage(theirs["kept"], counts),
            "prose_tokens": theirs["prose_tokens"],
        },  # fmt: skip
    }
    info_path.write_text(json.dumps(info, indent=1))
    log(f"vocab: {draft} of {info['target_vocab_size']} ids cover {info['real']['coverage']:.3f} of the set's loss "
        f"tokens; the prose mapping {info['other_data']['coverage']:.3f}")  # fmt: skip
    return info
