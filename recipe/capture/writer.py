"""The capture writer: rows of one forward pass -> one raw record per request in the dump directory.

Both backends go through `write_pass`: the HF backend in-process, the SGLang hook from its writer
thread inside the server. A pass is described the way SGLang describes it: the requests' rids in
row order, each one's prefix length (where this piece starts in the prompt) and extend length.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np

from . import records

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive flock of the folder itself, among processes (threads: the caller's lock)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def as_planes(x) -> np.ndarray:
    """Hidden states as [2, T, slots, H] byte planes (high, low): passed through when they already are
    (the SGLang hook splits on the GPU), split here from [T, slots, H] 16-bit words otherwise."""
    if not isinstance(x, np.ndarray):
        import torch

        x = x.contiguous()
        x = (x.view(torch.int16) if x.element_size() == 2 else x).numpy()
    if x.ndim == 4 and x.shape[0] == 2 and x.itemsize == 1:
        return x.view(np.uint8)
    if x.ndim == 3 and x.itemsize == 2:
        return records.split_words(x.view(np.uint16))
    raise ValueError(f"hidden states must be [T, slots, H] 16-bit words or [2, T, slots, H] planes, got {x.shape}")


def as_i32(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x.astype(np.int32, copy=False)
    import torch

    return x.to(dtype=torch.int32).numpy()


class CaptureWriter:
    def __init__(self, dump_dir: str | Path, budget_bytes: int, rid_prefix: str, poll_s: float = 0.02, trace_dir=None):
        self.dump_dir = Path(dump_dir)
        # trace_dir: one file per writing process, a line per record: who wrote what, which the
        # dump itself cannot show (two TP ranks writing the same record leave one file)
        self.trace = Path(trace_dir) / f"writer-{os.getpid()}.txt" if trace_dir else None
        self.budget_bytes = int(budget_bytes)
        self.rid_prefix = rid_prefix
        self.poll_s = poll_s
        self.waited_s = 0.0  # time spent blocked on the dump budget (reported by the benchmarks)
        self._lock = threading.Lock()
        self._names = itertools.count()

    def wait_for_budget(self, incoming: int = 0) -> Path | None:
        """Block while the dump directory, with what every writer has reserved, holds more than the
        budget (the packer drains it); then reserve `incoming` until release(). A single record
        larger than the whole budget is let through once the directory is empty.
        Writers are threads (the hook's) and processes (the TP ranks that share a pass, DP groups):
        a reservation is a sparse file of that size in the directory, made under an flock of the
        directory, so every writer sees every other's before it writes."""
        t0 = None
        while True:
            with self._lock, _locked(self.dump_dir):
                held = records.dir_bytes(self.dump_dir, reservations=True)
                if held + incoming <= self.budget_bytes or held == 0:
                    token = self._reserve(incoming)
                    break
            t0 = t0 or time.monotonic()
            time.sleep(self.poll_s)
        if t0:
            with self._lock:
                self.waited_s += time.monotonic() - t0
        return token

    def _reserve(self, nbytes: int) -> Path | None:
        if nbytes <= 0:
            return None
        path = self.dump_dir / f"{records.RESERVATION}{os.getpid()}-{threading.get_ident()}-{next(self._names)}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, nbytes)  # counted by its size, holds no memory
        finally:
            os.close(fd)
        return path

    def release(self, token: Path | None) -> None:
        """Under the lock too: a scan can miss a record renamed while it runs, which its reservation
        covers only if it cannot vanish meanwhile."""
        if token is not None:
            with self._lock, _locked(self.dump_dir):
                token.unlink(missing_ok=True)

    def write_pass(self, rids, prefix_lens, extend_lens, input_ids, hidden, lasts=None) -> int:
        """input_ids [T], hidden [T, slots, H] words or [2, T, slots, H] planes (T may exceed
        sum(extend_lens): padding rows are ignored). Only rids carrying the recipe's prefix are
        written. Returns bytes written."""
        ids, planes = as_i32(input_ids), as_planes(hidden)
        if sum(extend_lens) > ids.shape[0] or planes.shape[1] != ids.shape[0]:
            raise ValueError(
                f"pass has {ids.shape[0]} ids / {planes.shape[1]} rows for extend lengths {list(extend_lens)}"
            )
        starts = np.concatenate([[0], np.cumsum(extend_lens)]).astype(int)
        ours = [i for i, rid in enumerate(rids) if rid.startswith(self.rid_prefix)]
        pieces = [  # (rid, offset, ids, planes, last) of each record this pass makes
            (rids[i], int(prefix_lens[i]), ids[a:b], planes[:, a:b], None if lasts is None else bool(lasts[i]))
            for i, a, b in ((i, starts[i], starts[i + 1]) for i in ours)
        ]
        # one look at the directory per pass: the writer thread must not rescan it for every request
        token = self.wait_for_budget(sum(records.record_bytes(r, o, p.shape, last) for r, o, _, p, last in pieces))
        written = 0
        try:
            for piece in pieces:
                written += records.write_record(self.dump_dir, *piece)
        finally:
            self.release(token)  # written: the directory counts it now
        if self.trace is not None and pieces:
            with open(self.trace, "a") as f:
                f.writelines(f"{rid} {off} {len(i)}\n" for rid, off, i, _, _ in pieces)
        return written

    def write_error(self, rid: str, reason: str) -> None:
        log.error("capture failed for %s: %s", rid, reason)
        records.write_error(self.dump_dir, rid, reason)
