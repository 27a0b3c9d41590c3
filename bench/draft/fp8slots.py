"""The fp8 codec on chosen slots only, to say which slot an fp8 draft's loss comes from: SpecForge reads
the lossless set with the final slot (its teacher, through lm_head) or the aux slots (the draft's
inputs) quantized and dequantized as the packer stores them; and the codec's error in the data itself."""

from __future__ import annotations

import math


def fp8_roundtrip(h, slots):
    """bf16 [T, S, H] (torch) -> a copy whose `slots` went through the fp8 codec (one scale per token
    and slot, as the packer stores them); the other slots as they were."""
    import numpy as np
    import torch

    from recipe.shards import fp8

    words, slots = h.contiguous().view(torch.int16).numpy().view(np.uint16), list(slots)
    out = words.copy()
    out[:, slots] = fp8.round_trip(words[:, slots], words.shape[-1])
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)


def fp8_final(x, n_aux):
    """SpecForge's record of a lossless sample whose final slot alone is stored in fp8."""
    from recipe.shards.export import specforge_raw

    return specforge_raw({**x, "hidden": fp8_roundtrip(x["hidden"], [n_aux])}, n_aux)


def fp8_aux(x, n_aux):
    """SpecForge's record of a lossless sample whose aux slots alone are stored in fp8."""
    from recipe.shards.export import specforge_raw

    return specforge_raw({**x, "hidden": fp8_roundtrip(x["hidden"], range(n_aux))}, n_aux)


def fp8_sizes(head, hiddens) -> dict:
    """The codec's error before any training: per slot, the rel-L2 of the dequantized states over every
    position; and how often SpecForge's teacher (lm_head over the final slot) changes its argmax, the
    token greedy decoding accepts. `head`: [V, H] float; `hiddens`: [T, slots, H] bf16, final last."""
    err = norm = None
    same = total = 0
    for h in hiddens:
        x = h.float()
        q = fp8_roundtrip(h, range(h.shape[1])).float()
        e, n = (q - x).square().sum((0, 2)), x.square().sum((0, 2))
        err, norm = (e, n) if err is None else (err + e, norm + n)
        same += int(((x[:, -1] @ head.T).argmax(-1) == (q[:, -1] @ head.T).argmax(-1)).sum())
        total += x.shape[0]
    return {"rel_l2_per_slot": [round(math.sqrt(float(a) / float(b)), 5) for a, b in zip(err, norm)],
            "teacher_argmax_equal_fraction": round(same / total, 4), "positions": total}  # fmt: skip
