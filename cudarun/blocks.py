"""GGUF block layouts, written once as plain functions that Numba compiles both for the GPU
(`cuda.jit(device=True)`) and for the CPU (`njit`): `value(raw, base, j)` is the j-th value of the
block that starts at byte `base` of the uint8 array `raw` (ggml's dequantize_row_* for one value);
`register_jitable` makes each callable from njit and CUDA kernels alike.

Layouts (ggml-common.h; d, m: fp16 scale and minimum):
- Q8_0, 34 B / 32: d, qs[32] int8 -> d * qs[j]
- Q4_0, 18 B / 32: d, qs[16] -> d * ((qs[j % 16] >> 4 * (j // 16)) & 15) - 8)
- Q4_1, 20 B / 32: d, m, qs[16] -> d * nibble + m
- Q5_0, 22 B / 32: d, qh (u32), qs[16] -> d * ((nibble | bit j of qh << 4) - 16)
- Q5_1, 24 B / 32: d, m, qh, qs[16] -> d * (nibble | bit j of qh << 4) + m
"""

from __future__ import annotations

import math

from gguf import GGMLQuantizationType as Q
from numba.extending import register_jitable


@register_jitable
def half(raw, off):
    """The fp16 at byte `off`, little-endian, as a float (subnormals, inf and NaN included)."""
    bits = int(raw[off]) | (int(raw[off + 1]) << 8)
    sign = -1.0 if bits & 0x8000 else 1.0
    exp = (bits >> 10) & 0x1F
    frac = bits & 0x3FF
    if exp == 0:
        return sign * frac * 5.960464477539063e-08  # 2**-24
    if exp == 31:
        return sign * math.inf if frac == 0 else math.nan
    return sign * (1.0 + frac / 1024.0) * 2.0 ** (exp - 15)


@register_jitable
def nibble(raw, qs, j):
    """The j-th 4-bit value of 32 packed in 16 bytes at `qs` (low nibbles first, then high)."""
    return (int(raw[qs + (j & 15)]) >> (4 * (j >> 4))) & 15


@register_jitable
def high_bit(raw, qh, j):
    """Bit j of the little-endian uint32 at `qh`."""
    return (int(raw[qh + (j >> 3)]) >> (j & 7)) & 1


@register_jitable
def q8_0(raw, base, j):
    q = int(raw[base + 2 + j])
    return half(raw, base) * (q - 256 if q > 127 else q)


@register_jitable
def q4_0(raw, base, j):
    return half(raw, base) * (nibble(raw, base + 2, j) - 8)


@register_jitable
def q4_1(raw, base, j):
    return half(raw, base) * nibble(raw, base + 4, j) + half(raw, base + 2)


@register_jitable
def q5_0(raw, base, j):
    q = nibble(raw, base + 6, j) | (high_bit(raw, base + 2, j) << 4)
    return half(raw, base) * (q - 16)


@register_jitable
def q5_1(raw, base, j):
    q = nibble(raw, base + 8, j) | (high_bit(raw, base + 4, j) << 4)
    return half(raw, base) * q + half(raw, base + 2)


# type -> (value function, values per block, bytes per block)
LAYOUTS = {
    Q.Q8_0: (q8_0, 32, 34),
    Q.Q4_0: (q4_0, 32, 18),
    Q.Q4_1: (q4_1, 32, 20),
    Q.Q5_0: (q5_0, 32, 22),
    Q.Q5_1: (q5_1, 32, 24),
}
