"""Sample records: one self-describing zstd stream per sample (shard format v2, docs/FORMAT.md).

A record decompresses to   u32 header_len | header (JSON) | tensor bytes ...
so a shard can be read (and repaired) without its index, and one sample is read without touching
any other. 16-bit tensors may be stored as byte planes (all high bytes, then all low bytes): the
high byte of a bf16 holds the sign and most of the exponent and compresses ~3x on its own; the low
byte (one exponent bit, seven mantissa bits) is noise to any coder (7.97 bits/byte on real
activations). So a v2 record is two zstd frames, their contents concatenated: frame A (compressed)
carries everything up to the last tensor's high plane, frame B carries that tensor's low plane in
raw blocks, written and read at memory speed instead of spending a third of the packer's time on
a coder that saves 0.3 %. A v3 record then ends with a zstd skippable frame holding the low plane's
crc32, so a scan without the index tells a damaged frame B. v1 records (one frame) and v2 records (no
check frame) are still read.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import mmap
import struct
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import zstandard as zstd

from ..errors import UserError
from . import fp8

try:  # the same CRC-32 as zlib's, SIMD: 7.3 GB/s against 1.9 on one core (it checksums every stored byte)
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; plain zlib gives equal values
    from zlib import crc32

try:  # the planes joined in one vectorised pass (_join.c): ~2x numpy's two, built where a C compiler is
    from ._join import join as _compiled_join
except ImportError:  # no compiler at install time: numpy's join below, same words
    _compiled_join = None
JOIN = "compiled" if _compiled_join is not None else "numpy"  # which one decode uses (bench/reader.py prints it)

FORMAT_VERSION = 3  # a record's own version (its header's "v"); a set's identity keeps SET_FORMAT
SET_FORMAT = 2  # index, manifest and shard layout: unchanged by v3 records, so a v2 set goes on as it is
READS = (1, 2, 3)
# frame B: a zstd frame of raw blocks (RFC 8878 3.1.1): magic, descriptor 0xE0 (single segment, 8-byte
# content size, no zstd checksum), then blocks of at most 128 KiB
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
RAW_BLOCK = 128 << 10
# v3: after frame B, a zstd skippable frame (RFC 8878 3.1.2: magic, u32 size 4) holding the crc32 of the
# low plane, so a scan without the index tells a damaged frame B (stock zstd skips the frame)
CHECK_MAGIC = b"\x50\x2a\x4d\x18" + struct.pack("<I", 4)
CHECK_BYTES = 12
TRANSFORMS = ("none", "byteplane")
# numpy has no bfloat16: bf16 travels as its raw 16 bits and is viewed back in the reader.
DTYPES = {
    "bfloat16": np.uint16,
    "float16": np.float16,
    "float32": np.float32,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "float8_e4m3fn": np.uint8,  # the fp8 codec's codes, one byte each (fp8.py)
}
ITEMSIZE = {name: np.dtype(t).itemsize for name, t in DTYPES.items()}


class CorruptRecord(UserError, ValueError):
    """A stored sample fails its checksum or cannot be decoded."""


def split_into(words: np.ndarray, hi: np.ndarray, lo: np.ndarray, tmp: np.ndarray) -> None:
    """16-bit words -> their high bytes into `hi`, low bytes into `lo` (tmp: scratch, words' size).
    A shift and two narrowing assignments: vectorised, unlike a strided byte gather."""
    np.right_shift(words, 8, out=tmp)
    hi[...] = tmp
    lo[...] = words


def split_planes(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """16-bit little-endian words -> (high bytes, low bytes), each contiguous and flat."""
    w = buf.reshape(-1).view(np.uint16)
    hi, lo = np.empty(w.size, np.uint8), np.empty(w.size, np.uint8)
    split_into(w, hi, lo, np.empty_like(w))
    return hi, lo


def from_planes(high: np.ndarray, low: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """High bytes and low bytes (one shape) -> 16-bit words of that shape, into `out` if given.
    Compiled when built and every array is contiguous; else a shift and an or, vectorised (strided
    byte stores are not)."""
    if out is None:
        out = np.empty(high.shape, np.uint16)
    if _compiled_join is not None and high.flags.c_contiguous and low.flags.c_contiguous and out.flags.c_contiguous:
        _compiled_join(high, low, out)  # checks the three sizes agree
        return out
    np.left_shift(high, 8, out=out, dtype=np.uint16)
    return np.bitwise_or(out, low, out=out)


# bf16 byte planes are near-i.i.d. symbols: an LZ match finder costs time and finds little, and each
# match it takes is a literal not Huffman-coded. The fast strategy with a 64-entry table and 7-byte
# matches leaves almost everything to the entropy coder: 2.3x faster than level 1 and a better ratio
# (docs/benchmarks.md, bench/codec.py). The frames are ordinary zstd: decoding is unchanged.
ENTROPY_ONLY = dict(
    strategy=zstd.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0
)


FP8_CODES = "hidden_fp8"  # fp8.CODE (fp8.py imports this module's split_planes)
KINDS = ("lossless", "fp8")  # shards.codec: bf16 bytes as they are, or e4m3 with a scale per token and slot


@dataclass
class Codec:
    level: int = 3
    transform: str = "byteplane"  # for encode(): the packer always writes byte planes (docs/FORMAT.md)
    entropy_only: bool = False  # ENTROPY_ONLY parameters instead of `level`
    threads: int = 0  # zstd's own worker threads per frame; the packer parallelises across samples
    kind: str = "lossless"  # or fp8: `hidden` stored as hidden_fp8 + hidden_scale (fp8.py)

    def __post_init__(self):
        if self.transform not in TRANSFORMS:
            raise ValueError(f"Codec.transform must be one of {TRANSFORMS}, got {self.transform!r}")
        if self.kind not in KINDS:
            raise ValueError(f"Codec.kind must be one of {KINDS}, got {self.kind!r}")

    def compressor(self) -> zstd.ZstdCompressor:
        if self.entropy_only:
            params = zstd.ZstdCompressionParameters(**ENTROPY_ONLY, write_checksum=True, threads=self.threads)
            return zstd.ZstdCompressor(compression_params=params)
        return zstd.ZstdCompressor(level=self.level, write_checksum=True, threads=self.threads)

    def encode(self, meta: dict, tensors: dict[str, tuple]) -> bytes:
        """One record, as bytes (see encode_to)."""
        sink = io.BytesIO()
        self.encode_to(sink, meta, tensors)
        return sink.getvalue()

    def encode_to(self, sink, meta: dict, tensors: dict[str, tuple]) -> None:
        """Compress one sample straight into `sink` (anything with write()), whole arrays in hand
        (the packer streams its planes into a RecordWriter instead). tensors: name -> (dtype, array)."""
        if self.kind == "fp8" and "hidden" in tensors:
            tensors = fp8_tensors(tensors)
        specs, data = {}, []
        for name, (dtype, arr) in tensors.items():
            arr = np.ascontiguousarray(arr)
            if arr.dtype != DTYPES[dtype]:
                same = arr.itemsize == np.dtype(DTYPES[dtype]).itemsize
                arr = arr.view(DTYPES[dtype]) if same else arr.astype(DTYPES[dtype])
            split = self.transform == "byteplane" and arr.itemsize == 2
            planes = list(split_planes(arr)) if split else [arr.reshape(-1).view(np.uint8)]
            specs[name] = (dtype, arr.shape, "byteplane" if split else "none")
            data += planes
        rec = RecordWriter(self, sink, meta, specs)
        for d in data[:-1] if rec.tail_bytes else data:
            rec.write(d)
        if rec.tail_bytes:
            rec.write_tail(data[-1])
        rec.close()


def fp8_tensors(tensors: dict) -> dict:
    """`hidden` (bf16 [T, S, H]) as the fp8 codec stores it: grouped split codes and scales [T, S]."""
    out = dict(tensors)
    dtype, arr = out.pop("hidden")
    words = np.ascontiguousarray(arr).view(np.uint16)
    hi, lo = split_planes(words)
    exp, sm, scales, _, _ = fp8.quantize(hi, lo, words.shape[-1])
    out[fp8.CODE] = ("float8_e4m3fn", fp8.grouped(exp, sm, words.shape).reshape(words.shape))
    out[fp8.SCALE] = ("float32", scales.reshape(words.shape[:-1]))
    return out


def _writev(sink, bufs) -> None:
    if hasattr(sink, "writev"):
        sink.writev(bufs)
    else:
        for b in bufs:
            sink.write(b)


class RecordWriter:
    """One record written in body order as its bytes arrive, so no sample is ever held whole:
    write() feeds frame A (header first, then each tensor's bytes), write_tail() the last tensor's
    low plane into frame B. specs: name -> (dtype, shape, "byteplane" | "none"), in body order."""

    def __init__(self, codec: Codec, sink, meta: dict, specs: dict):
        tensors, off = [], 0
        for name, (dtype, shape, transform) in specs.items():
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(DTYPES[dtype]).itemsize
            tensors.append(
                dict(name=name, dtype=dtype, shape=list(shape), offset=off, nbytes=nbytes, transform=transform)
            )
            off += nbytes
        last = tensors[-1] if tensors else None
        self.tail_bytes = last["nbytes"] // 2 if last and last["transform"] == "byteplane" else 0
        header = json.dumps(
            {"v": FORMAT_VERSION, "meta": meta, "tensors": tensors, "tail": self.tail_bytes}, separators=(",", ":")
        ).encode()
        self.sink, self.tail_written, self.body_left, self.tail_crc = sink, 0, off - self.tail_bytes, 0
        self._w = codec.compressor().stream_writer(
            sink, size=4 + len(header) + self.body_left, write_size=1 << 20, closefd=False
        )
        self._w.write(struct.pack("<I", len(header)) + header)
        self._carry = bytearray()

    def write(self, data) -> None:
        view = memoryview(data).cast("B")
        self.body_left -= len(view)
        self._w.write(view)

    def write_tail(self, data) -> None:
        """The low plane, in order, in any pieces: cut into full raw blocks, the last one flagged."""
        if self._w is not None:
            if self.body_left:
                raise ValueError(f"record body is {self.body_left} bytes short before its tail")
            # Closed only when complete: if the sink failed (a full disk), closing a cut-short frame
            # raises zstd's "Src size is incorrect" and hides the OSError the packer stops on cleanly.
            self._w.close()
            self._w = None
            _writev(self.sink, [ZSTD_MAGIC + b"\xe0" + struct.pack("<Q", self.tail_bytes)])
        view = memoryview(data).cast("B")
        if self.tail_written + len(self._carry) + len(view) > self.tail_bytes:
            raise ValueError("record tail is longer than its header says")
        if self._carry:
            take = RAW_BLOCK - len(self._carry)
            self._carry += view[:take]
            view = view[take:]
            if len(self._carry) == RAW_BLOCK or self.tail_written + len(self._carry) == self.tail_bytes:
                self._blocks([memoryview(self._carry)])
                self._carry = bytearray()
        full = len(view) // RAW_BLOCK
        if full:
            self._blocks([view[i * RAW_BLOCK : (i + 1) * RAW_BLOCK] for i in range(full)])
        rest = view[full * RAW_BLOCK :]
        if len(rest) and self.tail_written + len(rest) == self.tail_bytes:
            self._blocks([rest])
        else:
            self._carry += rest

    def _blocks(self, blocks) -> None:
        bufs = []
        for b in blocks:
            self.tail_written += len(b)
            self.tail_crc = crc32(b, self.tail_crc)
            last = int(self.tail_written == self.tail_bytes)
            bufs += [((len(b) << 3) | last).to_bytes(3, "little"), b]
        if self.tail_written == self.tail_bytes:  # the low plane's crc32, in a skippable frame (v3)
            bufs.append(CHECK_MAGIC + struct.pack("<I", self.tail_crc))
        _writev(self.sink, bufs)

    def close(self) -> None:
        if self._w is not None:  # no tail
            if self.body_left or self.tail_bytes:
                raise ValueError("record closed before all its bytes were written")
            self._w.close()
            self._w = None
        elif self.tail_written != self.tail_bytes:
            raise ValueError(f"record tail is {self.tail_bytes - self.tail_written} bytes short")


def trailer(header: dict) -> int:
    """The bytes after frame B: a v3 record's check frame, none before v3."""
    return CHECK_BYTES if header.get("tail") and (header.get("v") or 0) >= 3 else 0


def raw_tail(frame, n: int, after: int = 0):
    """The n bytes of a record's frame B (raw blocks, at the end of `frame` but for `after` bytes), as
    a list of numpy views: one [blocks, RAW_BLOCK] array of the full blocks and the last block, no copies."""
    blocks = max(1, -(-n // RAW_BLOCK))
    size = 13 + 3 * blocks + n
    b = np.frombuffer(frame, np.uint8)
    b = b[: b.size - after]
    if b.size < size or bytes(b[-size : -size + 5]) != ZSTD_MAGIC + b"\xe0":
        raise CorruptRecord("record has no raw tail frame where its header says")
    t = b[-size:]
    if int.from_bytes(t[5:13].tobytes(), "little") != n:
        raise CorruptRecord("raw tail frame holds another size than the header says")
    full = t[13 : 13 + (blocks - 1) * (RAW_BLOCK + 3)].reshape(blocks - 1, RAW_BLOCK + 3)
    want = ((RAW_BLOCK << 3).to_bytes(3, "little"), (((n - (blocks - 1) * RAW_BLOCK) << 3) | 1).to_bytes(3, "little"))
    last = t[13 + (blocks - 1) * (RAW_BLOCK + 3) :]
    if (full.size and not (full[:, :3] == np.frombuffer(want[0], np.uint8)).all()) or last[:3].tobytes() != want[1]:
        raise CorruptRecord("raw tail frame is not in full raw blocks")
    return [full[:, 3:], last[3:]]


_local = threading.local()
scan_json = json.JSONDecoder().raw_decode  # json.loads's C scanner without its per-call checks


def _decompressor() -> zstd.ZstdDecompressor:
    """This thread's decompressor, reused: making one allocates zstd's context (~10 µs, a quarter of
    the work on a small sample). Only for a reader that is read to its end (or dropped) before the
    next is made on the thread: a new reader resets the context under an old one."""
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstd.ZstdDecompressor()
    return d


def _read_into(r, view: memoryview) -> None:
    while len(view):
        k = r.readinto(view)
        if not k:
            raise CorruptRecord("record ends early")
        view = view[k:]


def _header(body: np.ndarray) -> tuple[dict, int]:
    """(header, offset of the first tensor byte) out of the start of a record's frame A content."""
    if body.size < 4:
        raise CorruptRecord("record ends before its header")
    (hlen,) = struct.unpack("<I", body[:4].tobytes())
    if body.size < 4 + hlen:
        raise CorruptRecord("record ends inside its header")
    text = body[4 : 4 + hlen].tobytes().decode()
    header, end = scan_json(text)
    if end != len(text):
        raise CorruptRecord("record header has bytes after its JSON")
    return header, 4 + hlen


def _stream_header(r) -> np.ndarray:
    """A record's header bytes (its length, then the header) from a stream at the record's start."""
    head = np.empty(4, np.uint8)
    _read_into(r, memoryview(head))
    size = int(head.view("<u4")[0])
    if size > 1 << 24:
        raise CorruptRecord(f"a record header of {size} bytes")
    rest = np.empty(size, np.uint8)
    _read_into(r, memoryview(rest))
    return np.concatenate([head, rest])


def record_header(frame) -> dict:
    """A record's header (its meta: id, key, ...; its tensors), decoding only the header's bytes of
    frame A: what a resume checks of every shard cheaply. Raises CorruptRecord."""
    if bytes(frame[:4]) != ZSTD_MAGIC:
        raise CorruptRecord("no record starts here (not a zstd frame)")
    try:
        return _header(_stream_header(_decompressor().stream_reader(frame)))[0]
    except (zstd.ZstdError, ValueError, EOFError) as e:
        raise CorruptRecord(f"cannot read a record header: {e}") from e


TOKENS = ("input_ids", "loss_mask")  # the first two tensors of every record the packer writes


def record_tokens(source) -> tuple[np.ndarray, np.ndarray]:
    """A sample's token ids and loss mask, decoding frame A only up to their end (the header and a few
    bytes a token): what the set's token counts read of a stored sample. `source`: the record's bytes,
    or a file positioned at its start (read as far as needed, not to the record's end)."""
    try:
        r = _decompressor().stream_reader(source, read_across_frames=False, closefd=False)
        header, _ = _header(_stream_header(r))
        tensors = _token_tensors(header)
        body = np.empty(tensors[1]["offset"] + tensors[1]["nbytes"], np.uint8)
        _read_into(r, memoryview(body))
        return _tokens(tensors, body, 0)
    except (zstd.ZstdError, ValueError, EOFError, KeyError, TypeError) as e:
        if isinstance(e, CorruptRecord):
            raise
        raise CorruptRecord(f"cannot read a record's tokens: {e}") from e


def tail_frame_follows(frame: bytes) -> bool:
    """For a scan without the index: does this record's frame A announce a frame B after it?"""
    return bool(record_header(frame).get("tail"))


CHUNK = 2 * RAW_BLOCK  # values joined at a time: the high bytes are read while still in cache


class Recycler:
    """Decode memory handed back once nothing uses it: frame A's content (dropped when decode
    returns) and the output words (once the caller drops every view). A fresh 134 MB array costs
    the kernel a page fault and a zeroed page per 4 KiB on first write, ~a fifth of a decode
    (docs/benchmarks.md); reused memory costs neither. take() returns a new array over a block's
    memory; a finalizer on that array gives the block back when it dies, which is only once every
    view of it is gone (numpy points a view's base at it, torch.from_numpy holds it): so two
    threads decoding at once never share a block. Thread-safe; at most `keep` free blocks are held."""

    ROUND = 16 << 20  # blocks are rounded up: samples vary in length
    # Below this, fresh memory: under glibc's mmap threshold (128 KiB) malloc reuses freed heap
    # pages, and keeping a block (a lock, a finalizer) would cost more than it saves: ~8 µs a
    # sample on a set of short chats.
    SMALL = 64 << 10

    def __init__(self, keep: int = 2):
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, n: int, dtype=np.uint16) -> np.ndarray:
        nbytes = n * np.dtype(dtype).itemsize
        if nbytes < self.SMALL:
            return np.empty(n, dtype)
        with self._lock:
            fits = [m for m in self._free if len(m) >= nbytes]
            # the smallest; of equals the first given back: frame A's block comes back (at decode's
            # return) before the output's, so each block keeps its role from sample to sample
            block = min(fits, key=len) if fits else None
            if block is not None:
                self._free.remove(block)
        if block is None:  # private: a forked DataLoader worker writing into it must not write into ours
            block = mmap.mmap(-1, max(1, -(-nbytes // self.ROUND) * self.ROUND), flags=mmap.MAP_PRIVATE)
            if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks for its own large arrays: fewer TLB misses
                block.madvise(mmap.MADV_HUGEPAGE)
        arr = np.frombuffer(block, dtype, count=n)  # its base is the mapping, so views collapse onto arr
        weakref.finalize(arr, self._give, block)
        return arr

    def _give(self, block: mmap.mmap) -> None:
        with self._lock:
            self._free.append(block)
            if len(self._free) > self.keep:
                self._free.remove(min(self._free, key=len))


def decode(frame, expected_crc: int | None = None, recycler: Recycler | None = None, release=None) -> tuple[dict, dict]:
    """One record -> (meta, name -> numpy array; bf16 as uint16 bits). Raises CorruptRecord.
    recycler: where frame A's content and the 16-bit outputs are decoded into (a reader's own);
    fresh memory if None. release(start, end): the caller may drop frame[start:end] from memory (a
    reader's mapped pages); given, a v2 record is decoded in steps (`_decode_in_steps`), so a
    sample of gigabytes needs little beyond its output."""
    header = _tail_header(frame) if release is not None else None
    if header is not None:
        pages = _Pages(frame, release)
        try:
            meta, out = _decode_in_steps(frame, header, pages, recycler, release)
        except CorruptRecord:
            pages.check_to(len(frame))  # damaged bytes: say so, rather than what they broke
            _check_crc(pages.crc, expected_crc)
            raise
        pages.check_to(len(frame))
        _check_crc(pages.crc, expected_crc)
        return meta, out
    take = recycler.take if recycler is not None else np.empty
    with _as_corrupt():
        header, body, off = _frame_a(frame, expected_crc, take)
        out, tail = {}, _tail_tensor(header)
        for t in header["tensors"]:
            if t is tail:
                n = math.prod(t["shape"])
                arr, off = _join(body[off : off + n], _low_plane(frame, header, n), take(n, np.uint16)), off + n
                arr = arr.view(DTYPES[t["dtype"]]).reshape(t["shape"])
            elif t["name"] == FP8_CODES:  # read in place: dequantized below, while body is alive
                arr, off = body[off : off + t["nbytes"]].reshape(t["shape"]), off + t["nbytes"]
            else:
                arr, off = _tensor(body, off, t, take)
            out[t["name"]] = arr
        _dequantized(out, take)
    return header["meta"], out


def _dequantized(out: dict, take) -> None:
    """An fp8 record's codes and scales -> `hidden`, bf16 words as a lossless record has them: every
    reader gets bf16 without being told."""
    if fp8.CODE not in out:
        return
    codes, scales = out.pop(fp8.CODE), out.pop(fp8.SCALE, None)
    if scales is None or codes.ndim != 3 or scales.shape != codes.shape[:2] or codes.shape[-1] % 2:
        raise CorruptRecord(f"fp8 codes {list(codes.shape)} without their scales [T, S]")
    out["hidden"] = fp8.dequantize_record(codes, scales, codes.shape, take(codes.size, np.uint16))


def hidden_shape(header: dict) -> tuple | None:
    """The shape of a record's `hidden` ([T, S, H]), lossless or fp8."""
    shapes = {t["name"]: tuple(t["shape"]) for t in header.get("tensors") or ()}
    return shapes.get("hidden") or shapes.get(fp8.CODE)


def _token_tensors(header: dict) -> list[dict]:
    tensors = header["tensors"][:2]
    if [t["name"] for t in tensors] != list(TOKENS) or any(t["transform"] != "none" for t in tensors):
        raise CorruptRecord(f"record does not start with {TOKENS}")
    return tensors


def _tokens(tensors: list[dict], body: np.ndarray, off: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask), copied out of frame A's content whose tensors start at `off`."""
    return tuple(_tensor(body, off + t["offset"], t, None)[0] for t in tensors)


def check(frame, expected_crc: int | None = None, recycler: Recycler | None = None) -> dict:
    """What decode() refuses, refused, without building the arrays -> the record's header: its crc32,
    frame A decoded whole (zstd's own checksum, the size its header states) and frame B's blocks and
    size. verify's check: the planes are not joined into words, which only a reader needs
    (docs/benchmarks.md, verify against the reader's decode)."""
    with _as_corrupt():
        return _checked(frame, expected_crc, recycler)[0]


def check_tokens(frame, expected_crc: int | None = None, recycler: Recycler | None = None) -> tuple[dict, tuple]:
    """check() -> (the header, (ids, loss mask)): what record_tokens reads, from the frame A that
    check decoded (verify counts every record's tokens without decoding it twice)."""
    with _as_corrupt():  # one guard for both: on a short sample it costs as much as a check
        header, body, off = _checked(frame, expected_crc, recycler)
        return header, _tokens(_token_tensors(header), body, off)


def _checked(frame, expected_crc: int | None, recycler: Recycler | None) -> tuple[dict, np.ndarray, int]:
    header, body, off = _frame_a(frame, expected_crc, recycler.take if recycler is not None else np.empty)
    tail = _tail_tensor(header)
    if tail is not None:
        _low_plane(frame, header, math.prod(tail["shape"]))
    _check_fp8_shapes(header)
    return header, body, off


def _check_fp8_shapes(header: dict) -> None:
    shapes = {t["name"]: list(t["shape"]) for t in header["tensors"]}
    if fp8.CODE in shapes and (len(shapes[fp8.CODE]) != 3 or shapes.get(fp8.SCALE) != shapes[fp8.CODE][:2]):
        raise CorruptRecord(f"fp8 codes {shapes[fp8.CODE]} without their scales [T, S]")


@contextlib.contextmanager
def _as_corrupt():
    """Errors met in a record's bytes (zstd's, the parsers') raised as CorruptRecord."""
    try:
        yield
    except CorruptRecord:
        raise
    except (zstd.ZstdError, struct.error, ValueError) as e:
        raise CorruptRecord(f"cannot decode sample frame: {e}") from e


def _frame_a(frame, expected_crc: int | None, take) -> tuple[dict, np.ndarray, int]:
    """The record's crc32 checked, then frame A whole, in one read into a buffer of its content size
    (zstd then decodes straight into it rather than through its window buffer and a copy) -> (header,
    frame A's content, the offset of its first tensor byte). Frame B is ours."""
    if expected_crc is not None:
        _check_crc(crc32(frame), expected_crc)
    size = zstd.frame_content_size(frame)
    if size < 0:
        raise CorruptRecord("record's frame A does not state its size")
    body = take(size, np.uint8)
    _read_into(_decompressor().stream_reader(frame, read_size=len(frame)), memoryview(body))
    header, off = _header(body)
    if header.get("v") not in READS:
        raise CorruptRecord(f"record format v{header.get('v')}; this reader knows {READS}")
    _check_sizes(header)
    said = off + sum(t["nbytes"] for t in header["tensors"]) - header.get("tail", 0)
    if said != size:  # zstd's reader would run on into frame B
        raise CorruptRecord(f"frame A holds {size} bytes, its header says {said}")
    return header, body, off


def _check_sizes(header: dict) -> None:
    """Each tensor's stated byte count is its shape's in its dtype: what decode's arrays take, and all
    of what check() learns of a tensor it does not build."""
    for t in header["tensors"]:
        if t.get("dtype") not in DTYPES:
            raise CorruptRecord(
                f"tensor {t.get('name')} has dtype {t.get('dtype')}; this reader knows {sorted(DTYPES)}"
            )
        if t["nbytes"] != math.prod(t["shape"]) * ITEMSIZE[t["dtype"]]:
            raise CorruptRecord(f"tensor {t['name']} states {t['nbytes']} bytes for {t['dtype']} {t['shape']}")


def _tail_tensor(header: dict) -> dict | None:
    """The tensor whose low plane is frame B (the last, byte-planed, in a record with a tail), or None."""
    last = header["tensors"][-1] if header["tensors"] else None
    return last if last is not None and last["transform"] == "byteplane" and header.get("tail") else None


def check_tail(frame, header: dict) -> None:
    """A v3 record's low plane against the crc32 its check frame holds: what tells a damaged frame B
    where no index line gives the record's crc32 (a scan). Raises CorruptRecord."""
    k = trailer(header)
    if not k:
        return
    end = bytes(frame[len(frame) - k :])
    if len(frame) < k or end[:8] != CHECK_MAGIC:
        raise CorruptRecord("record has no tail check frame where its header says")
    full, last = raw_tail(frame, header["tail"], k)
    got = 0
    for row in full:
        got = crc32(row, got)
    if crc32(last, got) != int.from_bytes(end[8:], "little"):
        raise CorruptRecord("the low plane (frame B) fails its crc32")


def _low_plane(frame, header: dict, n: int) -> list:
    """Frame B's blocks (raw_tail), holding the low bytes of the tail tensor's n values."""
    full, last = raw_tail(frame, header["tail"], trailer(header))
    if full.size + last.size != n:
        raise CorruptRecord(f"low plane holds {full.size + last.size} bytes for {n} values")
    return [full, last]


STEP = 64 * RAW_BLOCK  # values decoded and joined at a time by _decode_in_steps (8 MiB of high bytes)


def _check_crc(got: int, expected: int | None) -> None:
    if expected is not None and got != expected:
        raise CorruptRecord(f"crc32 mismatch (stored {expected:#010x}, read {got:#010x})")


def _tail_header(frame) -> dict | None:
    """The header of a record whose last tensor's low plane is frame B (decodable in steps), else None."""
    try:
        header = record_header(frame)
    except CorruptRecord:
        return None  # the whole decode says what is wrong
    return header if header.get("tail") else None


class _Pages:
    """Frame A handed to zstd a piece at a time; a piece's pages are let go when zstd asks for the
    next one (it has consumed the last by then). The frame's crc32 is taken in order, as each byte
    is first used (check_to), so the pages are read once."""

    def __init__(self, frame, release):
        self.frame, self.release = frame, release
        self.pos = self.prev = self.checked = self.crc = 0

    def check_to(self, end: int) -> None:
        if end > self.checked:
            self.crc, self.checked = crc32(self.frame[self.checked : end], self.crc), end

    def read(self, n: int = -1):
        self.release(self.prev, self.pos)
        self.prev, self.pos = self.pos, len(self.frame) if n < 0 else min(len(self.frame), self.pos + n)
        self.check_to(self.pos)
        return self.frame[self.prev : self.pos]


def _decode_in_steps(frame, header: dict, pages: _Pages, recycler: Recycler | None, release) -> tuple[dict, dict]:
    """decode() for a v2 record, holding at once only its output, what precedes the last tensor's
    high plane, and STEP values of that plane with their low bytes: the high plane is decompressed
    STEP values at a time and joined with frame B's blocks, each page released once passed. The
    caller checks the crc32 that `pages` took on the way."""
    take = recycler.take if recycler is not None else np.empty
    *firsts, last = header["tensors"]
    n = math.prod(last["shape"])
    with _as_corrupt():
        size = zstd.frame_content_size(frame)
        if header.get("v") not in READS or last["transform"] != "byteplane" or not 0 <= n <= size:
            raise CorruptRecord("record's tail does not follow a byte-planed last tensor")
        _check_sizes(header)
        r = zstd.ZstdDecompressor().stream_reader(pages, read_size=1 << 20)
        head = take(size - n, np.uint8)  # the header and every tensor before the last one's high plane
        _read_into(r, memoryview(head))
        off = _header(head)[1]
        if off + sum(t["nbytes"] for t in firsts) + n != size:
            raise CorruptRecord(f"frame A holds {size} bytes, its header says otherwise")
        out = {}
        for t in firsts:
            arr, off = _tensor(head, off, t, take)
            out[t["name"]] = arr
        full, tail = _low_plane(frame, header, n)
        b_start = len(frame) - trailer(header) - (13 + 3 * (full.shape[0] + 1) + n)  # 13-byte head, 3-byte blocks
        words, high = take(n, np.uint16), np.empty(min(STEP, n), np.uint8)
        for a in range(0, n, STEP):
            k = min(STEP, n - a)
            _read_into(r, memoryview(high[:k]))
            b0, b1 = a // RAW_BLOCK, min(full.shape[0], (a + k) // RAW_BLOCK)
            pages.check_to(len(frame) if a + k == n else b_start + 13 + b1 * (RAW_BLOCK + 3))
            _join(high[:k], [full[b0:b1], tail if a + k == n else tail[:0]], words[a : a + k])
            release(b_start + 13 + b0 * (RAW_BLOCK + 3), b_start + 13 + b1 * (RAW_BLOCK + 3))
        out[last["name"]] = words.view(DTYPES[last["dtype"]]).reshape(last["shape"])
    return header["meta"], out


def _tensor(body: np.ndarray, off: int, t: dict, take) -> tuple[np.ndarray, int]:
    """One tensor held whole in frame A's content at `off` -> (array, the offset after it)."""
    if t["transform"] != "byteplane":
        arr, off = body[off : off + t["nbytes"]].copy(), off + t["nbytes"]
    else:
        n = math.prod(t["shape"])  # per record and tensor: numpy's prod costs microseconds here
        arr, off = from_planes(body[off : off + n], body[off + n : off + 2 * n], take(n, np.uint16)), off + 2 * n
    return arr.view(DTYPES[t["dtype"]]).reshape(t["shape"]), off


def _join(high: np.ndarray, low: list, out: np.ndarray) -> np.ndarray:
    """The high plane and frame B's raw blocks -> `out`, [n] 16-bit words, CHUNK values at a time so
    each chunk's high bytes are joined with their low bytes while in cache."""
    full, last, n = *low, out.size
    if full.size + last.size != n:
        raise CorruptRecord(f"low plane holds {full.size + last.size} bytes for {n} values")
    # compiled: a block at a time, each contiguous (frame B's 3-byte block headers sit between them)
    rows = 1 if _compiled_join is not None else CHUNK // RAW_BLOCK
    for r0 in range(0, full.shape[0], rows):  # full blocks, [rows, RAW_BLOCK] at a time
        lo = full[r0 : r0 + rows]
        s = slice(r0 * RAW_BLOCK, r0 * RAW_BLOCK + lo.size)
        from_planes(high[s].reshape(lo.shape), lo, out[s].reshape(lo.shape))
    from_planes(high[full.size :], last, out[full.size :])
    return out
