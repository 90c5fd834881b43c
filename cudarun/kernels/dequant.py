"""Four consecutive values of a GGUF tensor, decoded inside a CUDA kernel: the unit of the coalesced
dequantization (`prefill.dequantize_kernel`), where consecutive threads decode consecutive fours and
store them as one 64-bit word of fp16.

`QUADS[type] = quad` (`quad_layout`: with its values and bytes per block); `quad(raw, base, o)`
returns, as four float32, values o..o+3 (o a multiple of 4) of the block that starts at byte
`base` of the tensor.
`raw` is the tensor's bytes viewed as uint16: every block size is even and so is every field a
quad reads, so a thread reads its four quant bytes as two aligned 16-bit loads, and 32 threads
read a block's quant bytes in one contiguous sweep. The fp16 scales are bitcast and converted by
the hardware (`bits.half_to_float`), never computed in f64. Layouts as in `cudarun.blocks` and
ggml-common.h; the 1-value types (F32, F16, BF16) read four consecutive values.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from refengine.quants import QTYPES

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import cuda, float32, int64  # noqa: E402

from .bits import float_from_bits, half_to_float  # noqa: E402


@cuda.jit(device=True)
def word4(raw, off):
    """The four bytes at even byte offset `off`, little-endian, as one integer."""
    w = off >> 1
    return int64(raw[w]) | (int64(raw[w + 1]) << 16)


@cuda.jit(device=True)
def byte(raw, off):
    return (int64(raw[off >> 1]) >> (8 * (off & 1))) & 255


@cuda.jit(device=True)
def half(raw, off):
    """The fp16 at even byte offset `off`, as float32."""
    return half_to_float(raw[off >> 1])


@cuda.jit(device=True)
def signed8(b):
    return float32((b ^ 128) - 128)


@cuda.jit(device=True)
def quad_f32(raw, base, o):
    w = base >> 1
    return (
        float_from_bits(int64(raw[w]) | (int64(raw[w + 1]) << 16)),
        float_from_bits(int64(raw[w + 2]) | (int64(raw[w + 3]) << 16)),
        float_from_bits(int64(raw[w + 4]) | (int64(raw[w + 5]) << 16)),
        float_from_bits(int64(raw[w + 6]) | (int64(raw[w + 7]) << 16)),
    )


@cuda.jit(device=True)
def quad_f16(raw, base, o):
    w = base >> 1
    return (
        half_to_float(raw[w]),
        half_to_float(raw[w + 1]),
        half_to_float(raw[w + 2]),
        half_to_float(raw[w + 3]),
    )


@cuda.jit(device=True)
def quad_bf16(raw, base, o):
    w = base >> 1
    return (
        float_from_bits(int64(raw[w]) << 16),
        float_from_bits(int64(raw[w + 1]) << 16),
        float_from_bits(int64(raw[w + 2]) << 16),
        float_from_bits(int64(raw[w + 3]) << 16),
    )


@cuda.jit(device=True)
def quad_q8_0(raw, base, o):
    """34 B / 32: d, qs[32] int8 -> d * qs[j]."""
    d = half(raw, base)
    q = word4(raw, base + 2 + o)
    return (
        d * signed8(q & 255),
        d * signed8((q >> 8) & 255),
        d * signed8((q >> 16) & 255),
        d * signed8((q >> 24) & 255),
    )


@cuda.jit(device=True)
def nibbles(q, shift):
    """The nibbles at bit `shift` of each of the four bytes of q, as float32."""
    return (
        float32((q >> shift) & 15),
        float32((q >> (8 + shift)) & 15),
        float32((q >> (16 + shift)) & 15),
        float32((q >> (24 + shift)) & 15),
    )


@cuda.jit(device=True)
def fives(q, shift, h):
    """5-bit values: the nibbles at `shift` of q's bytes, bit 4 from the low four bits of h."""
    return (
        float32(((q >> shift) & 15) | ((h & 1) << 4)),
        float32(((q >> (8 + shift)) & 15) | (((h >> 1) & 1) << 4)),
        float32(((q >> (16 + shift)) & 15) | (((h >> 2) & 1) << 4)),
        float32(((q >> (24 + shift)) & 15) | (((h >> 3) & 1) << 4)),
    )


@cuda.jit(device=True)
def quad_q4_0(raw, base, o):
    """18 B / 32: d, qs[16]; values 0..15 the low nibbles, 16..31 the high -> d * (q - 8)."""
    d = half(raw, base)
    a, b, c, e = nibbles(word4(raw, base + 2 + (o & 15)), 4 * (o >> 4))
    eight = float32(8.0)
    return d * (a - eight), d * (b - eight), d * (c - eight), d * (e - eight)


@cuda.jit(device=True)
def quad_q4_1(raw, base, o):
    """20 B / 32: d, m, qs[16] -> d * q + m."""
    d, m = half(raw, base), half(raw, base + 2)
    a, b, c, e = nibbles(word4(raw, base + 4 + (o & 15)), 4 * (o >> 4))
    return d * a + m, d * b + m, d * c + m, d * e + m


