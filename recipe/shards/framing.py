"""A shard's records found from their own framing, without the index: where each record starts and
ends (its zstd frames' headers and block headers, RFC 8878), its header, and the index line it
would have. A resume and `repair` use it to tell whole records from torn or foreign bytes, so that
what they keep, re-index or cut follows from the bytes themselves, never from the index alone.
"""

from __future__ import annotations

import numpy as np

from .codec import (
    CHECK_BYTES,
    CHECK_MAGIC,
    RAW_BLOCK,
    ZSTD_MAGIC,
    CorruptRecord,
    check_tail,
    crc32,
    decode,
    record_header,
    trailer,
)

HEAD_BYTES = 4 << 20  # a record's header is read from its first bytes: never copy a sample of gigabytes for it
FCS_BYTES = (0, 2, 4, 8)  # Frame_Content_Size field by its flag (flag 0: 1 byte if single segment)
DICT_BYTES = (0, 1, 2, 4)


def frame_length(buf, at: int) -> int | None:
    """The length of the zstd frame starting at buf[at], walked through its block headers without
    decoding a byte; None where no whole frame starts there (no magic, a reserved block type, or
    the frame runs past the end of buf)."""
    n, _ = _frame(buf, at)
    return n


def _frame(buf, at: int) -> tuple[int | None, bool]:
    """(frame length or None, whether the frame began well and ran past the end of buf)."""
    end = len(buf)
    if end - at < 4 or bytes(buf[at : at + 4]) != ZSTD_MAGIC:
        return None, False
    if end - at < 6:
        return None, True
    fhd = buf[at + 4]
    single, checksum, fcs_flag = fhd >> 5 & 1, fhd >> 2 & 1, fhd >> 6
    pos = at + 5 + (0 if single else 1) + DICT_BYTES[fhd & 3]
    pos += FCS_BYTES[fcs_flag] or (1 if single else 0)
    while True:
        if pos + 3 > end:
            return None, True
        head = int.from_bytes(bytes(buf[pos : pos + 3]), "little")
        last, kind, size = head & 1, head >> 1 & 3, head >> 3
        if kind == 3 or size > RAW_BLOCK:
            return None, False
        pos += 3 + (1 if kind == 1 else size)
        if last:
            break
    pos += 4 * checksum
    return (pos - at, False) if pos <= end else (None, True)


def torn(buf, at: int) -> bool:
    """A record begins at buf[at] and the shard ends before it does: a crashed append, cut short."""
    a, past = _frame(buf, at)
    if a is None:
        return past
    try:
        header = record_header(buf[at : at + min(a, HEAD_BYTES)])
    except CorruptRecord:
        return False
    if not header.get("tail"):
        return False
    b, past = _frame(buf, at + a) if at + a < len(buf) else (None, True)
    if b is None:
        return past
    rest = bytes(buf[at + a + b : at + a + b + CHECK_BYTES])  # v3: cut inside its check frame
    return len(rest) < trailer(header) and CHECK_MAGIC.startswith(rest[:8])


def record_at(buf, at: int) -> tuple[int, dict] | None:
    """(length, header) of the whole record (frame A, then frame B where its header says so) that
    starts at buf[at]; None where none does."""
    a = frame_length(buf, at)
    if a is None:
        return None
    try:
        header = record_header(buf[at : at + min(a, HEAD_BYTES)])
    except CorruptRecord:
        return None
    tail = header.get("tail") or 0
    if not tail:
        return a, header
    b = frame_length(buf, at + a)
    if b != 13 + 3 * max(1, -(-tail // RAW_BLOCK)) + tail:
        return None
    k = trailer(header)  # v3: the check frame after frame B
    if k and (bytes(buf[at + a + b : at + a + b + 8]) != CHECK_MAGIC or at + a + b + k > len(buf)):
        return None
    return a + b + k, header


def walk(buf, at: int, found: dict[int, tuple[int, dict]]) -> int:
    """Records one after another from `at`, each added to `found` (offset -> (length, header));
    returns where the walk stopped: the end of buf or the first byte that starts no whole record."""
    while at < len(buf) and at not in found:
        rec = record_at(buf, at)
        if rec is None:
            return at
        found[at] = rec
        at += rec[0]
    return at


def crc_of(buf, at: int, length: int) -> int:
    """crc32 of buf[at : at + length] read in place (a view, no copy)."""
    view = memoryview(buf)[at : at + length]
    try:
        return crc32(view)
    finally:
        view.release()


def tokens_of(header: dict) -> int | None:
    """A record's token count, from its input_ids' shape (None: a record without them)."""
    t = next((t for t in header.get("tensors") or () if t.get("name") == "input_ids"), None)
    return t["shape"][0] if t is not None else None


def line_of(buf, shard: str, at: int, length: int) -> dict:
    """The index line of the whole record at buf[at : at + length], read from the record itself
    (decoded whole: frame A's checksum and frame B's blocks checked). Raises CorruptRecord."""
    frame = buf[at : at + length]
    meta, arrs = decode(frame)
    check_tail(frame, record_header(frame))  # frame B's own crc32 (v3): no index line gives the record's
    if not {"input_ids", "loss_mask", "hidden"} <= set(arrs) or "id" not in meta:
        raise CorruptRecord("not a sample record (no id, input_ids, loss_mask or hidden)")
    ids, mask, hid = arrs["input_ids"], arrs["loss_mask"], arrs["hidden"]
    line = {"id": meta["id"], "key": meta.get("key"), "shard": shard, "offset": at, "length": length,
            "tokens": int(ids.shape[0]), "raw_bytes": int(ids.nbytes + hid.nbytes + mask.nbytes),
            "crc32": crc32(frame), "loss_tokens": int(np.asarray(mask).sum())}  # fmt: skip
    if meta.get("source") is not None:
        line["source"] = meta["source"]
    return line
