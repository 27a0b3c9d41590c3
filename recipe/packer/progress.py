"""Throughput lines while a run goes: samples, tokens and bytes per second over the capture, an ETA."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from .. import units
from ..capture import records

log = logging.getLogger(__name__)


# The tail's steps, in order, each when the last sample went through it: what "stored N s after the last
# was computed" is made of (the server's dump writes, free workers, packing; then the commit)
TAIL = (("dumped", "the last dump seen"), ("dispatched", "handed to a worker"), ("packed", "packed"))


class Progress:
    """Throughput while it runs, counted from the capture's start (`start()`: the server ready, the
    model loaded), not from the process's: samples/s, tokens/s, raw and stored bytes/s, ratio, ETA."""

    FIRST_SAMPLE_NOTE_S = 30.0  # no sample by then: say why the run looks stuck

    def __init__(self, total: int, every_s: float = 10.0, dump_dir: Path | None = None, budget: int = 0):
        self.total, self.every_s, self.dump_dir, self.budget = total, every_s, dump_dir, budget
        self.t0 = self.last = time.monotonic()
        self.samples = self.tokens = self.raw = self.stored = self.failed = 0
        self.noted = False
        self.capturing = False  # until start(): the backend says what it waits for (model, server)
        self.computed_at: float | None = None
        self.last_at: dict[str, float] = {}  # TAIL's step -> when the latest sample went through it

    def mark(self, step: str) -> None:
        self.last_at[step] = time.monotonic()

    def start(self) -> None:
        self.t0 = self.last = time.monotonic()
        self.capturing = True

    def add(self, tokens: int, raw: int, stored: int) -> None:
        self.mark("packed")
        self.samples += 1
        self.tokens += tokens
        self.raw += raw
        self.stored += stored
        self.maybe_log()

    def line(self) -> str:
        dt = max(time.monotonic() - self.t0, 1e-9)
        done = self.samples + self.failed
        eta = f" | ETA {units.duration((self.total - done) * dt / done)}" if 0 < done < self.total else ""
        ratio = f"{self.raw / self.stored:.3f}x" if self.stored else "n/a"
        shm = ""
        if self.dump_dir is not None and self.dump_dir.exists():
            shm = f" | dump {units.size(records.dir_bytes(self.dump_dir))} of {units.size(self.budget)}"
        return (
            f"packed {self.samples}/{self.total} (failed {self.failed}) in {units.duration(dt)} | "
            f"{self.samples / dt:.1f} samples/s | {units.rate(self.tokens / dt, 'tok')} | raw "
            f"{units.rate(self.raw / dt)}, stored {units.rate(self.stored / dt)} (ratio {ratio}){eta}{shm}"
        )

    def computed(self, outstanding: int) -> None:
        """Every sample computed (the server has answered every request): what is left is storing the
        last ones, the run's tail."""
        self.computed_at = time.monotonic()
        if self.capturing:
            dump = f" ({units.size(records.dir_bytes(self.dump_dir))} in the dump folder)" if self.dump_dir else ""
            log.info("every sample computed %s into the capture; %d left to store%s",
                     units.duration(self.computed_at - self.t0), outstanding, dump)  # fmt: skip

    def drained(self) -> None:
        """The tail, and each of its steps counted from the last sample computed (negative: that step
        was over before it)."""
        if self.capturing and self.computed_at is not None:
            tail = units.duration(time.monotonic() - self.computed_at)
            steps = [f"{what} {self.last_at[k] - self.computed_at:+.2f} s" for k, what in TAIL if k in self.last_at]
            log.info("the last samples stored %s after the last was computed%s", tail,
                     f" ({', '.join(steps)})" if steps else "")  # fmt: skip

    def maybe_log(self, force: bool = False) -> None:
        if not (self.capturing or force):
            return
        now = time.monotonic()
        if self.capturing and not self.noted and not self.samples and now - self.t0 > self.FIRST_SAMPLE_NOTE_S:
            self.noted = True
            log.info(
                "no sample packed %.0f s into the capture: the first large batch compiles kernels on a fresh "
                "machine (minutes at most); later runs start at once",
                now - self.t0,
            )
        if force or now - self.last >= self.every_s:
            self.last = now
            log.info(self.line())
