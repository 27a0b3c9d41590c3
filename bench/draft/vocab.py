"""A reduced draft vocabulary (--draft-vocab): the mapping users get, `python -m recipe.shards vocab-map`
on the shards (the set's own token counts, in SpecForge's form), and two controls' by the same rule:
other_data on another corpus's counts, the host's prose (package metadata, READMEs, licences) where the
target writes code; shuffled on the set's own counts moved to other ids by a seeded permutation of the
vocabulary (the same spread of counts, kept on ids the set seldom or never writes). The prose is too
near: its 4,096 most frequent of 16,384 ids held 0.907 of a set's loss tokens, and its draft kept
0.947x the full-vocabulary draft's acceptance. Each mapping's coverage: the share of the set's
loss-masked tokens its kept ids hold."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

from .common import ROOT, log

PROSE_BYTES = 16 << 20
OWN_MAPS = ("other_data", "shuffled", "original")  # arms whose mapping is not the real set's


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


def shuffled_mapping(counts, draft: int, target: int, dest: Path, seed: int = 0) -> dict:
    """The same rule on the set's counts carried to other ids: count[i] becomes count[perm[i]]'s."""
    import dataclasses

    import numpy as np

    from recipe.shards import vocabmap

    perm = np.random.default_rng(seed).permutation(target)
    moved = {}
    for name, fill in (("loss", 0), ("all", 0), ("first", -1)):
        a = np.full(target, fill, np.int64)
        src = getattr(counts, name)[:target]
        a[perm[: src.size]] = src
        moved[name] = a
    dest.mkdir(parents=True, exist_ok=True)
    return vocabmap.write_specforge(dest, dataclasses.replace(counts, **moved), draft, target)


def mappings(work: Path, draft: int, regen: bool = False) -> dict:
    """Each set's own mapping, the recipe's (vocab/real; with --regen also vocab/original, from the
    original answers: each draft gets its own set's, as a user maps the set a draft trains on); without
    --regen the controls' too: vocab/other (prose) and vocab/shuffled (the set's counts on other ids).
    Each with its coverage of its set's loss tokens (the controls: of the real set's); made once (a
    resumed call reads them)."""
    info_path = work / "vocab" / ("regen.json" if regen else "vocab.json")
    if info_path.exists():
        return json.loads(info_path.read_text())
    made = {k: own_mapping(work, k, draft) for k in (("real", "original") if regen else ("real",))}
    target = made["real"]["target_vocab_size"]
    info = {"draft_vocab_size": draft, "target_vocab_size": target}
    for k, m in made.items():
        info[k] = {"path": str(work / "vocab" / k / "vocab_mapping.pt"), "coverage": m["specforge"]["coverage"]}
    if not regen:
        info.update(control_mappings(work, draft, target))
    info_path.write_text(json.dumps(info, indent=1))
    covers = ", ".join(f"{k} {v['coverage']:.3f}" for k, v in info.items() if isinstance(v, dict))
    log(f"vocab: {draft} of {target} ids; each mapping's coverage of the set's loss tokens: {covers}")
    return info


def own_mapping(work: Path, name: str, draft: int) -> dict:
    """`python -m recipe.shards vocab-map` on shards/<name>, into vocab/<name>: its record."""
    dest = work / "vocab" / name
    argv = [sys.executable, "-m", "recipe.shards", "vocab-map", str(work / "shards" / name),
            "--draft-vocab", str(draft), "--out", str(dest)]  # fmt: skip
    subprocess.run(argv, cwd=ROOT, check=True)
    return json.loads((dest / "vocab_map.json").read_text())


def control_mappings(work: Path, draft: int, target: int) -> dict:
    """other_data (the prose's counts) and shuffled (the real set's on other ids), with their coverage
    of the real set's loss tokens."""
    counts = set_counts(work)
    theirs = other_mapping(work, draft, target, work / "vocab" / "other")
    moved = shuffled_mapping(counts, draft, target, work / "vocab" / "shuffled")
    return {
        "other_data": {
            "path": str(work / "vocab" / "other" / "vocab_mapping.pt"),
            "coverage": coverage(theirs["kept"], counts),
            "prose_tokens": theirs["prose_tokens"],
        },
        "shuffled": {
            "path": str(work / "vocab" / "shuffled" / "vocab_mapping.pt"),
            "coverage": coverage(moved["kept"], counts),
        },
    }
