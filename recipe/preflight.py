"""Before any GPU work: will the output and dump filesystems hold this run, and can the packer keep up?"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from .errors import UserError
from .shards import fp8
from .units import size

log = logging.getLogger(__name__)
# What the disk check counts on. Lossless: a ratio below the 1.448x measured on real activations
# (bench/codec.py). fp8: what its records hold whatever the values, a byte a value and a float32 scale
# per token and slot (zstd never grows a block), with room for the records' own frames; 2.26x measured
# (bench/fp8.py). The log shows both: an fp8 check at lossless's ratio refused an 8B run of 27.6 GB on
# a disk with 45 GB free (seen on an H100 host).
ASSUMED_RATIO = 1.2
FP8_ROOM, RECORD_BYTES = 1.05, 1024
MEASURED_RATIO = {"lossless": 1.448, "fp8": 2.26}
# One packer process packs fp8 about 5x slower with numpy's loops than with _fp8.c (bench/packer.py
# --codec fp8 on the CPU box: 78 against 398-434 MB/s of raw bf16, docs/packer-fp8-numpy.jsonl).
SLOW_FP8 = (
    "shards.codec=fp8 quantizes in numpy here, about 5x slower than its C loops: recipe/shards/_fp8.c was "
    "not built at install (no C compiler or Python headers). Reinstall with gcc and python3-dev, or use "
    "shards.codec=lossless"
)


class PreflightError(UserError, RuntimeError):
    pass


def existing_parent(p: Path) -> Path:
    p = Path(p).resolve()
    while not p.exists():
        p = p.parent
    return p


def estimate(samples, slots: int, hidden: int, codec: str = "lossless") -> tuple[int, int]:
    """(raw bytes, the stored bytes the disk check counts on): raw is tokens x slots x hidden x 2 B."""
    tokens = sum(len(s.input_ids) for s in samples)
    raw = tokens * (slots * hidden * 2 + 5)  # + int32 id and uint8 mask per token
    if codec == "fp8":
        return raw, int(tokens * (slots * (hidden + 4) + 5) * FP8_ROOM + RECORD_BYTES * len(samples))
    return raw, int(raw / ASSUMED_RATIO)


def check(samples, slots: int, hidden: int, out_dir, dump_dir, budget_gb: float, codec: str = "lossless") -> dict:
    if codec == "fp8" and fp8.IMPL != "compiled":
        log.warning(SLOW_FP8)
    raw, stored = estimate(samples, slots, hidden, codec)
    out_free = shutil.disk_usage(existing_parent(out_dir)).free
    dump_free = shutil.disk_usage(existing_parent(dump_dir)).free
    longest = max((len(s.input_ids) for s in samples), default=0) * (slots * hidden * 2 + 4)
    budget = int(budget_gb * (1 << 30))
    log.info(
        "preflight: %d samples, %d tokens: raw %s, stored about %s at the %.2fx %s measured on real activations "
        "(the disk check counts on %.2fx: %s; free %s); dump budget %s (free on %s: %s)",
        len(samples),
        sum(len(s.input_ids) for s in samples),
        size(raw),
        size(raw / MEASURED_RATIO[codec]),
        MEASURED_RATIO[codec],
        codec,
        raw / max(stored, 1),
        size(stored),
        size(out_free),
        size(budget),
        dump_dir,
        size(dump_free),
    )
    if stored > out_free:
        raise PreflightError(
            f"output filesystem of {out_dir} has {size(out_free)} free but this run needs about "
            f"{size(stored)}: free space or split the data (data.num_shards)"
        )
    if budget > dump_free:
        raise PreflightError(
            f"capture.budget_gb={budget_gb} ({size(budget)}) but {dump_dir} has only {size(dump_free)} free: "
            "lower the budget or enlarge /dev/shm (docker: ipc: host or shm_size)"
        )
    if longest > budget:
        log.warning("the longest sample (%s raw) exceeds capture.budget_gb: it will pass alone", size(longest))
    return {"raw_bytes": raw, "expected_bytes": stored}
