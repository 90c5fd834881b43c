"""Decode products in integers, as llama.cpp's `mul_mat_vec_q` computes them: the activations are
quantized once per token to int8 in groups of 32 (a scale d and the group's sum s = d * sum(q), the
"q8_1" layout), and each weight block is dotted with them by `dp4a` (four signed bytes at a time),
then scaled in fp32. The named path is `int8` (top-1 >= 98%, mean KL < 5e-3 against the NumPy
engine). The CPU's int8 products (`kernels.cpu`) quantize the same way (ties aside: this rounds
half away from zero).

The activations live in two flat buffers per input: `xq`, the int8 values packed eight to a uint64
word ([tokens * n_cols / 8]), and `xds`, one uint64 per group of 32 holding the float32 d in its low
half and s in its high half ([tokens * n_cols / 32]): a lane reads its eight values and a group's
d and s with two 64-bit loads.

A warp computes one output row. Each type's block is cut into `lanes` units of the same shape (a
unit: the few 32-bit words of quants one lane dots per pass, the widest loads the block's alignment
allows: 32-bit words where the block size is a multiple of 4, pairs of 16-bit words otherwise);
consecutive lanes take consecutive units, and a lane keeps its unit of the block from block to
block (`row_dots`). A unit is decoded once (`Unit.decode`) and dotted with each token of the pass
(`Unit.dot`); the tokens are a compile-time count per kernel (1, 4 or 8 at a pass: no idle slots
issued at batch 1, and more than 8 take several passes), each in its own register accumulator. Every index is a uint32 the code keeps
at 32 bits (no int64 index arithmetic, no wraparound check: unsigned indices have none).

Offsets by a constant (Q4_0's -8, Q5_0's -16) and the K-quants' mins are applied through s: each of
a group's lanes takes its share of the group's sum, 1 / (lanes on the group), so the lanes together
take all of it, without a per-lane sum of the activations. Q6_K's -32 is applied in the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as Q

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import config, cuda, float32, int32, uint32, uint64  # noqa: E402


from . import THREADS  # noqa: E402
from .bits import dp4a, float_from_bits, half_to_float, shr32  # noqa: E402
from .elementwise import FULL_MASK, activation, warp_sum  # noqa: E402
from solver.workspace import MAX_DECODE_TOKENS, pass_rows, pass_tokens  # noqa: E402

GROUP = 32  # activation values per int8 scale
ROWS = 4  # warps, one row each, per thread block
MAX_TOKENS = MAX_DECODE_TOKENS
NIBBLES = 0x0F0F0F0F


# -- small pieces every unit uses ----------------------------------------------------------------


@cuda.jit(device=True)
def at(w, i, k):
    """w[i + k] for a uint32 index i and a constant k: the sum is taken at 64 bits, where it
    cannot wrap, so that the loads of one unit share one address and k becomes their offset."""
    return w[uint64(i) + uint64(k)]


@cuda.jit(device=True)
def word16(w, i, k):
    """The 32-bit word of 16-bit words i + k and i + k + 1 (a block only 2-byte aligned)."""
    return uint32(uint32(at(w, i, k)) | (uint32(at(w, i, k + 1)) << 16))


@cuda.jit(device=True)
def low(v):
    """The low 32 bits of a uint64 word (the first four int8 of the eight, or d)."""
    return uint32(v & 0xFFFFFFFF)


@cuda.jit(device=True)
def high(v):
    return uint32(v >> 32)


@cuda.jit(device=True)
def scale_sum(xds, i, k):
    """d and s of activation group i + k."""
    v = at(xds, i, k)
    return float_from_bits(low(v)), float_from_bits(high(v))


@cuda.jit(device=True)
def dot8(a, b, x, c):
    """c + the integer dot product of eight weight bytes (a, b) with the eight int8 of word x."""
    return dp4a(a, low(x), dp4a(b, high(x), c))


@cuda.jit(device=True)
def spread_bits(h):
    """The low four bits of h, each moved to bit 4 of its own byte (Q5_0/Q5_1's fifth bit)."""
    return uint32(((h << 4) & 0x10) | ((h << 11) & 0x1000) | ((h << 18) & 0x100000)
                  | ((h << 25) & 0x10000000))  # fmt: skip


@cuda.jit(device=True)
def k_scales(s0, s1, s2, c):
    """The 6-bit scales and mins of the K-quant sub-blocks 2c and 2c + 1 (bytes 4..15 of a Q4_K
    or Q5_K block as three words s0, s1, s2): (scale pair, min pair), byte 0 for 2c."""
    shift = 16 * (c & 1)
    a, b, e = shr32(s0, shift) & 0xFFFF, shr32(s1, shift) & 0xFFFF, shr32(s2, shift) & 0xFFFF
    if c < 2:
        return uint32(a & 0x3F3F), uint32(b & 0x3F3F)
    return (uint32((e & 0x0F0F) | ((a & 0xC0C0) >> 2)),
            uint32(((e >> 4) & 0x0F0F) | ((b & 0xC0C0) >> 2)))  # fmt: skip


# -- the units, per type ---------------------------------------------------------------------------
# decode(w, wb, base, sub) -> the unit's quants and its float factors (shared by the tokens);
# dot(u, xq, xq32, xds, xw, xg, sub, acc) -> acc + the unit's share of a token's dot product, where
# xw and xg index the token's first activation word and group of the block, and base the block's
# first weight word. Every sum is an fma chain into the accumulator.


@cuda.jit(device=True)
def q8_0_decode(w, wb, base, sub):
    o = uint32(base + 4 * sub)
    return word16(w, o, 1), word16(w, o, 3), half_to_float(at(w, base, 0))


@cuda.jit(device=True)
def q8_0_dot(u, xq, xq32, xds, xw, xg, sub, acc):
    a, b, d = u
    dx, _ = scale_sum(xds, xg, 0)
    return acc + (d * dx) * float32(dot8(a, b, xq[uint32(xw + sub)], int32(0)))


@cuda.jit(device=True)
def nibbles(a, b):
    """The low nibbles of words a, b and their high ones, each in its own byte."""
    return ((uint32(a & NIBBLES), uint32(b & NIBBLES)),
            (uint32((a >> 4) & NIBBLES), uint32((b >> 4) & NIBBLES)))  # fmt: skip


@cuda.jit(device=True)
def q4_0_decode(w, wb, base, sub):
    o = uint32(base + 4 * sub)
    lo, hi = nibbles(word16(w, o, 1), word16(w, o, 3))
    d = half_to_float(at(w, base, 0))
    return lo, hi, d, float32(-4.0) * d  # -8 per value, over the block's two lanes


@cuda.jit(device=True)
def half_pair(v):
    return half_to_float(v & 0xFFFF), half_to_float(v >> 16)


@cuda.jit(device=True)
def q4_1_decode(w, wb, base, sub):
    o = uint32(base + 2 * sub)
    lo, hi = nibbles(at(w, o, 1), at(w, o, 2))
    d, m = half_pair(at(w, base, 0))
    return lo, hi, d, float32(0.5) * m  # + m per value, over the block's two lanes


@cuda.jit(device=True)
def nibble_dot(u, xq, xq32, xds, xw, xg, sub, acc):
    """Q4_0 to Q5_1: the low quants against values 8 sub.. of the group, the high ones against
    16 + 8 sub.., and the constant (offset or min) through the group's sum."""
    lo, hi, d, f = u
    dx, sx = scale_sum(xds, xg, 0)
    i = uint32(xw + sub)
    q = dot8(lo[0], lo[1], at(xq, i, 0), dot8(hi[0], hi[1], at(xq, i, 2), int32(0)))
    return acc + (d * dx) * float32(q) + f * sx


@cuda.jit(device=True)
def fives(a, b, qh, shift):
    """Q5_0/Q5_1's quants of words a, b with their fifth bits from qh, bits shift.. for a's low
    nibbles, shift + 16 for its high ones (b: shift + 4, shift + 20)."""
    h = shr32(qh, shift)
    lo = (uint32((a & NIBBLES) | spread_bits(h)), uint32((b & NIBBLES) | spread_bits(h >> 4)))
    hi = (uint32(((a >> 4) & NIBBLES) | spread_bits(h >> 16)),
          uint32(((b >> 4) & NIBBLES) | spread_bits(h >> 20)))  # fmt: skip
    return lo, hi


@cuda.jit(device=True)
def q5_0_decode(w, wb, base, sub):
    o = uint32(base + 4 * sub)
    lo, hi = fives(word16(w, o, 3), word16(w, o, 5), word16(w, base, 1), uint32(8 * sub))
    d = half_to_float(at(w, base, 0))
    return lo, hi, d, float32(-8.0) * d  # -16 per value, over the block's two lanes


@cuda.jit(device=True)
def q5_1_decode(w, wb, base, sub):
    o = uint32(base + 2 * sub)
    lo, hi = fives(at(w, o, 2), at(w, o, 3), at(w, base, 1), uint32(8 * sub))
    d, m = half_pair(at(w, base, 0))
    return lo, hi, d, float32(0.5) * m


@cuda.jit(device=True)
def k_decode(w, base, sub, a, b, qa, qb):
    """A Q4_K/Q5_K unit from its quant words a, b (and Q5_K's fifth-bit words qa, qb; 0 for
    Q4_K): sub-block 2c's quants, 2c + 1's, and the four float factors."""
    c = uint32(sub >> 2)
    sc, mn = k_scales(at(w, base, 1), at(w, base, 2), at(w, base, 3), c)
    d, dmin = half_pair(at(w, base, 0))
    ha, hb = shr32(qa, 2 * c), shr32(qb, 2 * c)  # bit 2c: sub-block 2c's; bit 2c + 1: the next
    lo = (uint32((a & NIBBLES) | ((ha & 0x01010101) << 4)),
          uint32((b & NIBBLES) | ((hb & 0x01010101) << 4)))  # fmt: skip
    hi = (uint32(((a >> 4) & NIBBLES) | ((ha & 0x02020202) << 3)),
          uint32(((b >> 4) & NIBBLES) | ((hb & 0x02020202) << 3)))  # fmt: skip
    quarter = float32(-0.25) * dmin  # minus the min, over the four lanes of a sub-block
    factors = (d * float32(sc & 255), d * float32(sc >> 8), quarter * float32(mn & 255),
               quarter * float32(mn >> 8))  # fmt: skip
    return lo, hi, factors


@cuda.jit(device=True)
def q4_k_decode(w, wb, base, sub):
    o = uint32(base + 8 * (sub >> 2) + 2 * (sub & 3))
    return k_decode(w, base, sub, at(w, o, 4), at(w, o, 5), uint32(0), uint32(0))


@cuda.jit(device=True)
def q5_k_decode(w, wb, base, sub):
    o = uint32(base + 8 * (sub >> 2) + 2 * (sub & 3))
    h = uint32(base + 2 * (sub & 3))
    return k_decode(w, base, sub, at(w, o, 12), at(w, o, 13), at(w, h, 4), at(w, h, 5))


@cuda.jit(device=True)
def k_dot(u, xq, xq32, xds, xw, xg, sub, acc):
    """Sub-blocks 2c and 2c + 1 of the unit: groups xg + 2c and xg + 2c + 1."""
    lo, hi, f = u
    c, p = uint32(sub >> 2), uint32(sub & 3)
    g = uint32(xg + 2 * c)
    d0, s0 = scale_sum(xds, g, 0)
    d1, s1 = scale_sum(xds, g, 1)
    i = uint32(xw + 8 * c + p)
    q0 = dot8(lo[0], lo[1], at(xq, i, 0), int32(0))
    q1 = dot8(hi[0], hi[1], at(xq, i, 4), int32(0))
    return acc + (f[0] * d0) * float32(q0) + (f[1] * d1) * float32(q1) + f[2] * s0 + f[3] * s1


@cuda.jit(device=True)
def q6_k_decode(w, wb, base, sub):
    n, r = uint32(sub >> 4), uint32(sub & 15)
    half_sel, l4 = uint32(r >> 3), uint32(r & 7)
    ql = word16(w, uint32(base + 32 * n + 16 * half_sel + 2 * l4), 0)
    qh = word16(w, uint32(base + 16 * n + 2 * l4), 64)
    qh = shr32(qh, 2 * half_sel)
    # the 6-bit quant q, then q - 32 in its byte: q + 96 never carries out of a byte, and
    # flipping bit 7 subtracts 128 modulo 256
    lo = uint32(((ql & NIBBLES) | ((qh & 0x03030303) << 4)) + 0x60606060) ^ 0x80808080
    hi = uint32((((ql >> 4) & NIBBLES) | ((qh & 0x30303030))) + 0x60606060) ^ 0x80808080
    k = uint32(8 * n + 2 * half_sel + (l4 >> 2))  # the scale of the low values; + 4: the high ones'
    d = half_to_float(at(w, base, 104))
    s = uint32(2 * base + k)  # the int8 scales, read as bytes
    return uint32(lo), uint32(hi), d * float32(at(wb, s, 192)), d * float32(at(wb, s, 196))


@cuda.jit(device=True)
def q6_k_dot(u, xq, xq32, xds, xw, xg, sub, acc):
    lo, hi, f_lo, f_hi = u
    n, r = uint32(sub >> 4), uint32(sub & 15)
    half_sel, l4 = uint32(r >> 3), uint32(r & 7)
    g = uint32(xg + 4 * n + half_sel)
    d0, _ = scale_sum(xds, g, 0)
    d1, _ = scale_sum(xds, g, 2)
    i = uint32(2 * xw + 8 * (4 * n + half_sel) + l4)  # int8 x4 words of the token's values
    q0, q1 = dp4a(lo, at(xq32, i, 0), int32(0)), dp4a(hi, at(xq32, i, 16), int32(0))
    return acc + (f_lo * d0) * float32(q0) + (f_hi * d1) * float32(q1)


@dataclass(frozen=True)
class Unit:
    """How a type's block is cut for the lanes: `lanes` units per block (a power of two), the
    block's size in `word_bytes` words (the loads' width: 4 where the block size allows)."""

    decode: object
    dot: object
    lanes: int
    values: int
    block_nbytes: int
    word_bytes: int

    @property
    def block_words(self) -> int:
        return self.block_nbytes // self.word_bytes


UNITS = {
    Q.Q8_0: Unit(q8_0_decode, q8_0_dot, 4, 32, 34, 2),
    Q.Q4_0: Unit(q4_0_decode, nibble_dot, 2, 32, 18, 2),
    Q.Q4_1: Unit(q4_1_decode, nibble_dot, 2, 32, 20, 4),
    Q.Q5_0: Unit(q5_0_decode, nibble_dot, 2, 32, 22, 2),
    Q.Q5_1: Unit(q5_1_decode, nibble_dot, 2, 32, 24, 4),
    Q.Q4_K: Unit(q4_k_decode, k_dot, 16, 256, 144, 4),
    Q.Q5_K: Unit(q5_k_decode, k_dot, 16, 256, 176, 4),
    Q.Q6_K: Unit(q6_k_decode, q6_k_dot, 32, 256, 210, 2),
}


def weight_words(raw, qtype):
    """A weight's device bytes as the words its unit loads."""
    return raw.view(np.uint32 if UNITS[qtype].word_bytes == 4 else np.uint16)


# -- activations -----------------------------------------------------------------------------------

QUANT_THREADS = 8 if THREADS < 32 else 128  # a multiple of 8 (a group's four-value words)


@cuda.jit(device=True)
def rounded(v):
    """v rounded half away from zero to an int32, in fp32 (Python's round goes through f64)."""
    q = int32(abs(v) + float32(0.5))
    return -q if v < float32(0.0) else q


@cuda.jit
def quantize(x, xq32, xds32, n_cols):
    """x [T, n_cols] -> token t's int8 values xq32[t * n_cols / 4 + i] (word i: values 4i..4i+3)
    and its groups' (d, s) as float32 pairs in xds32: a thread per four values, eight threads (a
    group) reducing by shuffles. Rounds half away from zero."""
    t = cuda.blockIdx.y
    i = uint32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
    n_words = uint32(n_cols >> 2)
    j = uint32(4 * min(i, n_words - 1))
    v0, v1, v2, v3 = x[t, j], x[t, j + 1], x[t, j + 2], x[t, j + 3]
    amax = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
    for step in (1, 2, 4):
        amax = max(amax, cuda.shfl_xor_sync(FULL_MASK, amax, step))
    d = amax / float32(127.0)
    inv = float32(1.0) / d if d > float32(0.0) else float32(0.0)
    q0, q1, q2, q3 = rounded(v0 * inv), rounded(v1 * inv), rounded(v2 * inv), rounded(v3 * inv)
    total = q0 + q1 + q2 + q3
    for step in (1, 2, 4):
        total += cuda.shfl_xor_sync(FULL_MASK, total, step)
    if i < n_words:
        xq32[t * n_words + i] = int32(
            (q0 & 255) | ((q1 & 255) << 8) | ((q2 & 255) << 16) | ((q3 & 255) << 24)
        )
        if (i & 7) == 0:
            g = 2 * (t * (n_words >> 3) + (i >> 3))
            xds32[g] = d
            xds32[g + 1] = float32(total) * d


def quantize_gpu(x, xq, xds, stream=0) -> None:
    """x [T, n_cols] (device float32) into xq (uint64, at least T * n_cols / 8) and xds (uint64,
    at least T * n_cols / 32)."""
    n_tokens, n_cols = x.shape
    assert n_cols % GROUP == 0
    grid = (-(-n_cols // 4 // QUANT_THREADS), n_tokens)
    quantize[grid, QUANT_THREADS, stream](x, xq.view(np.int32), xds.view(np.float32),
                                          np.int64(n_cols))  # fmt: skip


# -- the row loop, compiled per type and tokens per pass -------------------------------------------

_ROW_LOOP = """
def row_dots(w, wb, xq, xq32, xds, base, t0, n_blocks, row_words, row_groups, lane):
    {zero}
    blk = uint32(lane >> {log_lanes}) if {lanes} <= {threads} else uint32(0)
    first_sub = uint32(lane & {sub_mask})
    while blk < n_blocks:
        at_block = uint32(base + blk * {block_words})
        w_at, g_at = uint32(blk * {words_per_block}), uint32(blk * {groups_per_block})
        for j in range({subs}):
            sub = uint32(first_sub + j * {threads})
            unit = decode(w, wb, at_block, sub)
{per_token}
        blk = uint32(blk + {blocks_per_pass})
    return {accs}
"""
_PER_TOKEN = (
    "            a{t} = dot(unit, xq, xq32, xds, uint32((t0 + {t}) * row_words + w_at), "
    "uint32((t0 + {t}) * row_groups + g_at), sub, a{t})"
)


@lru_cache(maxsize=None)
def row_dots(qtype, tokens: int):
    """The device function of one lane's share of a row's dot products with tokens t0..t0 +
    tokens - 1: a tuple of `tokens` float32, one register accumulator each. A lane keeps its
    unit of the block (lane mod lanes) from block to block, so what the unit's place decides (its
    words' offsets, its sub-block, its shifts) is computed once, outside the loop; where a block
    has more units than a warp has lanes (the simulator's 4-lane warps), a lane takes several."""
    unit = UNITS[qtype]
    accs = ", ".join(f"a{t}" for t in range(tokens))
    source = _ROW_LOOP.format(
        zero=" = ".join(f"a{t}" for t in range(tokens)) + " = float32(0.0)",
        log_lanes=unit.lanes.bit_length() - 1,
        lanes=unit.lanes,
        sub_mask=unit.lanes - 1,
        block_words=unit.block_words,
        words_per_block=unit.values // 8,
        groups_per_block=unit.values // GROUP,
        subs=max(1, unit.lanes // THREADS),
        blocks_per_pass=max(1, THREADS // unit.lanes),
        per_token="\n".join(_PER_TOKEN.format(t=t) for t in range(tokens)),
        threads=THREADS,
        accs=accs + ("," if tokens == 1 else ""),
    )
    scope = {"uint32": uint32, "float32": float32, "decode": unit.decode, "dot": unit.dot}
    exec(compile(source, f"<int8 row_dots {qtype.name} x{tokens}>", "exec"), scope)
    return cuda.jit(device=True)(scope["row_dots"])


_PRODUCT = """
def product(w, wb, xq, xq32, xds, out, bias, has_bias, gate, act, glu, n_cols, n_tokens, row,
            lane):
    n_rows = uint32(out.shape[1])
    blocks = uint32(n_cols // {values})
    base = uint32(min(row, n_rows - 1) * blocks * {block_words})
    row_words, row_groups = uint32(n_cols >> 3), uint32(n_cols >> 5)
    b = float32(0.0)
    if has_bias and row < n_rows:
        b = bias[row]
    t0 = uint32(0)
    while t0 < n_tokens:
        sums = dots(w, wb, xq, xq32, xds, base, t0, blocks, row_words, row_groups, lane)
{per_token}
        t0 = uint32(t0 + {tokens})
"""
_STORE = """        s{t} = warp_sum(sums[{t}])
        if lane == 0 and row < n_rows and t0 + {t} < n_tokens:
            out[t0 + {t}, row] = s{t} + b
            if glu != 0:
                act[t0 + {t}, row] = activation(gate[t0 + {t}, row], glu == 2) * (s{t} + b)"""


@lru_cache(maxsize=None)
def row_product(qtype, tokens: int):
    """The device function a warp runs for one output row: its dot products with every token,
    `tokens` at a pass, the row's bias added (`has_bias`) and, with glu != 0 (1 SiLU, 2 GELU),
    act = act(gate) * out written too (the up product's epilogue). A row past n_rows runs on the
    clamped row and stores nothing: the simulator's shuffles wait for every thread of the
    block."""
    unit = UNITS[qtype]
    source = _PRODUCT.format(
        values=unit.values, block_words=unit.block_words, tokens=tokens,
        per_token="\n".join(_STORE.format(t=t) for t in range(tokens)),
    )  # fmt: skip
    scope = {"uint32": uint32, "float32": float32, "dots": row_dots(qtype, tokens),
             "warp_sum": warp_sum, "activation": activation}  # fmt: skip
    exec(compile(source, f"<int8 product {qtype.name} x{tokens}>", "exec"), scope)
    return cuda.jit(device=True)(scope["product"])


@cuda.jit(device=True)
def lane_and_row(first_block):
    """This thread's lane, and its warp's output row counted from thread block first_block."""
    lane, warp = uint32(cuda.threadIdx.x % THREADS), uint32(cuda.threadIdx.x // THREADS)
    return lane, uint32((cuda.blockIdx.x - first_block) * ROWS + warp)


@lru_cache(maxsize=None)
def gpu_kernel(qtype, tokens: int):
    product = row_product(qtype, tokens)

    @cuda.jit
    def matvec(w, wb, xq, xq32, xds, out, bias, has_bias, gate, act, glu, n_cols, n_tokens):
        """out [T, n_rows] = the int8 activations of T tokens times the weight (+ bias; the
        gated epilogue with glu != 0)."""
        lane, row = lane_and_row(uint32(0))
        product(w, wb, xq, xq32, xds, out, bias, has_bias, gate, act, glu, n_cols, n_tokens,
                row, lane)  # fmt: skip

    return matvec


@lru_cache(maxsize=None)
def triple_kernel(qa, qb, qc, tokens: int):
    """Three products of one input in one launch (Q, K and V): the grid's first blocks make a's
    rows, the next b's, the last c's, each with its optional bias."""
    pa, pb, pc = (row_product(q, tokens) for q in (qa, qb, qc))

    @cuda.jit
    def matvec3(wa, ba, wb, bb, wc, bc, xq, xq32, xds, oa, ob, oc, bias_a, bias_b, bias_c,
                has_a, has_b, has_c, n_cols, n_tokens):  # fmt: skip
        grid_a = uint32((oa.shape[1] + ROWS - 1) // ROWS)
        grid_b = uint32(grid_a + (ob.shape[1] + ROWS - 1) // ROWS)
        blk = uint32(cuda.blockIdx.x)
        if blk < grid_a:
            lane, row = lane_and_row(uint32(0))
            pa(wa, ba, xq, xq32, xds, oa, bias_a, has_a, oa, oa, 0, n_cols, n_tokens, row, lane)
        elif blk < grid_b:
            lane, row = lane_and_row(grid_a)
            pb(wb, bb, xq, xq32, xds, ob, bias_b, has_b, ob, ob, 0, n_cols, n_tokens, row, lane)
        else:
            lane, row = lane_and_row(grid_b)
            pc(wc, bc, xq, xq32, xds, oc, bias_c, has_c, oc, oc, 0, n_cols, n_tokens, row, lane)

    return matvec3


def activation_words(n_tokens: int, n_cols: int) -> tuple[int, int]:
    """The uint64 words of xq and xds a product of n_tokens reads: its passes are whole (the
    tokens past n_tokens of the last pass are read and their sums dropped)."""
    rows = pass_rows(n_tokens)
    return rows * n_cols // 8, rows * n_cols // GROUP


def weights_in(raw, qtype):
    """A weight's device bytes as the kernels read them: its words, and its bytes as int8."""
    words = weight_words(raw, qtype)
    assert words.size < 2**32, "a weight of 2^32 words or more: 32-bit indices"
    if UNITS[qtype].word_bytes == 4 and not config.ENABLE_CUDASIM:
        address = raw.__cuda_array_interface__["data"][0]
        assert address % 4 == 0, f"a {qtype.name} weight at an address not 4-byte aligned"
    return words, raw.view(np.int8)


def matvec_gpu(raw, xq, xds, out, qtype, shape: tuple[int, int], stream=0, bias=None,
               gated=None) -> None:  # fmt: skip
    """out [T, n_rows] (device) = the quantized activations of T tokens (xq, xds from
    `quantize_gpu`, room for `activation_words`) times the weight in `raw` (device bytes, at a
    4-byte aligned address for a type read in 32-bit words), + bias [n_rows] when given;
    `gated` = (gate, act, use_gelu): act [T, n_rows] = act(gate) * out as well."""
    n_rows, n_cols = shape
    n_tokens = out.shape[0]
    assert n_tokens <= MAX_TOKENS and n_cols % UNITS[qtype].values == 0 and out.shape[1] == n_rows
    assert xq.size >= activation_words(n_tokens, n_cols)[0]
    gate, act, glu = (out, out, 0) if gated is None else (gated[0], gated[1], 1 + bool(gated[2]))
    gpu_kernel(qtype, pass_tokens(n_tokens))[-(-n_rows // ROWS), ROWS * THREADS, stream](
        *weights_in(raw, qtype), xq, xq.view(np.uint32), xds, out,
        out[0] if bias is None else bias, bias is not None, gate, act, np.int64(glu),
        np.uint32(n_cols), np.uint32(n_tokens),
    )  # fmt: skip


def matvec3_gpu(raws, xq, xds, outs, qtypes, n_cols: int, biases, stream=0) -> None:
    """outs[i] [T, rows_i] = the quantized activations of T tokens times weight i (+ biases[i]
    where not None), i = 0, 1, 2, in one launch."""
    n_tokens = outs[0].shape[0]
    assert n_tokens <= MAX_TOKENS and all(n_cols % UNITS[q].values == 0 for q in qtypes)
    assert xq.size >= activation_words(n_tokens, n_cols)[0]
    grid = sum(-(-o.shape[1] // ROWS) for o in outs)
    triple_kernel(*qtypes, pass_tokens(n_tokens))[grid, ROWS * THREADS, stream](
        *(a for r, q in zip(raws, qtypes) for a in weights_in(r, q)), xq, xq.view(np.uint32),
        xds, *outs, *(o[0] if b is None else b for b, o in zip(biases, outs)),
        *(b is not None for b in biases), np.uint32(n_cols), np.uint32(n_tokens),
    )  # fmt: skip


@lru_cache(maxsize=None)
def expert_kernel(qtype):
    """A slot's expert row times the slot's activations (llama.cpp's mul_mat_vec_q with expert
    ids): a warp per (row, slot), one token at a pass."""
    dots, unit = row_dots(qtype, 1), UNITS[qtype]
    values, block_words = unit.values, unit.block_words

    @cuda.jit
    def expert_matvec(w, wb, cache, cache_b, xq, xq32, xds, ids, out, n_cols, per_slot_input,
                      n_cached):  # fmt: skip
        """out [slots, n_rows]: the expert at place p (ids[t, j] of slot t * k + j) is the p-th
        of `cache` below `n_cached`, else the (p - n_cached)-th of `w` (an expert cache, and a
        routed copy), times activation row slot (per_slot_input) or t."""
        lane, warp = uint32(cuda.threadIdx.x % THREADS), uint32(cuda.threadIdx.x // THREADS)
        row, slot = uint32(cuda.blockIdx.x * ROWS + warp), uint32(cuda.blockIdx.y)
        n_rows, k = uint32(out.shape[1]), uint32(ids.shape[1])
        t = uint32(slot // k)
        src = slot if per_slot_input else t
        place = uint32(ids[t, slot - t * k])
        held = place < n_cached
        expert = place if held else uint32(place - n_cached)
        blocks = uint32(n_cols // values)
        base = uint32((expert * n_rows + min(row, n_rows - 1)) * blocks * block_words)
        row_words, row_groups = uint32(n_cols >> 3), uint32(n_cols >> 5)
        # a call per buffer: a pointer chosen between the two would be a generic one (LD, not LDG)
        if held:
            (a,) = dots(cache, cache_b, xq, xq32, xds, base, src, blocks, row_words, row_groups,
                        lane)  # fmt: skip
        else:
            (a,) = dots(w, wb, xq, xq32, xds, base, src, blocks, row_words, row_groups, lane)
        a = warp_sum(a)
        if lane == 0 and row < n_rows:
            out[slot, row] = a

    return expert_matvec


def expert_matvec_gpu(raw, xq, xds, ids, out, qtype, shape: tuple[int, int], per_slot_input: bool,
                      stream=0, cache=None, n_cached: int = 0) -> None:  # fmt: skip
    """out [slots, n_rows] (device) = each slot's expert (ids [T, k]) of the expert tensor in
    `raw` (device bytes; per-expert shape `shape`) times the quantized activations (xq, xds of
    `quantize_gpu`) of row slot or of the slot's token; with an expert `cache` of `n_cached`
    experts, ids are places: in the cache first, then in `raw`."""
    n_rows, n_cols = shape
    assert n_cols % UNITS[qtype].values == 0 and out.shape[1] == n_rows
    grid = (-(-n_rows // ROWS), out.shape[0])
    expert_kernel(qtype)[grid, ROWS * THREADS, stream](
        *weights_in(raw, qtype), *weights_in(raw if cache is None else cache, qtype), xq,
        xq.view(np.uint32), xds, ids, out, np.uint32(n_cols), per_slot_input, np.uint32(n_cached),
    )  # fmt: skip
