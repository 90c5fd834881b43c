"""GGUF block layouts, each written once as a plain function that Numba compiles both for the GPU
(`cuda.jit(device=True)`) and for the CPU (`njit`) — `register_jitable` makes it callable from
either: `decode(raw, base, out)` writes the values of the block that starts at byte `base` of the
uint8 array `raw` into out[0:values per block] (ggml's dequantize_row_* for one block), reading
its scales once.

Layouts (ggml-common.h; d, m: fp16 scale and minimum):
- Q8_0, 34 B / 32: d, qs[32] int8 -> d * qs[j]
- Q4_0, 18 B / 32: d, qs[16] -> d * ((qs[j % 16] >> 4 * (j // 16)) & 15) - 8)
- Q4_1, 20 B / 32: d, m, qs[16] -> d * nibble + m
- Q5_0, 22 B / 32: d, qh (u32), qs[16] -> d * ((nibble | bit j of qh << 4) - 16)
- Q5_1, 24 B / 32: d, m, qh, qs[16] -> d * (nibble | bit j of qh << 4) + m
- Q4_K, 144 B / 256: d, dmin, scales[12] (6-bit scale and min per 32), qs[128] (4 chunks of 64
  values: low nibbles, then high) -> d * sc * q - dmin * m
- Q5_K, 176 B / 256: as Q4_K with qh[32] before qs: bit (j // 32) of qh[j % 32] is q's 5th bit
- Q6_K, 210 B / 256: ql[128], qh[64], int8 scales[16] per 16, d last -> d * sc * (q - 32)
- F32, F16, BF16: one value per "block"
"""

from __future__ import annotations

import math

from gguf import GGMLQuantizationType as Q
from numba.extending import register_jitable

from refengine.quants import QTYPES


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
def f32_bits(bits):
    """The float32 with these 32 bits (as an exact float)."""
    sign = -1.0 if bits & 0x80000000 else 1.0
    exp = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    if exp == 0:
        return sign * frac * 2.0**-149
    if exp == 255:
        return sign * math.inf if frac == 0 else math.nan
    return sign * (1.0 + frac / 8388608.0) * 2.0 ** (exp - 127)


@register_jitable
def nibble(raw, qs, j):
    """The j-th 4-bit value of 32 packed in 16 bytes at `qs` (low nibbles first, then high)."""
    return (int(raw[qs + (j & 15)]) >> (4 * (j >> 4))) & 15


@register_jitable
def high_bit(raw, qh, j):
    """Bit j of the little-endian uint32 at `qh`."""
    return (int(raw[qh + (j >> 3)]) >> (j & 7)) & 1


@register_jitable
def scale_min_k4(raw, scales, sub):
    """ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block `sub` (0..7)."""
    if sub < 4:
        return int(raw[scales + sub]) & 63, int(raw[scales + sub + 4]) & 63
    lo, hi = int(raw[scales + sub + 4]), int(raw[scales + sub - 4])
    top = int(raw[scales + sub])
    return (lo & 0xF) | ((hi >> 6) << 4), (lo >> 4) | ((top >> 6) << 4)


@register_jitable
def decode_f32(raw, base, out):
    bits = 0
    for i in range(4):
        bits |= int(raw[base + i]) << (8 * i)
    out[0] = f32_bits(bits)


@register_jitable
def decode_f16(raw, base, out):
    out[0] = half(raw, base)


@register_jitable
def decode_bf16(raw, base, out):
    out[0] = f32_bits((int(raw[base]) << 16) | (int(raw[base + 1]) << 24))


@register_jitable
def decode_q8_0(raw, base, out):
    d = half(raw, base)
    for j in range(32):
        q = int(raw[base + 2 + j])
        out[j] = d * (q - 256 if q > 127 else q)


@register_jitable
def decode_q4_0(raw, base, out):
    d = half(raw, base)
    for k in range(16):
        b = int(raw[base + 2 + k])
        out[k] = d * ((b & 15) - 8)
        out[k + 16] = d * ((b >> 4) - 8)


@register_jitable
def decode_q4_1(raw, base, out):
    d, m = half(raw, base), half(raw, base + 2)
    for k in range(16):
        b = int(raw[base + 4 + k])
        out[k] = d * (b & 15) + m
        out[k + 16] = d * (b >> 4) + m


@register_jitable
def decode_q5_0(raw, base, out):
    d = half(raw, base)
    for j in range(32):
        out[j] = d * ((nibble(raw, base + 6, j) | (high_bit(raw, base + 2, j) << 4)) - 16)


@register_jitable
def decode_q5_1(raw, base, out):
    d, m = half(raw, base), half(raw, base + 2)
    for j in range(32):
        out[j] = d * (nibble(raw, base + 8, j) | (high_bit(raw, base + 4, j) << 4)) + m


@register_jitable
def decode_k4(raw, base, out, qh):
    """Q4_K, or Q5_K when `qh` (the byte offset of its high bits in the block) is positive."""
    d, dmin = half(raw, base), half(raw, base + 2)
    qs = base + 16 + (32 if qh > 0 else 0)
    for sub in range(8):
        sc, mn = scale_min_k4(raw, base + 4, sub)
        a, b = d * sc, dmin * mn
        chunk = qs + (sub >> 1) * 32
        shift = 4 * (sub & 1)
        for k in range(32):
            q = (int(raw[chunk + k]) >> shift) & 15
            if qh > 0:
                q |= ((int(raw[base + qh + k]) >> sub) & 1) << 4
            out[sub * 32 + k] = a * q - b


@register_jitable
def decode_q4_k(raw, base, out):
    decode_k4(raw, base, out, 0)


@register_jitable
def decode_q5_k(raw, base, out):
    decode_k4(raw, base, out, 16)


@register_jitable
def decode_q6_k(raw, base, out):
    d = half(raw, base + 208)
    for n in range(2):
        for quarter in range(4):
            for lane in range(32):
                low = int(raw[base + 64 * n + lane + 32 * (quarter & 1)]) >> (4 * (quarter >> 1))
                high = (int(raw[base + 128 + 32 * n + lane]) >> (2 * quarter)) & 3
                sc = int(raw[base + 192 + 8 * n + (lane >> 4) + 2 * quarter])
                sc = sc - 256 if sc > 127 else sc
                out[128 * n + 32 * quarter + lane] = d * sc * (((low & 15) | (high << 4)) - 32)


# type -> its block decoder (values and bytes per block: refengine.quants.QTYPES)
DECODERS = {
    Q.F32: decode_f32,
    Q.F16: decode_f16,
    Q.BF16: decode_bf16,
    Q.Q8_0: decode_q8_0,
    Q.Q4_0: decode_q4_0,
    Q.Q4_1: decode_q4_1,
    Q.Q5_0: decode_q5_0,
    Q.Q5_1: decode_q5_1,
    Q.Q4_K: decode_q4_k,
    Q.Q5_K: decode_q5_k,
    Q.Q6_K: decode_q6_k,
}


def layout(qtype) -> tuple:
    """(block decoder, values per block, bytes per block) of a type."""
    q = QTYPES[qtype]
    return DECODERS[qtype], q.block_elems, q.block_nbytes
