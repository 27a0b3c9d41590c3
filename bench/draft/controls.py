"""The controls' wrong data (permuted slots, a pre-norm teacher) and each one's size in the data."""

from __future__ import annotations

import functools
import math
import os
from pathlib import Path

from .fp8slots import fp8_sizes
from .target import weight_spread


def permuted(x, n_aux):
    """Aux slots concatenated as [c, b, a] where the draft config (and SGLang at serving) says [a, b, c]:
    the order reversed, which puts the low layer where the draft wants the high one (the middle slot
    stays: at 16 layers, layer 2 and layer 13 trade places)."""
    from recipe.shards.export import specforge_raw

    raw = specforge_raw(x, n_aux)
    a = raw["aux_hidden_state"]
    H = a.shape[-1] // n_aux
    order = list(reversed(range(n_aux)))
    raw["aux_hidden_state"] = a.view(1, -1, n_aux, H)[:, :, order].reshape(a.shape).clone()
    return raw


@functools.cache
def target_norm_weight():
    from recipe.shards.export import final_norm_weight

    return final_norm_weight(os.environ["DRAFT_TARGET"])


def wrong_norm(x, n_aux):
    """The last slot before the final norm (its pre-norm equivalent) where SpecForge feeds lm_head."""
    from recipe.shards.export import pre_norm_equivalent, specforge_raw

    raw = specforge_raw(x, n_aux)
    w = target_norm_weight()
    raw["hidden_state"] = pre_norm_equivalent(raw["hidden_state"][0], w)[None].clone()
    return raw


def lm_head(work: Path):
    from safetensors import safe_open

    with safe_open(work / "target" / "model.safetensors", "pt") as f:
        return f.get_tensor("lm_head.weight").float()


def teacher_agreement(work: Path, hiddens, head) -> dict:
    """What the wrong-norm control changes in SpecForge's teacher (lm_head over the last slot): how often
    its argmax, the token greedy decoding accepts, differs from the real teacher's on stored positions;
    and how far the final norm weight is from uniform (a uniform weight changes no argmax). `hiddens`:
    [T, slots, H] arrays, the final state last; `head`: lm_head's weight, float."""
    from recipe.shards.export import final_norm_weight, pre_norm_equivalent

    w = final_norm_weight(work / "target").float()
    same = total = 0
    for h in hiddens:
        post = h[:, -1].float()
        real = (post @ head.T).argmax(-1)
        wrong = (pre_norm_equivalent(post, w).float() @ head.T).argmax(-1)
        same += int((real == wrong).sum())
        total += real.numel()
    return {"positions": total, "argmax_equal_fraction": round(same / total, 4),
            "norm_weight_min_max_std_mean": weight_spread(w)}  # fmt: skip


def slot_distances(hiddens, layers: list[int]) -> dict:
    """How far apart the aux slots are, pair by pair: what a permuted draft is served in place of the
    slot it learned. Per pair (shallow-deep): the rel-L2 of their difference against the deeper slot,
    over every position, and the mean cosine between them at a position. `hiddens`: [T, slots, H]
    arrays, the aux slots first."""
    import torch

    pairs = [(i, j) for i in range(len(layers)) for j in range(i + 1, len(layers))]
    diff, norm, cos, positions = dict.fromkeys(pairs, 0.0), dict.fromkeys(pairs, 0.0), dict.fromkeys(pairs, 0.0), 0
    for h in hiddens:
        x = torch.as_tensor(h)[:, : len(layers)].float()
        positions += x.shape[0]
        for i, j in pairs:
            diff[i, j] += float((x[:, i] - x[:, j]).square().sum())
            norm[i, j] += float(x[:, j].square().sum())
            cos[i, j] += float(torch.nn.functional.cosine_similarity(x[:, i], x[:, j], dim=-1).sum())
    return {f"{layers[i]}-{layers[j]}": {"rel_l2": round(math.sqrt(diff[i, j] / norm[i, j]), 4),
                                         "cosine": round(cos[i, j] / positions, 4)} for i, j in pairs}  # fmt: skip


def control_sizes(work: Path, n: int = 200) -> dict:
    """How large each control's error is in the data itself, before any training: the wrong-norm
    teacher's changed tokens, the distances between the slots a permuted draft confuses, and the fp8
    codec's error per slot and in the teacher. Two
    threads: it runs beside the trainers, whose data loaders need the cores more."""
    from recipe.selfcheck import torch_threads
    from recipe.shards.reader import ShardReader

    reader = ShardReader(work / "shards" / "real")

    def hiddens():  # one sample at a time: the reader reuses a sample's memory for the next
        return (reader.get(sid)["hidden"] for sid in reader.ids[:n])

    with torch_threads(2):
        head = lm_head(work)
        return {"wrong_norm_teacher": teacher_agreement(work, hiddens(), head),
                "slot_distances": slot_distances(hiddens(), reader.manifest["capture"]["layers"]),
                "fp8_by_slot": fp8_sizes(head, hiddens())}  # fmt: skip
