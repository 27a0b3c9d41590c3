"""Sizes, rates and durations as people read them: a unit that fits, never "0.0 GB" for bytes."""

from __future__ import annotations


def size(n: float, unit: str = "B") -> str:
    """Decimal units (1 KB = 1000 B), three significant figures: 512 B, 12.3 KB, 4.56 GB."""
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 999.5 or prefix == "T":
            return f"{n:.3g} {prefix}{unit}" if n and abs(n) < 100 else f"{n:.0f} {prefix}{unit}"
        n /= 1000
    raise AssertionError("unreachable")


def rate(per_s: float, unit: str = "B") -> str:
    return size(per_s, unit) + "/s"


def duration(s: float) -> str:
    """3.2 s, 4m05s, 2h10m."""
    if s < 60:
        return f"{s:.1f} s"
    m, s = divmod(int(round(s)), 60)
    return f"{m}m{s:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"
