"""The packer's books: the samples the backend announced and are not yet dispatched, and how the
failed ones failed. Shared by the backend's threads and the packer thread, under one lock."""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

from .early import EarlyStop
from .messages import DumpPiece

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """A request in flight: its sample (recipe.data.Sample), when the server answered, and the dump
    pieces found so far, keyed by their first token's offset. The packer thread's own bookkeeping."""

    sample: object
    rid: str
    responded_at: float | None = None
    pieces: dict[int, DumpPiece] = field(default_factory=dict)

    def covered(self) -> int:
        """Tokens [0, covered) that the pieces found so far hold without a gap."""
        covered = 0
        for off in sorted(self.pieces):
            if off != covered:
                break
            covered += self.pieces[off].tokens
        return covered


class Books:
    def __init__(self, progress):
        self.lock = threading.Lock()
        self.pending: dict[str, Pending] = {}
        self.failed: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)
        self.progress = progress
        self.early = EarlyStop()  # the first samples all failing for one reason stop the run

    def expect(self, rid: str, sample) -> None:
        with self.lock:
            self.pending[rid] = Pending(sample, rid)

    def responded(self, rid: str) -> None:
        with self.lock:
            if rid in self.pending:
                self.pending[rid].responded_at = time.monotonic()

    def fail(self, rid: str, reason: str) -> None:
        with self.lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            self.count_failure(p, reason)
            drop_pieces(p)

    def forget(self, rid: str) -> None:
        """A superseded attempt (the client retries under a new rid): dropped, not counted."""
        with self.lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            drop_pieces(p)

    def count_failure(self, p: Pending, reason: str) -> None:
        key = reason.split(" (")[0].split(":")[0]
        self.failed[key] += 1
        self.progress.failed += 1
        if len(self.examples[key]) < 5:
            self.examples[key].append(f"{p.sample.source} id={p.sample.id}: {reason}")
        self.early.settled(key, f"sample {p.sample.id}: {reason}"[:300])
        log.warning("sample %s failed: %s", p.sample.id, reason)


def drop_pieces(p: Pending) -> None:
    for piece in p.pieces.values():
        piece.path.unlink(missing_ok=True)