@cuda.jit(device=True)
def quad_q5_0(raw, base, o):
    """22 B / 32: d, qh (bit j: value j's fifth bit), qs[16] -> d * (q - 16)."""
    d = half(raw, base)
    h = word4(raw, base + 2) >> o
    a, b, c, e = fives(word4(raw, base + 6 + (o & 15)), 4 * (o >> 4), h)
    sixteen = float32(16.0)
    return d * (a - sixteen), d * (b - sixteen), d * (c - sixteen), d * (e - sixteen)


@cuda.jit(device=True)
def quad_q5_1(raw, base, o):
    """24 B / 32: d, m, qh, qs[16] -> d * q + m."""
    d, m = half(raw, base), half(raw, base + 2)
    h = word4(raw, base + 4) >> o
    a, b, c, e = fives(word4(raw, base + 8 + (o & 15)), 4 * (o >> 4), h)
    return d * a + m, d * b + m, d * c + m, d * e + m


@cuda.jit(device=True)
def scale_min_k4(raw, scales, sub):
    """ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block `sub` (0..7)."""
    if sub < 4:
        return byte(raw, scales + sub) & 63, byte(raw, scales + sub + 4) & 63
    lo, hi, top = byte(raw, scales + sub + 4), byte(raw, scales + sub - 4), byte(raw, scales + sub)
    return (lo & 15) | ((hi >> 6) << 4), (lo >> 4) | ((top >> 6) << 4)


@cuda.jit(device=True)
def quad_k4(raw, base, o, has_high):
    """Q4_K (144 B / 256: d, dmin, scales[12], qs[128]) or, with `has_high`, Q5_K (176 B: qh[32]
    before qs): sub-block s = o // 32 takes the low (s even) or high nibbles of qs[32 (s // 2) ..],
    Q5_K's fifth bit is bit s of qh[o % 32] -> d * sc * q - dmin * m."""
    sub = o >> 5
    sc, mn = scale_min_k4(raw, base + 4, sub)
    a = half(raw, base) * float32(sc)
    b = half(raw, base + 2) * float32(mn)
    lane = o & 31
    qs = base + 16 + (32 if has_high else 0) + (sub >> 1) * 32 + lane
    q = word4(raw, qs)
    shift = 4 * (sub & 1)
    if has_high:
        hw = word4(raw, base + 16 + lane) >> sub
        h = (hw & 1) | ((hw >> 7) & 2) | ((hw >> 14) & 4) | ((hw >> 21) & 8)
        v0, v1, v2, v3 = fives(q, shift, h)
    else:
        v0, v1, v2, v3 = nibbles(q, shift)
    return a * v0 - b, a * v1 - b, a * v2 - b, a * v3 - b


@cuda.jit(device=True)
def quad_q4_k(raw, base, o):
    return quad_k4(raw, base, o, False)


@cuda.jit(device=True)
def quad_q5_k(raw, base, o):
    return quad_k4(raw, base, o, True)


@cuda.jit(device=True)
def quad_q6_k(raw, base, o):
    """210 B / 256: ql[128], qh[64], int8 scales[16], d. Value o = 128 n + 32 quarter + lane: low
    nibble of ql[64 n + lane + 32 (quarter & 1)] at 4 (quarter >> 1), two high bits of
    qh[32 n + lane] at 2 quarter, scale 8 n + lane // 16 + 2 quarter -> d * sc * (q - 32)."""
    n, quarter, lane = o >> 7, (o >> 5) & 3, o & 31
    low = word4(raw, base + 64 * n + lane + 32 * (quarter & 1)) >> (4 * (quarter >> 1))
    high = word4(raw, base + 128 + 32 * n + lane) >> (2 * quarter)
    sc = signed8(byte(raw, base + 192 + 8 * n + (lane >> 4) + 2 * quarter))
    a = half(raw, base + 208) * sc
    thirty_two = float32(32.0)
    return (
        a * (float32((low & 15) | ((high & 3) << 4)) - thirty_two),
        a * (float32(((low >> 8) & 15) | (((high >> 8) & 3) << 4)) - thirty_two),
        a * (float32(((low >> 16) & 15) | (((high >> 16) & 3) << 4)) - thirty_two),
        a * (float32(((low >> 24) & 15) | (((high >> 24) & 3) << 4)) - thirty_two),
    )


# type -> its four values' decoder (values and bytes per block: refengine.quants.QTYPES)
QUADS = {
    Q.F32: quad_f32,
    Q.F16: quad_f16,
    Q.BF16: quad_bf16,
    Q.Q8_0: quad_q8_0,
    Q.Q4_0: quad_q4_0,
    Q.Q4_1: quad_q4_1,
    Q.Q5_0: quad_q5_0,
    Q.Q5_1: quad_q5_1,
    Q.Q4_K: quad_q4_k,
    Q.Q5_K: quad_q5_k,
    Q.Q6_K: quad_q6_k,
}


def quad_layout(qtype) -> tuple:
    """(four values' decoder, values per block, bytes per block) of a type."""
    q = QTYPES[qtype]
    return QUADS[qtype], q.block_elems, q.block_nbytes
