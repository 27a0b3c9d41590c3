"""The packer: dump directory -> validated, compressed, durable shard records. Runs beside the backend.

For every request the backend announces (`expect`), it waits until raw pieces cover the whole
prompt [0, n), reassembles them, checks them against what was sent, compresses on a thread pool and
appends to the store. Raw files are deleted only after the shard record is committed (fsynced). A
request that answered but whose dump never completes within `dump_timeout_s` is a failed sample:
this is what catches a CUDA-graph replay (Python hooks do not run) or a mis-set server flag.
"""
from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .capture import records
from .shards.codec import Codec

log = logging.getLogger(__name__)


@dataclass
class Pending:
    sample: object  # recipe.data.Sample
    rid: str
    responded_at: float | None = None
    pieces: dict = field(default_factory=dict)  # offset -> (path, n, slots, hidden)


class Progress:
    """Throughput while it runs: samples/s, tokens/s, raw GB/s, compression ratio."""

    def __init__(self, total: int, every_s: float = 10.0, dump_dir: Path | None = None, budget: int = 0):
        self.total, self.every_s, self.dump_dir, self.budget = total, every_s, dump_dir, budget
        self.t0 = self.last = time.monotonic()
        self.samples = self.tokens = self.raw = self.stored = self.failed = 0

    def add(self, tokens: int, raw: int, stored: int) -> None:
        self.samples += 1
        self.tokens += tokens
        self.raw += raw
        self.stored += stored
        self.maybe_log()

    def line(self) -> str:
        dt = max(time.monotonic() - self.t0, 1e-9)
        ratio = self.raw / self.stored if self.stored else 0.0
        shm = ""
        if self.dump_dir is not None and self.dump_dir.exists():
            shm = f" | dump {records.dir_bytes(self.dump_dir) / 1e9:.2f}/{self.budget / 1e9:.1f} GB"
        return (f"packed {self.samples}/{self.total} (failed {self.failed}) | {self.samples / dt:.1f} samples/s | "
                f"{self.tokens / dt / 1e3:.1f}K tok/s | raw {self.raw / dt / 1e9:.3f} GB/s | ratio {ratio:.3f}x{shm}")

    def maybe_log(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last >= self.every_s:
            self.last = now
            log.info(self.line())


def check_hidden(h: np.ndarray) -> str | None:
    """bf16 bits [T, slots, H]: a reason if any value is NaN/Inf or any slot is all zeros.
    One pass: |x| as bits (sign cleared), max per slot. Exponent all ones (>= 0x7F80) = Inf/NaN;
    a max of 0 = every value in the slot is +-0."""
    peak = np.bitwise_and(h, 0x7FFF).max(axis=(0, 2))
    if (peak >= 0x7F80).any():
        return "non_finite"
    if (peak == 0).any():
        return f"all_zero_slot_{int(np.argmax(peak == 0))}"
    return None


class Packer:
    def __init__(self, dump_dir, store, codec: Codec, slots: list[str], workers: int = 2,
                 dump_timeout_s: float = 120.0, commit_every: int = 64, commit_every_s: float = 2.0,
                 progress: Progress | None = None, poll_s: float = 0.01):
        self.dump_dir = Path(dump_dir)
        self.store, self.codec, self.slots = store, codec, slots
        self.dump_timeout_s, self.commit_every, self.commit_every_s, self.poll_s = (
            dump_timeout_s, commit_every, commit_every_s, poll_s)
        self.progress = progress or Progress(0)
        self.pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="pack")
        self.pending: dict[str, Pending] = {}
        self.inflight: collections.deque[tuple[Pending, Future]] = collections.deque()
        self.uncommitted: list[tuple[Pending, list[Path]]] = []
        self.ok = 0
        self.failed: collections.Counter = collections.Counter()
        self.examples: dict[str, list[str]] = collections.defaultdict(list)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="packer", daemon=True)
        self._last_commit = time.monotonic()

    # -- the backend's side ------------------------------------------------------------------
    def expect(self, rid: str, sample) -> None:
        with self._lock:
            self.pending[rid] = Pending(sample, rid)

    def responded(self, rid: str) -> None:
        with self._lock:
            if rid in self.pending:
                self.pending[rid].responded_at = time.monotonic()

    def fail(self, rid: str, reason: str) -> None:
        with self._lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            self._count_failure(p, reason)
            self._delete(p)

    def forget(self, rid: str) -> None:
        """A superseded attempt (the client retries under a new rid): dropped, not counted."""
        with self._lock:
            p = self.pending.pop(rid, None)
        if p is not None:
            self._delete(p)

    def outstanding(self) -> int:
        with self._lock:
            return len(self.pending) + len(self.inflight) + len(self.uncommitted)

    def start(self) -> "Packer":
        self._thread.start()
        return self

    def __enter__(self) -> "Packer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every expected request is stored or failed (raises the packer's own error)."""
        t0 = time.monotonic()
        while self.outstanding():
            if self.error:
                raise RuntimeError("packer failed") from self.error
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"packer still has {self.outstanding()} samples after {timeout_s}s")
            time.sleep(self.poll_s)
        if self.error:
            raise RuntimeError("packer failed") from self.error

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.pool.shutdown(wait=True, cancel_futures=True)
        try:
            self.store.commit()
        except OSError as e:  # e.g. the disk is full: what was not committed is redone on resume
            log.error("final commit failed: %s", e)

    # -- the packer thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                busy = self._scan()
                busy |= self._collect()
                self._maybe_commit()
                if not busy:
                    time.sleep(self.poll_s)
            self._collect(wait=True)
            self._maybe_commit(force=True)
        except BaseException as e:  # surfaced by drain(); never a silent hole
            log.exception("packer thread died")
            self.error = e

    def _scan(self) -> bool:
        busy = False
        try:
            names = os.listdir(self.dump_dir)
        except FileNotFoundError:
            return False
        now = time.monotonic()
        with self._lock:
            for name in names:
                if name.endswith(records.ERROR_SUFFIX):
                    rid = name[: -len(records.ERROR_SUFFIX)]
                    p = self.pending.pop(rid, None)
                    reason = "capture_error"
                    try:
                        reason += ": " + json.loads((self.dump_dir / name).read_text())["reason"]
                    except (OSError, ValueError, KeyError):
                        pass
                    if p is not None:
                        self._count_failure(p, reason)
                        self._delete(p)
                    (self.dump_dir / name).unlink(missing_ok=True)
                    busy = True
                    continue
                parsed = records.parse_name(name)
                if parsed is None:
                    continue
                rid, off = parsed
                p = self.pending.get(rid)
                if p is None:
                    if not any(rid == q.rid for q, _ in self.inflight) and not any(rid == q.rid for q, _ in self.uncommitted):
                        (self.dump_dir / name).unlink(missing_ok=True)  # a superseded attempt or a stale run
                    continue
                if off not in p.pieces:
                    h = records.read_header(self.dump_dir / name)
                    p.pieces[off] = (self.dump_dir / name, h["n"], h["slots"], h["hidden"])
                    busy = True
            for rid, p in list(self.pending.items()):
                n = len(p.sample.input_ids)
                covered = 0
                for off in sorted(p.pieces):
                    if off != covered:
                        break
                    covered += p.pieces[off][1]
                if covered >= n and p.responded_at is not None:  # the client vetted the response first
                    del self.pending[rid]
                    self.inflight.append((p, self.pool.submit(self._pack, p)))
                    busy = True
                elif p.responded_at is not None and now - p.responded_at > self.dump_timeout_s:
                    del self.pending[rid]
                    why = "no_dump" if not p.pieces else (
                        f"incomplete_dump ({covered}/{n} tokens; pieces at {sorted(p.pieces)[:8]}; "
                        f"{now - p.responded_at:.1f} s after the response)")
                    self._count_failure(p, why)
                    self._delete(p)
        return busy

    def _pack(self, p: Pending):
        """Worker: reassemble, validate, encode. Returns (frame, raw_bytes) or a failure reason."""
        s = p.sample
        offs = sorted(p.pieces)
        parts = [records.read_record(p.pieces[o][0]) for o in offs]
        ids = np.concatenate([x[1] for x in parts]) if len(parts) > 1 else parts[0][1]
        hid = np.concatenate([x[2] for x in parts]) if len(parts) > 1 else parts[0][2]
        if ids.shape[0] != len(s.input_ids):
            return f"token_count_mismatch ({ids.shape[0]} captured, {len(s.input_ids)} sent)"
        if hid.shape[1] != len(self.slots):
            return f"slot_count_mismatch ({hid.shape[1]} captured, {len(self.slots)} configured)"
        if not np.array_equal(ids, np.asarray(s.input_ids, dtype=np.int32)):
            return "token_ids_mismatch"
        bad = check_hidden(hid)
        if bad:
            return bad
        meta = {"id": s.id, "key": s.key, "source": s.source, "slots": self.slots,
                "dtypes": {"input_ids": "int32", "loss_mask": "uint8", "hidden": "bfloat16"}}
        frame = self.codec.encode(meta, {"input_ids": ("int32", ids), "loss_mask": ("uint8", s.loss_mask),
                                         "hidden": ("bfloat16", hid)})
        return frame, int(ids.nbytes + hid.nbytes + np.asarray(s.loss_mask).nbytes)

    def _collect(self, wait: bool = False) -> bool:
        busy = False
        while self.inflight and (wait or self.inflight[0][1].done()):
            p, fut = self.inflight.popleft()
            res = fut.result()  # a worker exception is a bug: let it kill the run loudly
            busy = True
            if isinstance(res, str):
                self._count_failure(p, res)
                self._delete(p)
                continue
            frame, raw = res
            s = p.sample
            self.store.append(s.id, s.key, frame, tokens=len(s.input_ids), raw_bytes=raw,
                              loss_tokens=int(np.asarray(s.loss_mask).sum()), source=s.source)
            self.uncommitted.append((p, [v[0] for v in p.pieces.values()]))
            self.progress.add(len(s.input_ids), raw, len(frame))
        return busy

    def _maybe_commit(self, force: bool = False) -> None:
        if not self.uncommitted:
            return
        if force or len(self.uncommitted) >= self.commit_every or time.monotonic() - self._last_commit > self.commit_every_s:
            self.store.commit()
            for p, paths in self.uncommitted:  # only now is the raw copy redundant
                for path in paths:
                    path.unlink(missing_ok=True)
            self.ok += len(self.uncommitted)
            self.uncommitted = []
            self._last_commit = time.monotonic()

    def _count_failure(self, p: Pending, reason: str) -> None:
        key = reason.split(" (")[0].split(":")[0]
        self.failed[key] += 1
        self.progress.failed += 1
        if len(self.examples[key]) < 5:
            self.examples[key].append(f"{p.sample.source} id={p.sample.id}: {reason}")
        log.warning("sample %s failed: %s", p.sample.id, reason)

    def _delete(self, p: Pending) -> None:
        for path, *_ in p.pieces.values():
            path.unlink(missing_ok=True)
