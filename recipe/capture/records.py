"""Raw capture records: what a backend leaves in the dump directory (a RAM disk) for the packer.

One file per (request, forward pass): `{rid}.{offset:09d}.hsr`
    b"HSR1" | u32 header_len | header JSON | input_ids int32[n] | hidden bf16 bits [n, slots, H]
`offset` is the request's first token in this pass (the prefix length), so chunked prefill gives
several pieces that the packer puts back in order. A failed capture leaves `{rid}.err` (JSON).
Every file is written under a dot-name and renamed, so the packer never sees half a file.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"HSR1"
SUFFIX = ".hsr"
ERROR_SUFFIX = ".err"


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


def write_record(
    dump_dir: Path, rid: str, offset: int, input_ids: np.ndarray, hidden: np.ndarray, last: bool | None
) -> int:
    """hidden: [n, slots, H] as 16-bit words (bf16 bits). Returns bytes written."""
    input_ids = np.ascontiguousarray(input_ids, dtype=np.int32)
    hidden = np.ascontiguousarray(hidden)
    if hidden.ndim != 3 or hidden.shape[0] != input_ids.shape[0] or hidden.itemsize != 2:
        raise ValueError(f"record {rid}@{offset}: hidden {hidden.shape}/{hidden.dtype} vs ids {input_ids.shape}")
    header = json.dumps(
        {
            "rid": rid,
            "offset": offset,
            "n": int(input_ids.shape[0]),
            "last": last,
            "slots": int(hidden.shape[1]),
            "hidden": int(hidden.shape[2]),
        }
    ).encode()
    return write_atomic(
        Path(dump_dir),
        record_name(rid, offset),
        [MAGIC, struct.pack("<I", len(header)), header, memoryview(input_ids), memoryview(hidden)],
    )


def write_error(dump_dir: Path, rid: str, reason: str) -> None:
    write_atomic(Path(dump_dir), f"{rid}{ERROR_SUFFIX}", [json.dumps({"rid": rid, "reason": reason}).encode()])


def _header(buf: bytes, path) -> tuple[dict, int]:
    """(header, where the payload starts) from a record's first bytes."""
    if buf[:4] != MAGIC:
        raise ValueError(f"{path}: not a capture record")
    (hlen,) = struct.unpack_from("<I", buf, 4)
    return json.loads(buf[8 : 8 + hlen]), 8 + hlen


def read_header(path: Path) -> dict:
    """Only the header (the packer needs a piece's length long before its data)."""
    with open(path, "rb") as f:
        head = f.read(8)
        (hlen,) = struct.unpack_from("<I", head, 4) if len(head) == 8 else (0,)
        return _header(head + f.read(hlen), path)[0]


def read_record(path: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    raw = Path(path).read_bytes()
    h, base = _header(raw, path)
    ids = np.frombuffer(raw, np.int32, count=h["n"], offset=base)
    hid = np.frombuffer(raw, np.uint16, count=h["n"] * h["slots"] * h["hidden"], offset=base + 4 * h["n"])
    return h, ids, hid.reshape(h["n"], h["slots"], h["hidden"])


def dir_bytes(dump_dir: Path) -> int:
    """Bytes held in the dump directory (files only; it is flat)."""
    total = 0
    with os.scandir(dump_dir) as it:
        for e in it:
            try:
                total += e.stat(follow_symlinks=False).st_size
            except FileNotFoundError:  # consumed by the packer meanwhile
                pass
    return total
