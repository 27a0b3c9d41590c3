"""Raw capture records: what a backend leaves in the dump directory (a RAM disk) for the packer.

One file per (request, forward pass): `{rid}.{offset:09d}.hsr`
    b"HSR2" | u32 header_len | header JSON | input_ids int32[n] | high bytes [n, slots, H] | low bytes [n, slots, H]
The hidden states (bf16, [n, slots, H]) arrive split into byte planes, the layout the shards store
(recipe.shards.codec): the SGLang hook splits them on the GPU, so the packer only streams planes.
`offset` is the request's first token in this pass (the prefix length), so chunked prefill gives
several pieces that the packer puts back in order. A failed capture leaves `{rid}.err` (JSON).
A writer about to write leaves a `.reserve-*` file, sparse, whose size is what it will write.
Every file is written under a dot-name and renamed, so the packer never sees half a file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"HSR2"
SUFFIX = ".hsr"
ERROR_SUFFIX = ".err"
RESERVATION = ".reserve-"  # a writer's claim on the dump budget, before it writes (CaptureWriter)


def record_name(rid: str, offset: int) -> str:
    return f"{rid}.{offset:09d}{SUFFIX}"


def parse_name(name: str) -> tuple[str, int] | None:
    """'<rid>.<offset>.hsr' -> (rid, offset); None for anything else (temp files, markers)."""
    if name.startswith(".") or not name.endswith(SUFFIX):
        return None
    rid, _, off = name[: -len(SUFFIX)].rpartition(".")
    return (rid, int(off)) if rid and off.isdigit() else None


def write_atomic(dump_dir: Path, name: str, chunks: list) -> int:
    tmp = dump_dir / f".{name}.tmp"
    with open(tmp, "wb") as f:
        for c in chunks:
            f.write(c)
    os.rename(tmp, dump_dir / name)
    return sum(memoryview(c).nbytes for c in chunks)


def split_words(words: np.ndarray) -> np.ndarray:
    """[n, slots, H] 16-bit words -> [2, n, slots, H] bytes: high plane, low plane (a host-side split,
    for callers that hold words; the SGLang hook splits on the GPU)."""
    from ..shards.codec import split_into  # the codec's own split; not imported into the server

    out = np.empty((2, *words.shape), np.uint8)
    w = np.ascontiguousarray(words).reshape(-1)
    split_into(w, out[0].reshape(-1), out[1].reshape(-1), np.empty_like(w))
    return out


def _header_bytes(rid: str, offset: int, shape, last: bool | None) -> bytes:
    _, n, slots, hidden = (int(x) for x in shape)
    return json.dumps({"rid": rid, "offset": offset, "n": n, "last": last, "slots": slots, "hidden": hidden}).encode()


def record_bytes(rid: str, offset: int, shape, last: bool | None) -> int:
    """The size of the record write_record makes of [2, n, slots, H] planes: what a writer reserves."""
    _, n, slots, hidden = (int(x) for x in shape)
    return len(MAGIC) + 4 + len(_header_bytes(rid, offset, shape, last)) + 4 * n + 2 * n * slots * hidden


def write_record(
    dump_dir: Path, rid: str, offset: int, input_ids: np.ndarray, planes: np.ndarray, last: bool | None
) -> int:
    """planes: [2, n, slots, H] uint8, the bf16 hidden states' high then low bytes (words are split
    once, by CaptureWriter's as_planes or split_words). Returns bytes written."""
    input_ids = np.ascontiguousarray(input_ids, dtype=np.int32)
    if planes.ndim != 4 or planes.shape[0] != 2 or planes.shape[1] != input_ids.shape[0] or planes.itemsize != 1:
        raise ValueError(f"record {rid}@{offset}: planes {planes.shape}/{planes.dtype} vs ids {input_ids.shape}")
    header = _header_bytes(rid, offset, planes.shape, last)
    hi, lo = np.ascontiguousarray(planes[0]), np.ascontiguousarray(planes[1])
    return write_atomic(
        Path(dump_dir),
        record_name(rid, offset),
        [MAGIC, struct.pack("<I", len(header)), header, memoryview(input_ids), memoryview(hi), memoryview(lo)],
    )


def write_error(dump_dir: Path, rid: str, reason: str) -> None:
    write_atomic(Path(dump_dir), f"{rid}{ERROR_SUFFIX}", [json.dumps({"rid": rid, "reason": reason}).encode()])


def _header(buf: bytes, path) -> tuple[dict, int]:
    """(header, where the payload starts) from a record's first bytes."""
    if buf[:4] != MAGIC:
        raise ValueError(f"{path}: not a capture record ({MAGIC.decode()})")
    (hlen,) = struct.unpack_from("<I", buf, 4)
    return json.loads(buf[8 : 8 + hlen]), 8 + hlen


def read_header(path: Path) -> dict:
    """Only the header (the packer needs a piece's length long before its data), with `base`: where
    the ids start (the planes follow them)."""
    with open(path, "rb") as f:
        head = f.read(8)
        (hlen,) = struct.unpack_from("<I", head, 4) if len(head) == 8 else (0,)
        h, base = _header(head + f.read(hlen), path)
        h["base"] = base
        return h


def read_record(path: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """(header, ids [n], hidden [n, slots, H] as 16-bit words): the whole piece, for tests and tools."""
    raw = Path(path).read_bytes()
    h, base = _header(raw, path)
    from ..shards.codec import from_planes  # the codec's own join; not imported into the server

    n, m = h["n"], h["n"] * h["slots"] * h["hidden"]
    ids = np.frombuffer(raw, np.int32, count=n, offset=base)
    planes = np.frombuffer(raw, np.uint8, count=2 * m, offset=base + 4 * n).reshape(2, m)
    return h, ids, from_planes(planes[0], planes[1]).reshape(n, h["slots"], h["hidden"])


def clear_reservations(dump_dir: Path) -> None:
    """Removes the reservations of writers that are gone (a killed server's): call only while no
    writer runs."""
    for p in Path(dump_dir).glob(RESERVATION + "*"):
        p.unlink(missing_ok=True)


def dir_bytes(dump_dir: Path, reservations: bool = False) -> int:
    """Bytes the files in the dump directory hold (it is flat); with `reservations`, also what writers
    have reserved and not yet written (CaptureWriter's sparse reservation files, which hold no memory)."""
    sizes = {}  # by inode: a file renamed during the scan (".x.tmp" -> "x.hsr") can be listed twice
    with os.scandir(dump_dir) as it:
        for e in it:
            if not reservations and e.name.startswith(RESERVATION):
                continue
            try:
                sizes[e.inode()] = e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # consumed by the packer meanwhile
                pass
    return sum(sizes.values())
