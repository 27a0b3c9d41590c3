"""A draft vocabulary from a set's token counts, in each trainer's own form.

    python -m recipe.shards vocab-map OUT --draft-vocab 32000

EAGLE-3 drafts predict over the draft_vocab_size most frequent loss-masked tokens of their training
data; `d2t[i]` is the offset from draft id i to its target id, `t2d` marks the kept target ids. A
mapping taken from other data silently misaligns the draft's head, so it is built from the set's own
counts (tokencounts.py), with each trainer's own rule:
- SpecForge 0.2.0 (`process_token_dict_to_mappings`): a Counter in first-seen order, padded with ids
  from range(draft) when fewer were seen, its most_common (ties: first seen first). vocab_mapping.pt.
- speculators 0.9.0 (`build_vocab_mappings_from_distribution`): count descending, then id ascending,
  padded with the lowest unused ids. token_freq.pt (id -> count), d2t.npy, t2d.npy.
tests/test_vocabmap.py holds both against the trainers' own functions on the same samples.
"""

from __future__ import annotations

import io
import json
import logging
import os
from pathlib import Path

import numpy as np

from ..errors import UserError
from . import tokencounts
from .aliasing import set_around
from .reader import ShardReader
from .store import atomic_write

log = logging.getLogger(__name__)

FORMS = ("specforge", "speculators")


class VocabMapError(UserError, ValueError):
    pass


def check_sizes(draft: int, target: int, counts: tokencounts.Counts) -> None:
    if draft < 1 or draft > target:
        raise VocabMapError(f"--draft-vocab {draft}: need 1 <= draft vocabulary <= the target's ({target})")
    seen = np.flatnonzero(counts.all)
    if seen.size and seen[-1] >= target:
        raise VocabMapError(f"the set holds token id {int(seen[-1])}, outside a target vocabulary of {target}")


def check_request(reader: ShardReader, draft: int, target: int | None) -> None:
    """The sizes a mapping of `draft` ids would be built with, checked before an export writes a sample."""
    check_sizes(draft, target_vocab(reader, target), tokencounts.load(reader.root, reader.records))


def specforge_ids(counts: tokencounts.Counts, draft: int) -> tuple[list[int], int]:
    """(kept target ids ascending, ids padded in): SpecForge's rule on the set's Counter."""
    ids, freq = counts.counter()
    order, padded = ids.tolist(), 0
    if len(order) < draft:  # its padding: ids from range(draft) not seen, in that Python set's order
        have = set(order)
        for token in set(range(draft)) - have:
            order.append(token)
            padded += 1
            if len(order) >= draft:
                break
    weight = dict(zip(ids.tolist(), freq.tolist()))
    ranked = sorted(range(len(order)), key=lambda i: -weight.get(order[i], 0))  # stable: ties first seen first
    return sorted(order[i] for i in ranked[:draft]), padded


def speculators_ids(counts: tokencounts.Counts, draft: int) -> tuple[list[int], int]:
    """(kept target ids ascending, ids padded in): speculators' rule on the set's counts."""
    ids, freq = counts.counter()
    ranked = [int(i) for i in ids[np.lexsort((ids, -freq))][:draft]]
    taken, padded = set(ranked), 0
    for token in range(draft):
        if len(ranked) >= draft:
            break
        if token not in taken:
            ranked.append(token)
            padded += 1
    return sorted(ranked), padded


def put(path: Path, save) -> None:
    """A file written whole through `save(file object)`, replacing what is at `path`: a link there is
    replaced, never written through (an earlier mapping's file may have become a link to the user's)."""
    buf = io.BytesIO()
    save(buf)
    atomic_write(path, buf.getvalue())


def mapping(kept: list[int], target: int) -> tuple[np.ndarray, np.ndarray]:
    """d2t (target id - draft id, int64) and t2d (bool over the target vocabulary)."""
    kept_arr = np.asarray(kept, np.int64)
    t2d = np.zeros(target, bool)
    t2d[kept_arr] = True
    return kept_arr - np.arange(kept_arr.size), t2d


