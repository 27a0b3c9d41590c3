"""Sample records: one self-describing zstd frame per sample (shard format v1, docs/FORMAT.md).

A frame decompresses to   u32 header_len | header (JSON) | tensor bytes ...
so a shard can be read (and repaired) without its index, and one sample is read without touching
any other. 16-bit tensors may be stored as byte planes (all high bytes, then all low bytes): the
high byte of a bf16 holds the sign and most of the exponent and compresses far better on its own.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import zstandard as zstd

FORMAT_VERSION = 1
TRANSFORMS = ("none", "byteplane")
# numpy has no bfloat16: bf16 travels as its raw 16 bits and is viewed back in the reader.
DTYPES = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32,
          "int32": np.int32, "int64": np.int64, "uint8": np.uint8}


class CorruptRecord(ValueError):
    """A stored sample fails its checksum or cannot be decoded."""


def planes(buf: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n] 16-bit little-endian words -> (high bytes, low bytes), each contiguous."""
    b = buf.view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(b[:, 1]), np.ascontiguousarray(b[:, 0])


def to_planes(buf: np.ndarray) -> np.ndarray:
    """[n] 16-bit -> [2n] bytes: high bytes first."""
    return np.concatenate(planes(buf))


def from_planes(raw: memoryview | bytes, n_items: int) -> np.ndarray:
    b = np.frombuffer(raw, np.uint8, count=2 * n_items)
    out = np.empty((n_items, 2), np.uint8)
    out[:, 1] = b[:n_items]
    out[:, 0] = b[n_items:]
    return out.reshape(-1)


@dataclass
class Codec:
    level: int = 3
    transform: str = "byteplane"
    threads: int = 0  # zstd's own worker threads per frame; the packer parallelises across samples

    def __post_init__(self):
        if self.transform not in TRANSFORMS:
            raise ValueError(f"shards.transform must be one of {TRANSFORMS}, got {self.transform!r}")

    def encode(self, meta: dict, tensors: dict[str, tuple[str, np.ndarray]]) -> bytes:
        """tensors: name -> (dtype name, array). Returns one zstd frame."""
        parts, specs, off = [], [], 0
        for name, (dtype, arr) in tensors.items():
            arr = np.ascontiguousarray(arr)
            if arr.dtype != DTYPES[dtype]:
                arr = arr.view(DTYPES[dtype]) if arr.itemsize == np.dtype(DTYPES[dtype]).itemsize else arr.astype(DTYPES[dtype])
            transform = self.transform if arr.itemsize == 2 else "none"
            data = list(planes(arr.reshape(-1))) if transform == "byteplane" else [arr.reshape(-1).view(np.uint8)]
            nbytes = sum(d.nbytes for d in data)
            specs.append({"name": name, "dtype": dtype, "shape": list(arr.shape), "offset": off,
                          "nbytes": int(nbytes), "transform": transform})
            parts += data
            off += nbytes
        header = json.dumps({"v": FORMAT_VERSION, "meta": meta, "tensors": specs}, separators=(",", ":")).encode()
        # streamed into one frame: no joined copy of the body is ever made
        cctx = zstd.ZstdCompressor(level=self.level, write_checksum=True, threads=self.threads)
        cobj = cctx.compressobj(size=4 + len(header) + off)
        out = [cobj.compress(struct.pack("<I", len(header)) + header)]
        out += [cobj.compress(memoryview(p)) for p in parts]
        out.append(cobj.flush())
        return b"".join(out)


def decode(frame: bytes, crc32: int | None = None) -> tuple[dict, dict[str, np.ndarray]]:
    """One frame -> (meta, name -> numpy array; bf16 as uint16 bits). Raises CorruptRecord."""
    if crc32 is not None and zlib.crc32(frame) != crc32:
        raise CorruptRecord(f"crc32 mismatch (stored {crc32:#010x}, read {zlib.crc32(frame):#010x})")
    try:
        body = memoryview(zstd.ZstdDecompressor().decompress(frame))
        (hlen,) = struct.unpack_from("<I", body, 0)
        header = json.loads(bytes(body[4:4 + hlen]))
    except (zstd.ZstdError, struct.error, ValueError) as e:
        raise CorruptRecord(f"cannot decode sample frame: {e}") from e
    base, out = 4 + hlen, {}
    for t in header["tensors"]:
        raw = body[base + t["offset"]: base + t["offset"] + t["nbytes"]]
        dt = np.dtype(DTYPES[t["dtype"]])
        n = int(np.prod(t["shape"], dtype=np.int64))
        if t["transform"] == "byteplane":
            arr = from_planes(raw, n).view(dt)
        else:
            arr = np.frombuffer(raw, dt, count=n)
        out[t["name"]] = arr.reshape(t["shape"])
    return header["meta"], out
