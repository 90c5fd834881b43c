"""A GGUF weight decoded into the prefill's fp16 panel (`prefill.dequantize`), in 32-bit integer
arithmetic and wide memory operations, as llama.cpp's convert kernels do it or better
(docs/sass_gate.md gates it on their instructions per KiB of weights).

A thread decodes one unit of a block: 16 values of the 32-value types (half of Q8_0's, or a
quant word pair's low nibbles and their high ones), 16 of a K-quant sub-block pair, 32 of a Q6_K
quarter set, 8 of the float types. It loads its quant bytes as 32-bit words where the block size
is a multiple of 4 (16-bit pairs otherwise), converts every value once (`float32` of its byte)
and scales it with one fma, and stores runs of eight fp16 as one 16-byte store (`put8`). Every
index is a uint32 kept at 32 bits; a branch on the unit's place would split a warp (a warp
holds every unit of a block), so the K-quants' scale forms are selected, not branched to.

The arithmetic is the reference's in fp32 (d * q + m, d * sc * q - dmin * m; the offsets and
Q8_0's signs as an fma's addend), rounded once to fp16. Layouts as in `cudarun.blocks`.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import cuda, float32, uint32  # noqa: E402

from .bits import byte_float, float_from_bits, half_pair, half_to_float, load_pair  # noqa: E402
from .bits import pack_halves, shr32, store_pair  # noqa: E402
from .int8 import NIBBLES, at, fives, nibbles, word16  # noqa: E402


@cuda.jit(device=True)
def put8(out, o, v):
    """Panel values o..o + 7 (o a multiple of 8) = the eight float32 of v, as fp16 in one store."""
    store_pair(out, uint32(o >> 2), pack_halves(v[0], v[1], v[2], v[3]),
               pack_halves(v[4], v[5], v[6], v[7]))  # fmt: skip


@cuda.jit(device=True)
def scaled(x, y, a, b):
    """The eight bytes of words x and y (x's first) as a * byte + b."""
    return (a * byte_float(x, 0) + b, a * byte_float(x, 1) + b, a * byte_float(x, 2) + b,
            a * byte_float(x, 3) + b, a * byte_float(y, 0) + b, a * byte_float(y, 1) + b,
            a * byte_float(y, 2) + b, a * byte_float(y, 3) + b)


# -- the units, per type ---------------------------------------------------------------------------
# unit(w, wb, base, j, out, o): unit j of the block at word `base` of w (the tensor as the type's
# words; wb: as int8 bytes), into the panel `out` (fp16 as int64 words) whose value o is the
# block's first.


@cuda.jit(device=True)
def q8_0_unit(w, wb, base, j, out, o):
    """34 B / 32: d, qs[32] int8; unit j: values 16 j..: d * q, q + 128 as an unsigned byte."""
    d = half_to_float(at(w, base, 0))
    i = uint32(base + 8 * j)
    flip = uint32(0x80808080)
    m = float32(-128.0) * d
    put8(out, uint32(o + 16 * j),
         scaled(word16(w, i, 1) ^ flip, word16(w, i, 3) ^ flip, d, m))  # fmt: skip
    put8(out, uint32(o + 16 * j + 8),
         scaled(word16(w, i, 5) ^ flip, word16(w, i, 7) ^ flip, d, m))  # fmt: skip


@cuda.jit(device=True)
def nibble_units(lo, hi, out, o, j, a, b):
    """Q4_0 to Q5_1: quants lo of values 8 j.. and hi of 16 + 8 j.., as a * q + b."""
    put8(out, uint32(o + 8 * j), scaled(lo[0], lo[1], a, b))
    put8(out, uint32(o + 8 * j + 16), scaled(hi[0], hi[1], a, b))


@cuda.jit(device=True)
def q4_0_unit(w, wb, base, j, out, o):
    """18 B / 32: d, qs[16]: values 0..15 the low nibbles, 16..31 the high -> d * (q - 8)."""
    d = half_to_float(at(w, base, 0))
    i = uint32(base + 4 * j)
    lo, hi = nibbles(word16(w, i, 1), word16(w, i, 3))
    nibble_units(lo, hi, out, o, j, d, float32(-8.0) * d)


@cuda.jit(device=True)
def q4_1_unit(w, wb, base, j, out, o):
    """20 B / 32: d, m, qs[16] -> d * q + m."""
    d, m = half_pair(at(w, base, 0))
    i = uint32(base + 2 * j)
    lo, hi = nibbles(at(w, i, 1), at(w, i, 2))
    nibble_units(lo, hi, out, o, j, d, m)


@cuda.jit(device=True)
def q5_0_unit(w, wb, base, j, out, o):
    """22 B / 32: d, qh (bit v: value v's fifth bit), qs[16] -> d * (q - 16)."""
    d = half_to_float(at(w, base, 0))
    i = uint32(base + 4 * j)
    lo, hi = fives(word16(w, i, 3), word16(w, i, 5), word16(w, base, 1), uint32(8 * j))
    nibble_units(lo, hi, out, o, j, d, float32(-16.0) * d)


@cuda.jit(device=True)
def q5_1_unit(w, wb, base, j, out, o):
    """24 B / 32: d, m, qh, qs[16] -> d * q + m."""
    d, m = half_pair(at(w, base, 0))
    i = uint32(base + 2 * j)
    lo, hi = fives(at(w, i, 2), at(w, i, 3), at(w, base, 1), uint32(8 * j))
    nibble_units(lo, hi, out, o, j, d, m)


@cuda.jit(device=True)
def k_scale_pairs(s0, s1, s2, c):
    """The 6-bit scales and mins of K-quant sub-blocks 2c and 2c + 1 (bytes 4..15 of a Q4_K or
    Q5_K block as words s0, s1, s2), 2c's in the low byte of each pair; both of ggml's forms
    computed and one selected."""
    shift = uint32(16 * (c & 1))
    a, b, e = shr32(s0, shift) & 0xFFFF, shr32(s1, shift) & 0xFFFF, shr32(s2, shift) & 0xFFFF
    low = c < 2
    sc = uint32(a & 0x3F3F) if low else uint32((e & 0x0F0F) | ((a & 0xC0C0) >> 2))
    mn = uint32(b & 0x3F3F) if low else uint32(((e >> 4) & 0x0F0F) | ((b & 0xC0C0) >> 2))
    return sc, mn


@cuda.jit(device=True)
def k_units(w, base, j, out, o, a, b, qa, qb):
    """Q4_K/Q5_K's unit j (sub-block pair c = j // 4, lanes 8 (j % 4)..) from its quant words a, b
    (and Q5_K's fifth-bit words qa, qb; 0 for Q4_K): d * sc * q - dmin * m."""
    c, r = uint32(j >> 2), uint32(j & 3)
    sc, mn = k_scale_pairs(at(w, base, 1), at(w, base, 2), at(w, base, 3), c)
    d, dmin = half_pair(at(w, base, 0))
    ha, hb = shr32(qa, 2 * c), shr32(qb, 2 * c)  # bit 2c: sub-block 2c's; bit 2c + 1: the next
    lo0, lo1 = uint32((a & NIBBLES) | ((ha & 0x01010101) << 4)), uint32(
        (b & NIBBLES) | ((hb & 0x01010101) << 4))
    hi0, hi1 = uint32(((a >> 4) & NIBBLES) | ((ha & 0x02020202) << 3)), uint32(
        ((b >> 4) & NIBBLES) | ((hb & 0x02020202) << 3))
    at_lo = uint32(o + 64 * c + 8 * r)
    put8(out, at_lo, scaled(lo0, lo1, d * float32(sc & 255), -(dmin * float32(mn & 255))))
    put8(out, uint32(at_lo + 32),
         scaled(hi0, hi1, d * float32(sc >> 8), -(dmin * float32(mn >> 8))))  # fmt: skip


@cuda.jit(device=True)
def q4_k_unit(w, wb, base, j, out, o):
    """144 B / 256: d, dmin, scales[12], qs[128]."""
    i = uint32(base + 8 * (j >> 2) + 2 * (j & 3))
    k_units(w, base, j, out, o, at(w, i, 4), at(w, i, 5), uint32(0), uint32(0))


@cuda.jit(device=True)
def q5_k_unit(w, wb, base, j, out, o):
    """176 B / 256: d, dmin, scales[12], qh[32], qs[128]."""
    i = uint32(base + 8 * (j >> 2) + 2 * (j & 3))
    h = uint32(base + 2 * (j & 3))
    k_units(w, base, j, out, o, at(w, i, 12), at(w, i, 13), at(w, h, 4), at(w, h, 5))


@cuda.jit(device=True)
def sixes(lo, hi, a):
    """Q6_K's 6-bit quants (four nibble bytes of each of lo's words, two bits each of hi's) as
    a * (q - 32)."""
    return scaled(lo[0] | ((hi[0] & 0x03030303) << 4), lo[1] | ((hi[1] & 0x03030303) << 4), a,
                  float32(-32.0) * a)  # fmt: skip


@cuda.jit(device=True)
def q6_k_unit(w, wb, base, j, out, o):
    """210 B / 256: ql[128], qh[64], int8 scales[16], d. Unit j: half n = j // 4 of the block,
    lanes l = 8 (j % 4).. of its four quarters: value 128 n + 32 quarter + l takes the low (quarter
    < 2) or high nibble of ql[64 n + l + 32 (quarter % 2)], bits 2 quarter of qh[32 n + l], scale
    8 n + l // 16 + 2 quarter."""
    n, r = uint32(j >> 2), uint32(j & 3)
    q = uint32(base + 32 * n + 4 * r)
    a0, a1 = word16(w, q, 0), word16(w, q, 2)  # ql[64 n + l..]
    b0, b1 = word16(w, q, 16), word16(w, q, 18)  # ql[64 n + l + 32..]
    h = uint32(base + 16 * n + 4 * r)
    h0, h1 = word16(w, h, 64), word16(w, h, 66)
    s = uint32(2 * base + 8 * n + (r >> 1))  # the int8 scales, read as bytes
    d = half_to_float(at(w, base, 104))
    at0 = uint32(o + 128 * n + 8 * r)
    put8(out, at0, sixes((a0 & NIBBLES, a1 & NIBBLES), (h0, h1), d * float32(at(wb, s, 192))))
    put8(out, uint32(at0 + 32), sixes((b0 & NIBBLES, b1 & NIBBLES), (h0 >> 2, h1 >> 2),
                                      d * float32(at(wb, s, 194))))  # fmt: skip
    put8(out, uint32(at0 + 64), sixes(((a0 >> 4) & NIBBLES, (a1 >> 4) & NIBBLES),
                                      (h0 >> 4, h1 >> 4), d * float32(at(wb, s, 196))))  # fmt: skip
    put8(out, uint32(at0 + 96), sixes(((b0 >> 4) & NIBBLES, (b1 >> 4) & NIBBLES),
                                      (h0 >> 6, h1 >> 6), d * float32(at(wb, s, 198))))  # fmt: skip


@cuda.jit(device=True)
def f16_unit(w, wb, base, j, out, o):
    """Eight fp16, copied in one load and one store (w: 64-bit words)."""
    a, b = load_pair(w, base)
    store_pair(out, uint32(o >> 2), a, b)


@cuda.jit(device=True)
def low_float(v):
    return float_from_bits(v & 0xFFFFFFFF)


@cuda.jit(device=True)
def f32_unit(w, wb, base, j, out, o):
    """Eight fp32 (w: 64-bit words, two a word) rounded."""
    a, b = load_pair(w, base)
    c, e = load_pair(w, uint32(base + 2))
    put8(out, o, (low_float(a), low_float(a >> 32), low_float(b), low_float(b >> 32),
                  low_float(c), low_float(c >> 32), low_float(e), low_float(e >> 32)))  # fmt: skip


@cuda.jit(device=True)
def bf16s(v):
    """The four bf16 of a 64-bit word as float32: each the high half of its float."""
    return (low_float(v << 16), low_float(v & 0xFFFF0000), low_float((v >> 16) & 0xFFFF0000),
            low_float((v >> 32) & 0xFFFF0000))


@cuda.jit(device=True)
def bf16_unit(w, wb, base, j, out, o):
    a, b = load_pair(w, base)
    x, y = bf16s(a), bf16s(b)
    put8(out, o, (x[0], x[1], x[2], x[3], y[0], y[1], y[2], y[3]))


@dataclass(frozen=True)
class PanelUnit:
    """A type's block as the panel kernel cuts it: `units` threads a block (a power of two) of
    `values` values and `block_nbytes` bytes, read as `word_bytes` words (the float types'
    "block": the eight values of a unit)."""

    decode: object
    units: int
    values: int
    block_nbytes: int
    word_bytes: int

    @property
    def block_words(self) -> int:
        return self.block_nbytes // self.word_bytes


UNITS = {
    Q.F32: PanelUnit(f32_unit, 1, 8, 32, 8),
    Q.F16: PanelUnit(f16_unit, 1, 8, 16, 8),
    Q.BF16: PanelUnit(bf16_unit, 1, 8, 16, 8),
    Q.Q8_0: PanelUnit(q8_0_unit, 2, 32, 34, 2),
    Q.Q4_0: PanelUnit(q4_0_unit, 2, 32, 18, 2),
    Q.Q4_1: PanelUnit(q4_1_unit, 2, 32, 20, 4),
    Q.Q5_0: PanelUnit(q5_0_unit, 2, 32, 22, 2),
    Q.Q5_1: PanelUnit(q5_1_unit, 2, 32, 24, 4),
    Q.Q4_K: PanelUnit(q4_k_unit, 16, 256, 144, 4),
    Q.Q5_K: PanelUnit(q5_k_unit, 16, 256, 176, 4),
    Q.Q6_K: PanelUnit(q6_k_unit, 8, 256, 210, 2),
}
