"""What a sample must pass before it is stored: the ids the server computed are the ids sent, the
slots are the configured ones, and no value is NaN/Inf and no slot all zeros (on byte planes, as
they stream past)."""

from __future__ import annotations

import numpy as np


def validate(ids: np.ndarray, expected: np.ndarray, slots: int, n_slots: int) -> str | None:
    if ids.shape[0] != expected.shape[0]:
        return f"token_count_mismatch ({ids.shape[0]} captured, {expected.shape[0]} sent)"
    if slots != n_slots:
        return f"slot_count_mismatch ({slots} captured, {n_slots} configured)"
    if not np.array_equal(ids, expected):
        return "token_ids_mismatch"
    return None


class PlaneCheck:
    """No NaN/Inf and no all-zero slot, decided on byte planes as they stream past in row blocks:
    high plane first, then the low one. The high byte holds the sign and 7 exponent bits; the low
    plane is looked at only where the high byte leaves the answer open."""

    def __init__(self, slots: int):
        self.peak = np.zeros(slots, np.uint8)  # per slot, the largest high byte without its sign
        self.open: dict[int, np.ndarray] = {}  # row -> where exponent bits 7..1 are all set
        self.nonzero = np.zeros(slots, bool)
        self.bad: str | None = None

    def high(self, row: int, hi: np.ndarray) -> None:  # hi: [k, slots, H] from `row`
        mag = np.bitwise_and(hi, 0x7F)
        peak = mag.max(axis=(0, 2))
        np.maximum(self.peak, peak, out=self.peak)
        if (peak == 0x7F).any():  # Inf/NaN iff exponent bit 0 (the low byte's top bit) is set too
            self.open[row] = mag == 0x7F

    def low(self, row: int, lo: np.ndarray) -> None:
        top = self.open.get(row)
        if top is not None:
            if (lo[top] >= 0x80).any():
                self.bad = self.bad or "non_finite"
        zero = self.peak == 0  # high bytes all 0x00/0x80: the slot is all zero iff its low bytes are too
        if zero.any():
            self.nonzero[zero] |= lo[:, zero].any(axis=(0, 2))

    def result(self) -> str | None:
        if self.bad:
            return self.bad
        for s in np.flatnonzero((self.peak == 0) & ~self.nonzero):
            return f"all_zero_slot_{int(s)}"
        return None


def check_planes(hi: np.ndarray, lo: np.ndarray) -> str | None:
    """hi/lo byte planes [T, slots, H] of bf16 words, whole: a reason if any value is NaN/Inf or any
    slot is all zeros."""
    c = PlaneCheck(hi.shape[1])
    c.high(0, hi)
    c.low(0, lo)
    return c.result()
