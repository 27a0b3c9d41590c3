"""What crosses between the packer thread and its worker processes (pickled through their queues),
each a frozen dataclass: a task goes out, one of four results comes back."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np


@dataclass(frozen=True)
class DumpPiece:
    """One raw piece of a request's dump on the RAM disk, as the scan found it (a chunked prompt
    comes in several, keyed by their first token's offset)."""

    path: Path
    tokens: int
    slots: int
    hidden: int


@dataclass(frozen=True)
class PackTask:
    """One sample for a worker: its pieces in prompt order, what was sent, and the record's meta."""

    tid: int
    shard: str  # the worker's own shard file, appended to
    n: int  # tokens sent
    slots: int  # as the dump says
    hidden: int
    n_slots: int  # as configured
    pieces: tuple[tuple[str, int], ...]  # (path, tokens)
    input_ids: np.ndarray
    loss_mask: np.ndarray
    meta: dict


@dataclass(frozen=True)
class Packed:
    """Appended and flushed: where the record is and what it holds."""

    tid: int
    shard: str  # file name
    offset: int
    length: int
    crc: int
    raw: int  # bytes before compression
    error: tuple | None = None  # fp8: per slot, (squared errors), (squared norms) of what it stored


@dataclass(frozen=True)
class Refused:
    """The sample failed a check (a reason the accounting counts); its bytes left the shard again."""

    tid: int
    reason: str


@dataclass(frozen=True)
class DiskError:
    """An OSError while appending (a full disk): the run stops, resume redoes the sample."""

    tid: int
    errno: int | None
    strerror: str | None
    filename: str | None


@dataclass(frozen=True)
class WorkerBug:
    """Anything else: a bug. The run stops loudly with the worker's traceback."""

    tid: int
    traceback: str


Result = Union[Packed, Refused, DiskError, WorkerBug]
