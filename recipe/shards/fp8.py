"""The fp8 storage codec (`shards.codec=fp8`): each token's state in each slot as e4m3fn codes with one
float32 scale, max|x| / 448, so that the row's largest value lands on e4m3's largest. Half the bytes of
bf16 before zstd; every reader dequantizes to bf16 without being told (codec.decode).

One scale per token *and slot*: a low aux layer's residual stream and the post-norm final state can
differ by orders of magnitude, and one scale over a token's slots leaves the small ones fewer codes
(bench/fp8.py measures both). A code is stored split (_fp8.c says why): two codes' exponents in one
byte, their signs and mantissas in another. A record's `hidden_fp8` holds, for each group of
`group_tokens` tokens (the packer's block: the last group may be shorter), the exponent bytes of its
rows, then their sign-and-mantissa bytes; zstd codes the first and passes the second through.

The loops are C (_fp8.c, built with the package); where no compiler was found, numpy computes the same
bytes here (tests/test_fp8.py holds both, and torch's own float8_e4m3fn conversion, to them)."""

from __future__ import annotations

import numpy as np

try:
    from ._fp8 import dequantize as _c_dequantize
    from ._fp8 import quantize as _c_quantize
except ImportError:  # no compiler at install time: numpy below, same bytes
    _c_quantize = _c_dequantize = None
IMPL = "compiled" if _c_quantize is not None else "numpy"

MAX = 448.0  # e4m3fn's largest finite value
NAME = "fp8-e4m3"  # what the manifest and the identity call it
CODE = "hidden_fp8"  # the record's tensors: grouped split codes (uint8, [T, S, H] bytes) and scales [T, S]
SCALE = "hidden_scale"
GROUP_BYTES = 1 << 19  # the packer's block: tokens a group = this // (slots * hidden), at least 1


