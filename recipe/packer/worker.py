"""The worker processes' side: one sample's pieces assembled, checked and encoded into a record
appended to the worker's own shard file. Plain functions, tested directly."""

from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..capture import records
from ..procs import die_with_parent
from ..shards import fp8
from ..shards.codec import Codec, RecordWriter, crc32
from ..shards.store import open_owned
from .checks import PlaneCheck, validate
from .messages import DiskError, Packed, PackTask, Refused, WorkerBug

BLOCK = fp8.GROUP_BYTES  # bytes of a plane per read, each block checked and coded while in cache (an fp8 group)
_buf: list = []  # per process, reused: a sample costs no fresh pages


@dataclass(frozen=True)
class Piece:
    path: str
    n: int  # tokens
    base: int  # where its ids start; the high plane follows them, then the low plane


def assemble(pieces: list[tuple[str, int]], n: int, slots: int, hidden: int) -> tuple[np.ndarray, list[Piece]]:
    """The pieces (path, tokens), in prompt order: their headers checked against the sample and
    their token ids read. The planes are not read here but streamed by `planes`."""
    ids, out, row = np.empty(n, np.int32), [], 0
    for path, k in pieces:
        h = records.read_header(Path(path))
        if h["n"] != k or h["slots"] != slots or h["hidden"] != hidden or row + k > n:
            raise ValueError(f"{path}: piece of {h['n']}x{h['slots']}x{h['hidden']} does not fit")
        with open(path, "rb", buffering=0) as f:
            f.seek(h["base"])
            f.readinto(memoryview(ids[row : row + k]).cast("B"))
        out.append(Piece(path, k, h["base"]))
        row += k
    return ids[:row], out


