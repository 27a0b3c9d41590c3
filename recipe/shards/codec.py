"""Sample records: one self-describing zstd frame per sample (shard format v1, docs/FORMAT.md).

A frame decompresses to   u32 header_len | header (JSON) | tensor bytes ...
so a shard can be read (and repaired) without its index, and one sample is read without touching
any other. 16-bit tensors may be stored as byte planes (all high bytes, then all low bytes): the
high byte of a bf16 holds the sign and most of the exponent and compresses far better on its own.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard as zstd

FORMAT_VERSION = 1
TRANSFORMS = ("none", "byteplane")
# numpy has no bfloat16: bf16 travels as its raw 16 bits and is viewed back in the reader.
DTYPES = {
    "bfloat16": np.uint16,
    "float16": np.float16,
    "float32": np.float32,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
}


class CorruptRecord(ValueError):
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


def from_planes(raw: memoryview | bytes, n_items: int) -> np.ndarray:
    """[2n] bytes, high plane first -> [n] 16-bit words."""
    b = np.frombuffer(raw, np.uint8, count=2 * n_items)
    out = b[:n_items].astype(np.uint16)
    out <<= 8
    out |= b[n_items:]
    return out


# bf16 byte planes are near-i.i.d. symbols: an LZ match finder costs time and finds little, and each
# match it takes is a literal not Huffman-coded. The fast strategy with a 64-entry table and 7-byte
# matches leaves almost everything to the entropy coder: 2.3x faster than level 1 and a better ratio
# (docs/benchmarks.md, bench/codec.py). The frames are ordinary zstd: decoding is unchanged.
ENTROPY_ONLY = dict(
    strategy=zstd.STRATEGY_FAST, window_log=17, hash_log=6, chain_log=6, search_log=1, min_match=7, target_length=0
)


@dataclass
class Codec:
    level: int = 3
    transform: str = "byteplane"
    entropy_only: bool = False  # ENTROPY_ONLY parameters instead of `level`
    threads: int = 0  # zstd's own worker threads per frame; the packer parallelises across samples

    def __post_init__(self):
        if self.transform not in TRANSFORMS:
            raise ValueError(f"shards.transform must be one of {TRANSFORMS}, got {self.transform!r}")

    def compressor(self) -> zstd.ZstdCompressor:
        if self.entropy_only:
            params = zstd.ZstdCompressionParameters(**ENTROPY_ONLY, write_checksum=True, threads=self.threads)
            return zstd.ZstdCompressor(compression_params=params)
        return zstd.ZstdCompressor(level=self.level, write_checksum=True, threads=self.threads)

    def encode(self, meta: dict, tensors: dict[str, tuple]) -> bytes:
        """One zstd frame, as bytes (see encode_to)."""
        sink = io.BytesIO()
        self.encode_to(sink, meta, tensors)
        return sink.getvalue()

    def encode_to(self, sink, meta: dict, tensors: dict[str, tuple]) -> None:
        """Compress one sample as one zstd frame straight into `sink` (anything with write()).
        tensors: name -> (dtype name, array), or (dtype name, (high, low) planes, shape) for a
        16-bit tensor already split (the packer splits once, to validate on the high bytes)."""
        parts, specs, off = [], [], 0
        for name, (dtype, arr, *shape) in tensors.items():
            if isinstance(arr, tuple):
                data, transform, shape = list(arr), "byteplane", list(shape[0])
            else:
                arr = np.ascontiguousarray(arr)
                if arr.dtype != DTYPES[dtype]:
                    same = arr.itemsize == np.dtype(DTYPES[dtype]).itemsize
                    arr = arr.view(DTYPES[dtype]) if same else arr.astype(DTYPES[dtype])
                transform = self.transform if arr.itemsize == 2 else "none"
                data = list(split_planes(arr)) if transform == "byteplane" else [arr.reshape(-1).view(np.uint8)]
                shape = list(arr.shape)
            nbytes = sum(d.nbytes for d in data)
            specs.append(
                {
                    "name": name,
                    "dtype": dtype,
                    "shape": shape,
                    "offset": off,
                    "nbytes": int(nbytes),
                    "transform": transform,
                }
            )
            parts += data
            off += nbytes
        header = json.dumps({"v": FORMAT_VERSION, "meta": meta, "tensors": specs}, separators=(",", ":")).encode()
        # streamed into one frame and on into the sink: no joined copy of the body or the frame
        w = self.compressor().stream_writer(sink, size=4 + len(header) + off, write_size=1 << 20, closefd=False)
        w.write(struct.pack("<I", len(header)) + header)
        for p in parts:
            w.write(memoryview(p))
        # Closed only when complete: if the sink failed (a full disk), closing the cut-short frame would
        # raise zstd's "Src size is incorrect" and hide the OSError that the packer turns into a clean stop.
        w.close()


def decode(frame: bytes, crc32: int | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """One frame -> (meta, name -> numpy array; bf16 as uint16 bits). Raises CorruptRecord."""
    if crc32 is not None and zlib.crc32(frame) != crc32:
        raise CorruptRecord(f"crc32 mismatch (stored {crc32:#010x}, read {zlib.crc32(frame):#010x})")
    try:
        body = memoryview(zstd.ZstdDecompressor().decompress(frame))
        (hlen,) = struct.unpack_from("<I", body, 0)
        header = json.loads(bytes(body[4 : 4 + hlen]))
    except (zstd.ZstdError, struct.error, ValueError) as e:
        raise CorruptRecord(f"cannot decode sample frame: {e}") from e
    base, out = 4 + hlen, {}
    for t in header["tensors"]:
        raw = body[base + t["offset"] : base + t["offset"] + t["nbytes"]]
        dt = np.dtype(DTYPES[t["dtype"]])
        n = int(np.prod(t["shape"], dtype=np.int64))
        if t["transform"] == "byteplane":
            arr = from_planes(raw, n).view(dt)
        else:
            arr = np.frombuffer(raw, dt, count=n)
        out[t["name"]] = arr.reshape(t["shape"])
    return header["meta"], out