def group_tokens(slots: int, hidden: int) -> int:
    return max(1, GROUP_BYTES // (slots * hidden))


def _table() -> np.ndarray:
    """The 256 e4m3fn codes' values (0x7F and 0xFF: NaN)."""
    c = np.arange(256)
    e, m = (c >> 3) & 15, (c & 7).astype(np.float64)
    v = np.where(e > 0, (1 + m / 8) * 2.0 ** (e - 7), m * 2.0**-9)
    v[(c & 0x7F) == 0x7F] = np.nan
    return np.where(c & 0x80, -v, v).astype(np.float32)


TABLE = _table()


def bf16_round(v: np.ndarray) -> np.ndarray:
    """float32 -> bf16 words, rounded to nearest even (finite values)."""
    b = v.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


def encode(f: np.ndarray) -> np.ndarray:
    """float32 values within +-448 -> e4m3fn codes, rounded to nearest, ties to the even code. A normal
    code is the float's own exponent and top mantissa bits, rounded on its bits (a carry moves the
    exponent up, as it should); below 2^-6 the codes step by 2^-9, and rint rounds ties to even."""
    a = np.abs(f)
    b = a.view(np.uint32)
    normal = ((b + 0x7FFFF + ((b >> 20) & 1)) >> 20).astype(np.int32) - ((127 - 7) << 3)  # rebias 127 -> 7
    sub = np.rint(a * np.float32(512)).astype(np.int32)
    code = np.where(a < np.float32(2.0**-6), sub, normal).astype(np.uint8)
    return code | (np.signbit(f).astype(np.uint8) << 7)


def split(codes: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """e4m3fn codes in rows of `width` (even) -> (exponent bytes, sign-and-mantissa bytes): value i of a
    row and value i + width/2 share a byte, the first in its high nibble."""
    c = codes.reshape(-1, 2, width // 2)
    e = ((c >> 3) & 15).astype(np.uint8)
    sm = (((c >> 4) & 8) | (c & 7)).astype(np.uint8)
    return (e[:, 0] << 4 | e[:, 1]).astype(np.uint8).reshape(-1), (sm[:, 0] << 4 | sm[:, 1]).astype(np.uint8).reshape(
        -1
    )


def joined(exp: np.ndarray, sm: np.ndarray, width: int) -> np.ndarray:
    """The inverse of split: the e4m3fn codes, rows of `width`."""
    e, s = exp.reshape(-1, 1, width // 2), sm.reshape(-1, 1, width // 2)
    e, s = np.concatenate([e >> 4, e & 15], axis=1), np.concatenate([s >> 4, s & 15], axis=1)
    return (((s & 8) << 4) | (e << 3) | (s & 7)).astype(np.uint8).reshape(-1)


def quantize(hi: np.ndarray, lo: np.ndarray, width: int):
    """Rows of `width` (even) bf16 values, as their high and low byte planes -> (exponent bytes,
    sign-and-mantissa bytes, scales float32 [rows], squared error of the dequantized values float64
    [rows], squared norm float64 [rows])."""
    rows = hi.size // width
    exp, sm = np.empty(hi.size // 2, np.uint8), np.empty(hi.size // 2, np.uint8)
    scales, err, norm = np.empty(rows, np.float32), np.empty(rows, np.float64), np.empty(rows, np.float64)
    hi, lo = np.ascontiguousarray(hi).reshape(-1), np.ascontiguousarray(lo).reshape(-1)
    loops = _c_quantize if _c_quantize is not None else _numpy_quantize
    with np.errstate(invalid="ignore", over="ignore"):  # a NaN/Inf block, which the plane check refuses
        loops(hi, lo, width, exp, sm, scales, err, norm)
    return exp, sm, scales, err, norm


def _numpy_quantize(hi, lo, width, exp, sm, scales, err, norm) -> None:
    """quantize's loops where _fp8.c was not built: the same bytes, into the same arrays (its signature)."""
    rows = hi.size // width
    x = ((hi.astype(np.uint32) << 24) | (lo.astype(np.uint32) << 16)).view(np.float32).reshape(rows, width)
    amax = np.abs(x).max(axis=1)
    inv = np.where(amax > 0, np.float32(MAX) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    scales[:] = amax / np.float32(MAX)
    q = encode(np.clip(x * inv[:, None], -MAX, MAX).astype(np.float32))
    exp[:], sm[:] = split(q, width)
    back = (bf16_round(TABLE[q] * scales[:, None]).astype(np.uint32) << 16).view(np.float32)
    err[:] = ((back.astype(np.float64) - x) ** 2).sum(axis=1)
    norm[:] = (x.astype(np.float64) ** 2).sum(axis=1)


def dequantize(exp: np.ndarray, sm: np.ndarray, scales: np.ndarray, width: int, out: np.ndarray | None = None):
    """Split codes (rows of `width` values) times their row's scale -> bf16 words (uint16), into `out`."""
    exp, sm = np.ascontiguousarray(exp).reshape(-1), np.ascontiguousarray(sm).reshape(-1)
    scales = np.ascontiguousarray(scales, np.float32).reshape(-1)
    if out is None:
        out = np.empty(2 * exp.size, np.uint16)
    if _c_dequantize is not None and out.flags.c_contiguous:
        _c_dequantize(exp, sm, scales, width, out.reshape(-1))
        return out
    out.reshape(-1)[:] = bf16_round(TABLE[joined(exp, sm, width)].reshape(-1, width) * scales[:, None]).reshape(-1)
    return out


def round_trip(words: np.ndarray, width: int) -> np.ndarray:
    """bf16 words (uint16, rows of `width`: one scale each) as a reader of an fp8 set gets them back:
    quantized, then dequantized."""
    from .codec import split_planes  # the codec imports this module

    exp, sm, scales, _, _ = quantize(*split_planes(np.ascontiguousarray(words)), width)
    return dequantize(exp, sm, scales, width).reshape(np.shape(words))


def grouped(exp: np.ndarray, sm: np.ndarray, shape: tuple) -> np.ndarray:
    """Whole arrays' split codes in the record's layout: each group's exponent bytes, then its others."""
    T, S, H = shape
    k, half = group_tokens(S, H), S * H // 2
    e, s = exp.reshape(T, half), sm.reshape(T, half)
    return np.concatenate([part for t in range(0, T, k) for part in (e[t : t + k].ravel(), s[t : t + k].ravel())])


def dequantize_record(body: np.ndarray, scales: np.ndarray, shape: tuple, out: np.ndarray) -> np.ndarray:
    """A record's grouped codes ([T, S, H] bytes) and scales [T, S] -> bf16 words [T, S, H] in `out`."""
    T, S, H = shape
    k, half = group_tokens(S, H), S * H // 2
    body, scales, flat = body.reshape(-1), scales.reshape(T, S), out.reshape(-1)
    for t in range(0, T, k):
        n = min(k, T - t)
        at = 2 * t * half
        dequantize(body[at : at + n * half], body[at + n * half : at + 2 * n * half], scales[t : t + n], H,
                   flat[at : at + 2 * n * half])  # fmt: skip
    return out.reshape(shape)