def planes(pieces: list[Piece], which: int, slots: int, hidden: int, buf: int = 0):
    """Yields (row, [k, slots, H] block) of one plane (0: high, 1: low) over all pieces in order,
    read block by block into reused buffer `buf` (valid until the next block)."""
    width = slots * hidden
    rows = max(1, BLOCK // width)
    while len(_buf) <= buf:
        _buf.append(np.empty(0, np.uint8))
    if _buf[buf].size < rows * width:
        _buf[buf] = np.empty(rows * width, np.uint8)
    row = 0
    for p in pieces:
        fd = os.open(p.path, os.O_RDONLY)
        try:
            start = p.base + 4 * p.n + which * p.n * width
            for r in range(0, p.n, rows):
                k = min(rows, p.n - r)
                block = _buf[buf][: k * width]
                if os.preadv(fd, [block], start + r * width) != block.size:
                    raise ValueError(f"{p.path}: piece is shorter than its header says")
                yield row + r, block.reshape(k, slots, hidden)
        finally:
            os.close(fd)
        row += p.n


class ShardAppender:
    """The end of a shard file that one worker owns: counts and checksums what passes through."""

    def __init__(self, fd: int):
        self.fd, self.length, self.crc = fd, 0, 0

    def write(self, b) -> int:
        self.writev([b])
        return len(b)

    def writev(self, bufs) -> None:
        views = [memoryview(b).cast("B") for b in bufs]
        for v in views:
            self.crc = crc32(v, self.crc)
            self.length += len(v)
        while views:
            done = os.writev(self.fd, views[:1024])  # IOV_MAX
            while views and done >= len(views[0]):
                done -= len(views.pop(0))
            if done:
                views[0] = views[0][done:]


def pack(task: PackTask, codec: Codec, sink, error: np.ndarray | None = None) -> str | int:
    """assemble -> validate -> encode into `sink`, checking the values as they stream past. Returns
    the raw bytes packed, or a failure reason (the caller then drops what reached the sink).
    error: [2, slots], fp8's squared error and squared norm per slot, added to."""
    n, slots, hidden = task.n, task.slots, task.hidden
    ids, pieces = assemble(task.pieces, n, slots, hidden)
    bad = validate(ids, task.input_ids, slots, task.n_slots)
    if bad:
        return bad
    mask, shape = task.loss_mask, (ids.shape[0], slots, hidden)
    specs = {"input_ids": ("int32", ids.shape, "none"), "loss_mask": ("uint8", mask.shape, "none")}
    rec = RecordWriter(codec, sink, task.meta, {**specs, **hidden_specs(codec, shape)})
    rec.write(ids)
    rec.write(mask)
    check = PlaneCheck(slots)
    if codec.kind == "fp8":
        write_fp8(rec, pieces, shape, check, error if error is not None else np.zeros((2, slots)))
    else:
        write_planes(rec, pieces, shape, check)
    rec.close()
    return check.result() or int(ids.nbytes + mask.nbytes + 2 * np.prod(shape))


def hidden_specs(codec: Codec, shape: tuple) -> dict:
    if codec.kind == "fp8":
        return {fp8.CODE: ("float8_e4m3fn", shape, "none"), fp8.SCALE: ("float32", shape[:2], "none")}
    return {"hidden": ("bfloat16", shape, "byteplane")}


def write_planes(rec: RecordWriter, pieces: list[Piece], shape: tuple, check: PlaneCheck) -> None:
    """The lossless record's hidden states: the high plane through zstd, then the low plane raw."""
    _, slots, hidden = shape
    for row, hi in planes(pieces, 0, slots, hidden):
        check.high(row, hi)
        rec.write(hi)
    for row, lo in planes(pieces, 1, slots, hidden):
        check.low(row, lo)
        rec.write_tail(lo)


def write_fp8(rec: RecordWriter, pieces: list[Piece], shape: tuple, check: PlaneCheck, error: np.ndarray) -> None:
    """The fp8 record's hidden states: both planes of a block at once, quantized per token and slot;
    the codes streamed, the scales after them."""
    n, slots, hidden = shape
    scales = np.empty((n, slots), np.float32)
    pairs = zip(planes(pieces, 0, slots, hidden, 0), planes(pieces, 1, slots, hidden, 1))
    for row, hi, lo in groups(((r, h, lo) for (r, h), (_, lo) in pairs), fp8.group_tokens(slots, hidden)):
        check.high(row, hi)
        check.low(row, lo)
        exp, sm, s, err, norm = fp8.quantize(hi, lo, hidden)  # a block is a group: its exponents, then the rest
        k = hi.shape[0]
        scales[row : row + k] = s.reshape(k, slots)
        error[0] += err.reshape(k, slots).sum(0)
        error[1] += norm.reshape(k, slots).sum(0)
        rec.write(exp)
        rec.write(sm)
    rec.write(scales)


def groups(blocks, k: int):
    """(row, hi, lo) blocks, which end where each piece ends, as blocks of exactly k tokens from row 0
    (the last one shorter): the fp8 record's groups. At most two blocks held at a time."""
    held, row = [], 0
    for _, hi, lo in blocks:
        if not held and hi.shape[0] == k:  # aligned already (every block of a one-piece sample but its last)
            yield row, hi, lo
            row += k
            continue
        held.append((hi.copy(), lo.copy()))  # planes() reuses its buffers
        while sum(h.shape[0] for h, _ in held) >= k:
            hi_all, lo_all = (np.concatenate(x) for x in zip(*held))
            yield row, hi_all[:k], lo_all[:k]
            row += k
            held = [(hi_all[k:], lo_all[k:])] if hi_all.shape[0] > k else []
    if held:
        hi_all, lo_all = (np.concatenate(x) for x in zip(*held))
        yield row, hi_all, lo_all


def worker_main(inbox, outbox, codec: Codec, parent: int, sync: bool = True) -> None:
    """One packing process: owns the shard file its tasks name and appends each frame to it.
    sync: flush each record to the disk as it is appended, the workers in parallel, rather than
    leave the whole batch to the committer's fsync (which then finds little left). On the H200
    host's disk this cut the wait after the last response from 1.25 s to 0.44 s (docs/benchmarks.md);
    on /dev/shm it costs nothing."""
    die_with_parent(parent)()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the recipe coordinates the stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    fd, path, size = None, None, 0
    for task in iter(inbox.get, None):
        try:
            if task.shard != path:
                if fd is not None:
                    os.close(fd)
                path = task.shard
                fd = open_owned(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                size = os.fstat(fd).st_size
            out = ShardAppender(fd)
            error = np.zeros((2, task.slots)) if codec.kind == "fp8" else None
            res = pack(task, codec, out, error)
            if isinstance(res, str):
                if out.length:  # refused after streaming: its bytes leave the shard again
                    os.ftruncate(fd, size)
                outbox.put(Refused(task.tid, res))
                continue
            if sync:
                os.fdatasync(fd)
            err = tuple(map(tuple, error.tolist())) if error is not None else None
            outbox.put(Packed(task.tid, os.path.basename(path), size, out.length, out.crc, res, err))
            size += out.length
        except OSError as e:  # e.g. ENOSPC: the packer stops the run, resume redoes the sample
            size = os.fstat(fd).st_size if fd is not None else 0
            outbox.put(DiskError(task.tid, e.errno, e.strerror, e.filename))
        except Exception:  # a bug: the run stops loudly; the shard keeps only whole records
            if fd is not None:
                os.ftruncate(fd, size)
            outbox.put(WorkerBug(task.tid, traceback.format_exc()))
    if fd is not None:
        os.close(fd)
