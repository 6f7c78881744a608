"""How :mod:`qkv.doctor.view` packs one attention map: block-max pooling, 8-bit log codes, a PNG.

A map of weights ``w >= 0`` becomes one byte per cell, written as an 8-bit grayscale PNG (zlib,
per-row filters chosen as libpng does) that the browser decodes natively:

- ``0``: exactly zero (a blocked key);
- ``1``: positive but below the head's floor ``lo``;
- ``2 .. 253``: ``lo * (hi / lo) ** ((code - 2) / 251)``, a logarithmic scale from the floor to the
  head's largest finite weight ``hi``; the floor is ``max(min positive weight, hi * 1e-8)``, so a
  code is within a factor ``(hi / lo) ** (1 / 502)`` of the weight (3.7 % at 8 decades, less for a
  narrower head, exact for a head whose positive weights are all equal);
- ``254``: ``+inf``; ``255``: NaN.

Codes grow with the weight (NaN above all), so the max of codes is the code of the max: the page
pools blocks on codes, NaN winning as torch's ``amax`` makes it win here.

The page is text, so bytes travel 7 bits to a character (:func:`pack7`, 8/7 of the bytes, where
base64 takes 4/3): a 2048 x 2048 head is at most 4.8 MB even when its codes do not compress.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "CODE_BELOW",
    "CODE_INF",
    "CODE_NAN",
    "CODE_ZERO",
    "DECADES",
    "ILLEGAL",
    "STEPS",
    "Codes",
    "block_max",
    "pack7",
    "png_gray8",
    "quantize",
]

CODE_ZERO, CODE_BELOW, CODE_INF, CODE_NAN = 0, 1, 254, 255
FIRST, LAST = 2, 253  # the log codes
STEPS = LAST - FIRST  # 251 steps between lo and hi
DECADES = 8  # the floor: at most this many decades below the head's largest weight


@dataclass(frozen=True)
class Codes:
    """One map's codes and the scale that reads them back.

    Attributes:
        codes: ``[rows, cols]`` uint8, as the module docstring says.
        lo: the floor (float32 value), the weight of code 2; 0.0 when no weight is positive.
        hi: the largest finite weight (float32 value), the weight of code 253; 0.0 likewise.
        error: the largest relative error of a log code, ``(hi / lo) ** (1 / 502) - 1``.
    """

    codes: np.ndarray
    lo: float
    hi: float
    error: float


def block_max(weights: Tensor, rows: int, cols: int) -> tuple[Tensor, int, int]:
    """Pool ``weights`` by block max to at most ``rows x cols`` cells.

    Args:
        weights: ``[T, S]`` float weights (NaN propagates: a block holding one is NaN).
        rows: the most rows the result may have.
        cols: the most columns.

    Returns:
        ``(pooled, bt, bs)``: ``pooled`` is ``[ceil(T / bt), ceil(S / bs)]``, each cell the max of
        ``bt`` queries x ``bs`` keys (fewer at the last row / column); ``bt = ceil(T / rows)``,
        ``bs = ceil(S / cols)``; ``weights`` itself when both are 1.
    """
    T, S = weights.shape
    bt, bs = -(-T // rows), -(-S // cols)
    if bt == 1 and bs == 1:
        return weights, 1, 1
    R, C = -(-T // bt), -(-S // bs)
    padded = weights
    if R * bt != T or C * bs != S:  # weights are >= 0: zero padding never wins a max
        padded = torch.nn.functional.pad(weights, (0, C * bs - S, 0, R * bt - T))  # [R*bt, C*bs]
    blocks = padded.reshape(R, bt, C, bs)  # [R, bt, C, bs]
    return blocks.amax(dim=(1, 3)), bt, bs  # [R, C]


def quantize(weights: Tensor) -> Codes:
    """The 8-bit log codes of ``weights`` (see the module docstring).

    Args:
        weights: ``[rows, cols]`` float32, every value ``>= 0``, ``+inf`` or NaN.

    Returns:
        The codes and their scale.
    """
    w = weights.detach().to(torch.float32).cpu().numpy().astype(np.float64)  # [R, C]
    codes = np.zeros(w.shape, dtype=np.uint8)
    nan, inf = np.isnan(w), np.isposinf(w)
    positive = (w > 0) & ~inf
    codes[nan], codes[inf] = CODE_NAN, CODE_INF
    if not positive.any():
        return Codes(codes, 0.0, 0.0, 0.0)
    values = w[positive]
    hi = float(values.max())
    lo = max(float(values.min()), float(np.float32(hi * 10.0**-DECADES)))
    span = math.log(hi / lo)
    if span == 0.0:
        codes[positive] = LAST
        return Codes(codes, lo, hi, 0.0)
    steps = np.rint((np.log(np.maximum(values, lo)) - math.log(lo)) * (STEPS / span))
    part = (FIRST + np.clip(steps, 0, STEPS)).astype(np.uint8)
    part[values < lo] = CODE_BELOW
    codes[positive] = part
    return Codes(codes, lo, hi, math.expm1(span / (2 * STEPS)))


def _paeth(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a + b - c
    pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - c)
    return np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, c))


def _chunk(kind: bytes, data: bytes) -> bytes:
    body = kind + data
    return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))


def png_gray8(codes: np.ndarray, level: int = 6) -> bytes:
    """An 8-bit grayscale PNG of ``codes``, each row's filter chosen by the smallest sum of
    absolute filtered bytes (libpng's heuristic), compressed with zlib.

    Args:
        codes: ``[rows, cols]`` uint8, both at least 1.
        level: the zlib level.

    Returns:
        The PNG file's bytes (no colour profile, no gamma: the bytes read back as written).
    """
    h, w = codes.shape
    x = codes.astype(np.int16)  # [h, w]
    zero_col, zero_row = np.zeros((h, 1), np.int16), np.zeros((1, w), np.int16)
    a = np.concatenate([zero_col, x[:, :-1]], axis=1)  # left
    b = np.concatenate([zero_row, x[:-1]], axis=0)  # up
    c = np.concatenate([zero_col, b[:, :-1]], axis=1)  # up-left
    filtered = np.stack([x, x - a, x - b, x - (a + b) // 2, x - _paeth(a, b, c)])  # [5, h, w]
    filtered = (filtered & 0xFF).astype(np.uint8)  # [5, h, w]
    cost = np.abs(filtered.view(np.int8).astype(np.int32)).sum(axis=2)  # [5, h]
    choice = cost.argmin(axis=0)  # [h]
    raw = np.empty((h, w + 1), dtype=np.uint8)
    raw[:, 0] = choice
    raw[:, 1:] = filtered[choice, np.arange(h)]  # [h, w]
    header = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)  # 8-bit grayscale, no interlace
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw.tobytes(), level))
        + _chunk(b"IEND", b"")
    )


ILLEGAL = (0x00, 0x0D, 0x3C)
"""The 7-bit groups :func:`pack7` escapes: NUL (the HTML parser makes it U+FFFD), CR (made LF)
and ``<`` (which could end the ``<script>`` element holding the text)."""


def pack7(data: bytes) -> str:
    """``data`` as text for a ``<script type="text/plain">`` element, 7 bits per character.

    The bits, most significant first, are cut into ``ceil(8 n / 7)`` groups of 7 (the last one
    padded with zeros). A group is the character of its value, unless its value is one of
    :data:`ILLEGAL` (index ``j``): then it and the group after it are one character,
    ``U+0100 + 128 j + next``, or ``U+0100 + 384 + j`` when it is the last group. Every character
    is below U+0283 (one or two UTF-8 bytes), none of them ends or alters the element's text.

    Args:
        data: the bytes.

    Returns:
        The text; the reader needs ``len(data)`` to drop the padding bits.
    """
    n = len(data)
    if n == 0:
        return ""
    rows = np.frombuffer(data + bytes(-n % 7), np.uint8).reshape(-1, 7).astype(np.uint64)  # [m, 7]
    words = (rows << np.arange(48, -1, -8, dtype=np.uint64)).sum(axis=1)  # [m] 56 bits each
    groups = (words[:, None] >> np.arange(49, -1, -7, dtype=np.uint64)) & np.uint64(127)  # [m, 8]
    chars = groups.reshape(-1)[: -(-8 * n // 7)].astype(np.uint32)  # [G]
    which = np.full(128, -1, dtype=np.int64)
    which[list(ILLEGAL)] = np.arange(len(ILLEGAL))
    bad = np.flatnonzero(which[chars] >= 0)  # rare: 3 values in 128
    if len(bad) == 0:
        return chars.astype("<u4").tobytes().decode("utf-32-le")
    # In a run of consecutive illegal groups, the 1st, 3rd, ... each take the group after them.
    starts = np.concatenate([[True], bad[1:] != bad[:-1] + 1])
    run_start = np.maximum.accumulate(np.where(starts, bad, 0))
    heads = bad[(bad - run_start) % 2 == 0]
    j = which[chars[heads]]
    last = heads == len(chars) - 1
    follow = np.minimum(heads + 1, len(chars) - 1)
    chars[heads] = np.where(last, 0x100 + 384 + j, 0x100 + 128 * j + chars[follow])
    keep = np.ones(len(chars), dtype=bool)
    keep[heads[~last] + 1] = False
    return chars[keep].astype("<u4").tobytes().decode("utf-32-le")
