"""The scan: what the dump folder holds, matched to the requests in flight. A request is handed on
(dispatched) once its pieces cover the whole prompt [0, n) *and* the server has answered; one that
answered but whose dump does not complete within the timeout is a failed sample (`no_dump`,
`incomplete_dump`): what a CUDA-graph replay (Python hooks do not run) or a mis-set flag looks like."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from ..capture import records
from .books import Books, drop_pieces
from .messages import DumpPiece


class DumpScanner:
    def __init__(self, dump_dir: Path, books: Books, timeout_s: float, in_progress, dispatch):
        self.dump_dir, self.books, self.timeout_s = dump_dir, books, timeout_s
        self.in_progress = in_progress  # rid -> bool: packed or being packed (its pieces are not stale)
        self.dispatch = dispatch  # Pending -> bool: False when every worker is busy

    def scan(self) -> bool:
        """One pass over the folder; True if anything moved."""
        try:
            names = os.listdir(self.dump_dir)
        except FileNotFoundError:
            return False
        with self.books.lock:
            found = [self._found(name) for name in names]  # every name: no short cut
            busy = any(found)
            now = time.monotonic()
            for rid, p in list(self.books.pending.items()):
                n, covered = len(p.sample.input_ids), p.covered()
                if covered >= n and p.responded_at is not None:  # the client vetted the response first
                    if self.dispatch(p):  # else every worker is busy: it waits here, ready
                        del self.books.pending[rid]
                        busy = True
                elif p.responded_at is not None and now - p.responded_at > self.timeout_s:
                    del self.books.pending[rid]
                    late = f"{now - p.responded_at:.1f} s after the response"
                    where = f"{covered}/{n} tokens; pieces at {sorted(p.pieces)[:8]}; {late}"
                    self.books.count_failure(p, f"incomplete_dump ({where})" if p.pieces else "no_dump")
                    drop_pieces(p)
        return busy

    def _found(self, name: str) -> bool:
        """One file in the dump folder: a capture error, a piece of a request in flight (recorded),
        or one of nothing in flight (a superseded attempt or a stale run: deleted)."""
        if name.endswith(records.ERROR_SUFFIX):
            return self._capture_error(name)
        parsed = records.parse_name(name)
        if parsed is None:
            return False
        rid, off = parsed
        p = self.books.pending.get(rid)
        if p is None:
            if not self.in_progress(rid):
                (self.dump_dir / name).unlink(missing_ok=True)
            return False
        if off in p.pieces:
            return False
        h = records.read_header(self.dump_dir / name)
        p.pieces[off] = DumpPiece(self.dump_dir / name, h["n"], h["slots"], h["hidden"])
        self.books.progress.mark("dumped")
        return True

    def _capture_error(self, name: str) -> bool:
        rid = name[: -len(records.ERROR_SUFFIX)]
        p = self.books.pending.pop(rid, None)
        reason = "capture_error"
        try:
            reason += ": " + json.loads((self.dump_dir / name).read_text())["reason"]
        except (OSError, ValueError, KeyError):
            pass
        if p is not None:
            self.books.count_failure(p, reason)
            drop_pieces(p)
        (self.dump_dir / name).unlink(missing_ok=True)
        return True