def write_specforge(dest: Path, counts, draft: int, target: int) -> dict:
    import torch

    kept, padded = specforge_ids(counts, draft)
    d2t, t2d = mapping(kept, target)
    pair = {"d2t": torch.from_numpy(d2t), "t2d": torch.from_numpy(t2d)}
    put(dest / "vocab_mapping.pt", lambda f: torch.save(pair, f))
    return {"vocab_mapping.pt": "model.vocab_mapping_path", "padded": padded, "kept": kept}


def write_speculators(dest: Path, counts, draft: int, target: int) -> dict:
    import torch

    kept, padded = speculators_ids(counts, draft)
    d2t, t2d = mapping(kept, target)
    ids, freq = counts.counter()
    put(dest / "token_freq.pt", lambda f: torch.save(dict(zip(ids.tolist(), freq.tolist())), f))
    put(dest / "d2t.npy", lambda f: np.save(f, d2t))
    put(dest / "t2d.npy", lambda f: np.save(f, t2d))
    return {"d2t.npy": "--d2t-path", "t2d.npy": "--t2d-path", "padded": padded, "kept": kept}


WRITERS = {"specforge": write_specforge, "speculators": write_speculators}


def target_vocab(reader: ShardReader, given: int | None) -> int:
    """The target's vocabulary: given, or its checkpoint's config.json (text_config where nested)."""
    if given is not None:  # 0 too: refused by the size check, never read as "not given"
        return int(given)
    model = reader.manifest.get("model")
    cfg = Path(str((model if isinstance(model, dict) else {}).get("path") or "")) / "config.json"
    if cfg.exists():
        c = json.loads(cfg.read_text())
        vocab = c.get("text_config", {}).get("vocab_size") or c.get("vocab_size")
        if vocab:
            return int(vocab)
    raise VocabMapError(f"the target checkpoint's config.json is not at {cfg}: pass --target-vocab")


def default_dest(root, draft: int) -> Path:
    return Path(root) / "vocab" / f"draft-{draft}"


def refuse_foreign(dest: Path, root: Path | None = None) -> None:
    """dest is new, empty, or written by an earlier vocab-map (whose files a new one replaces: a
    mapping left from other counts is what misaligns a draft); never a folder of the user's, and
    never inside a shard set but under the source's own vocab/ folder (`root`)."""
    dest = Path(dest)
    inside = set_around(dest)
    own = root is not None and Path(os.path.realpath(dest)).is_relative_to(Path(os.path.realpath(root)) / "vocab")
    if inside is not None and not own:
        raise VocabMapError(f"{dest} lies inside the shard set {inside}: pass --out with a folder of its own")
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise VocabMapError(f"{dest} is not a folder: pass --out with a folder for the mapping")
    if dest.is_dir() and any(dest.iterdir()) and not (dest / "vocab_map.json").exists():
        raise VocabMapError(f"{dest} holds files vocab-map did not write: pass --out with another folder")


def write(root, dest, draft: int, forms=FORMS, target: int | None = None) -> dict:
    """Each trainer's mapping for `draft` ids into dest (made), from the set at root; what was written,
    with the config values that point each trainer at it."""
    reader = ShardReader(root)
    counts = tokencounts.load(reader.root, reader.records)
    target = target_vocab(reader, target)
    check_sizes(draft, target, counts)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    info = {"draft_vocab_size": draft, "target_vocab_size": target, "samples": counts.lines,
            "loss_tokens": int(counts.loss.sum()), "distinct_loss_ids": counts.ranked}  # fmt: skip
    for form in forms:
        res = WRITERS[form](dest, counts, draft, target)
        kept = [k for k in res.pop("kept") if k < counts.loss.size]
        res["coverage"] = round(float(counts.loss[kept].sum() / max(1, counts.loss.sum())), 6)
        if res["padded"]:
            log.warning("%s: only %d distinct loss-masked ids for a draft vocabulary of %d: %d ids padded in as "
                        "the trainer pads them", form, counts.ranked, draft, res["padded"])  # fmt: skip
        info[form] = res
    put(dest / "vocab_map.json", lambda f: f.write((json.dumps(info, indent=2) + "\n").encode()))
    return info
