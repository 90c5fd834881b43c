"""A GGUF weight repacked for the prompt's int8 products (`q8_gemm`): signed 8-bit values in tiles
of 16 rows, with each row's scale, offset and weight sum per group.

`ints(raw, base, q, d, m)` decodes one block into integers: value j of the block is
d[j // G] * q[j] + m[j // G], G the type's group (32, Q6_K's 16), exactly as `blocks.DECODERS`
dequantize it (d and m products of fp16 scales and small integers, exact in fp32). A type
without a minimum has its midpoint taken from q (Q4_0's q - 8), so that q fits a signed byte.

Layout (flat arrays, tile t of rows 16t..16t+15, group g of n_groups = n_cols / G):
- q int8 [t, g, G / 4, 16, 4]: a group is G / 4 vectors of 64 bytes, vector i holding values
  4i..4i+3 of each row (the micro-kernel's one load);
- d, m float32 [t, g, 16]: each row's scale and offset of the group;
- c int32 [t, g, 16]: -128 times the row's sum of q over the group (the unsigned activations'
  excess, `q8_gemm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit, prange
from numba.extending import register_jitable

from refengine.quants import QTYPES

from ..blocks import half, high_bit, nibble, scale_min_k4
from .q8_gemm import ROWS


@register_jitable
def _signed(byte):
    return byte - 256 if byte > 127 else byte


@register_jitable
def ints_q8_0(raw, base, q, d, m):
    d[0], m[0] = half(raw, base), 0.0
    for j in range(32):
        q[j] = _signed(int(raw[base + 2 + j]))


@register_jitable
def ints_q4_0(raw, base, q, d, m):
    d[0], m[0] = half(raw, base), 0.0
    for j in range(32):
        q[j] = nibble(raw, base + 2, j) - 8


@register_jitable
def ints_q4_1(raw, base, q, d, m):
    d[0], m[0] = half(raw, base), half(raw, base + 2)
    for j in range(32):
        q[j] = nibble(raw, base + 4, j)


@register_jitable
def ints_q5_0(raw, base, q, d, m):
    d[0], m[0] = half(raw, base), 0.0
    for j in range(32):
        q[j] = (nibble(raw, base + 6, j) | (high_bit(raw, base + 2, j) << 4)) - 16


@register_jitable
def ints_q5_1(raw, base, q, d, m):
    d[0], m[0] = half(raw, base), half(raw, base + 2)
    for j in range(32):
        q[j] = nibble(raw, base + 8, j) | (high_bit(raw, base + 4, j) << 4)


@register_jitable
def ints_k4(raw, base, q, d, m, qh):
    """Q4_K, or Q5_K when `qh` (its high bits' byte offset in the block) is positive."""
    scale, dmin = half(raw, base), half(raw, base + 2)
    qs = base + 16 + (32 if qh > 0 else 0)
    for sub in range(8):
        sc, mn = scale_min_k4(raw, base + 4, sub)
        d[sub], m[sub] = scale * sc, -dmin * mn
        chunk, shift = qs + (sub >> 1) * 32, 4 * (sub & 1)
        for k in range(32):
            v = (int(raw[chunk + k]) >> shift) & 15
            if qh > 0:
                v |= ((int(raw[base + qh + k]) >> sub) & 1) << 4
            q[sub * 32 + k] = v


@register_jitable
def ints_q4_k(raw, base, q, d, m):
    ints_k4(raw, base, q, d, m, 0)


@register_jitable
def ints_q5_k(raw, base, q, d, m):
    ints_k4(raw, base, q, d, m, 16)


@register_jitable
def ints_q6_k(raw, base, q, d, m):
    scale = half(raw, base + 208)
    for s in range(16):
        d[s], m[s] = scale * _signed(int(raw[base + 192 + s])), 0.0
    for n in range(2):
        for quarter in range(4):
            for lane in range(32):
                low = int(raw[base + 64 * n + lane + 32 * (quarter & 1)]) >> (4 * (quarter >> 1))
                high = (int(raw[base + 128 + 32 * n + lane]) >> (2 * quarter)) & 3
                q[128 * n + 32 * quarter + lane] = ((low & 15) | (high << 4)) - 32


# type -> (its integer decoder, group, whether it has a minimum, the largest |q|: whether an AVX2
# host's 16-bit pair sums can hold q times an unsigned activation byte, `q8_gemm`)
INTS = {
    Q.Q8_0: (ints_q8_0, 32, False, 128),
    Q.Q4_0: (ints_q4_0, 32, False, 8),
    Q.Q4_1: (ints_q4_1, 32, True, 15),
    Q.Q5_0: (ints_q5_0, 32, False, 16),
    Q.Q5_1: (ints_q5_1, 32, True, 31),
    Q.Q4_K: (ints_q4_k, 32, True, 15),
    Q.Q5_K: (ints_q5_k, 32, True, 31),
    Q.Q6_K: (ints_q6_k, 16, False, 32),
}


@dataclass
class Panel:
    """A weight [n_rows, n_cols] repacked (module docstring)."""

    q: np.ndarray
    d: np.ndarray
    m: np.ndarray
    c: np.ndarray
    group: int
    has_min: bool
    q_bound: int  # the largest |q| of the type
    n_rows: int
    n_cols: int

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.d.nbytes + self.m.nbytes + self.c.nbytes


def fits(qtype, shape: tuple[int, int]) -> bool:
    """Whether a weight of this type and shape can be repacked (rows in whole tiles)."""
    return Q(qtype) in INTS and shape[0] % ROWS == 0


@lru_cache(maxsize=None)
def _repack_kernel(qtype):
    ints, group = INTS[qtype][:2]
    per_block, block_nbytes = QTYPES[qtype].block_elems, QTYPES[qtype].block_nbytes
    groups_per_block = per_block // group

    @njit(parallel=True)
    def repack(raw, q, d, m, c, n_rows, n_cols):
        blocks = n_cols // per_block
        n_groups = n_cols // group
        for tile in prange(n_rows // ROWS):
            qb = np.empty(per_block, np.int64)
            db = np.empty(groups_per_block, np.float32)
            mb = np.empty(groups_per_block, np.float32)
            for r in range(ROWS):
                row = tile * ROWS + r
                for blk in range(blocks):
                    ints(raw, (row * blocks + blk) * block_nbytes, qb, db, mb)
                    for gb in range(groups_per_block):
                        g = blk * groups_per_block + gb
                        at = (tile * n_groups + g) * ROWS + r
                        d[at], m[at] = db[gb], mb[gb]
                        total = 0
                        for j in range(group):
                            v = qb[gb * group + j]
                            total += v
                            q[((at - r) * (group // 4) + (j >> 2) * ROWS + r) * 4 + (j & 3)] = v
                        c[at] = -128 * total

    return repack


def _aligned(n: int, dtype) -> np.ndarray:
    """An empty 1-D array of n elements whose data starts on a 64-byte line."""
    itemsize = np.dtype(dtype).itemsize
    buf = np.empty(n * itemsize + 64, np.uint8)
    skip = -buf.ctypes.data % 64
    return buf[skip : skip + n * itemsize].view(dtype)


def repack(raw: np.ndarray, qtype, shape: tuple[int, int]) -> Panel:
    """The weight [n_rows, n_cols] held as GGUF blocks in `raw` (uint8), repacked."""
    qtype = Q(qtype)
    n_rows, n_cols = shape
    _, group, has_min, q_bound = INTS[qtype]
    n_scales = n_rows * (n_cols // group)
    panel = Panel(_aligned(n_rows * n_cols, np.int8), _aligned(n_scales, np.float32),
                  _aligned(n_scales, np.float32), _aligned(n_scales, np.int32), group, has_min,
                  q_bound, n_rows, n_cols)  # fmt: skip
    _repack_kernel(qtype)(np.asarray(raw).reshape(-1), panel.q, panel.d, panel.m, panel.c,
                          n_rows, n_cols)  # fmt: skip
    return panel
