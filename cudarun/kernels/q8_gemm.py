"""A prompt's matrix products in int8: the weight repacked once into tiles of 16 rows
(`q8_panel`), the activations quantized to int8 per 32 as the decode rows' are, and a micro-kernel
that takes 16 rows x 8 tokens at a time in 512-bit integer dot products.

A tile's group of G values (32; Q6_K's scales cover 16) is G / 4 vectors of 64 bytes: vector i
holds values 4i..4i+3 of each of the 16 rows. One `vpdpbusd` multiplies it by a token's four
activation bytes broadcast to every lane and adds each row's four products to its lane, so G / 4
of them give 16 rows' group sums for one token; each weight vector is loaded once for 8 tokens.
Each group sum is then scaled once, in fp32: d (the row's scale of the group) times the token's
activation scale, plus the row's offset m times the token's sum over the group (`xs`).

vpdpbusd multiplies unsigned bytes by signed ones: the activations go unsigned (x + 128, one
XOR of the sign bit) and the weights signed (q less its type's midpoint, or q where the type has
a minimum), so each group sum counts 128 times the weights' sum too; the panel keeps -128 times
that sum per row and group (`c`), and a group's sums start from it. Every step is exact in
integers: the result is the dot product of the dequantized weights with the dequantized
activations, as the decode rows' (`simd.q8_row`) and llama.cpp's are.

An AVX2 host without AVX-512 VNNI runs half tiles of 8 rows in 256-bit vectors (pmaddubsw and
pmaddwd, `half_tile_kernel`); any other host the 512-bit kernel's generic integer IR (LLVM's own
lowering): correct, slower.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from . import simd
from .simd import FAST, F32, I16, I32, I8, Arrays, _host_has, _shuffle, _x86, broadcast, vec

ROWS = 16  # a tile's rows: one 32-bit lane of a 512-bit vector each
TOKENS = 8  # tokens of one micro-kernel call: each weight vector serves them all
VNNI512 = _host_has("avx512vnni") and _host_has("avx512f")

# argument positions of the micro-kernel
Q, D, M, C, XU, XD, XS, OUT = range(8)


def dot4_512(b, acc, u8, s8, native: bool = VNNI512):
    """acc <16 x i32> + the sums of four unsigned-by-signed byte products per lane (u8, s8:
    <16 x i32> holding 64 bytes each): vpdpbusd, or its generic IR."""
    i32x16 = vec(I32, 16)
    if native:
        return _x86(b, "llvm.x86.avx512.vpdpbusd.512", i32x16, acc, u8, s8)
    wide = vec(I32, 64)
    prod = b.mul(b.zext(b.bitcast(u8, vec(I8, 64)), wide), b.sext(b.bitcast(s8, vec(I8, 64)), wide))
    quads = [_shuffle(b, prod, range(k, 64, 4)) for k in range(4)]
    return b.add(acc, b.add(b.add(quads[0], quads[1]), b.add(quads[2], quads[3])))


def _micro_kernel(name: str, group: int, has_min: bool, lanes: int, excess: bool, int_sum):
    """A micro-kernel `kernel(q, d, m, c, x, xd, xs, out, unit, t0, n_groups, n_cols, n_rows)`:
    out[t0 + t, lanes unit + r] for t < 8, r < lanes = row lanes unit + r of the panel (q, d, m,
    c as `q8_panel.Panel` lays them out, flat) times token t0 + t's activations (x: their int8
    bytes, [T, n_cols] flat; xd, xs: [T, n_cols / 32] flat). A unit is a tile (16 lanes) or
    part of one: lanes of each of its 64-byte vectors' rows. `int_sum(b, xb, wv, cw)` gives a
    group's <lanes x i32> sums for one token from xb(i) (its four bytes of quad i broadcast),
    wv(i) (the unit's weight bytes of quad i), each <lanes x i32>, and cw: the rows' c (the
    unsigned activations' excess) where `excess`, else None (signed activations)."""
    quads, parts = group // 4, ROWS // lanes

    def impl(typingctx, q, d, m, c, x, xd, xs, out, unit, t0, n_groups, n_cols, n_rows):
        sig = types.void(q, d, m, c, x, xd, xs, out, unit, t0, n_groups, n_cols, n_rows)

        def codegen(context, b, sig, args):
            arr = Arrays(context, b, sig, args)
            unit_, t0_, n_groups_, n_cols_, n_rows_ = args[8:]
            i64 = unit_.type

            def k(v):
                return ir.Constant(i64, v)

            f32v = vec(F32, lanes)
            accs = [cgutils.alloca_once_value(b, ir.Constant(f32v, [0.0] * lanes))
                    for _ in range(TOKENS)]  # fmt: skip
            tile_groups = b.mul(b.udiv(unit_, k(parts)), n_groups_)
            part = b.urem(unit_, k(parts))
            n_xgroups = b.udiv(n_cols_, k(32))
            with cgutils.for_range(b, n_groups_) as loop:
                g = loop.index
                tg = b.add(tile_groups, g)  # the (tile, group) index
                qbase = b.add(b.mul(tg, k(quads * ROWS * 4)), b.mul(part, k(4 * lanes)))
                w = [arr.load(Q, b.add(qbase, k(64 * i)), I32, lanes) for i in range(quads)]
                sbase = b.add(b.mul(tg, k(ROWS)), b.mul(part, k(lanes)))
                dw = arr.load(D, sbase, F32, lanes)
                mw = arr.load(M, sbase, F32, lanes) if has_min else None
                cw = arr.load(C, sbase, I32, lanes) if excess else None
                col = b.mul(g, k(group))
                xg = b.udiv(col, k(32))
                for t in range(TOKENS):
                    tok = b.add(t0_, k(t))
                    xcol = b.add(b.mul(tok, n_cols_), col)

                    def xb(i, xcol=xcol):
                        return broadcast(b, arr.load(XU, b.add(xcol, k(4 * i)), I32), lanes)

                    isum = int_sum(b, xb, w.__getitem__, cw)
                    gi = b.add(b.mul(tok, n_xgroups), xg)
                    scale = b.fmul(dw, broadcast(b, arr.load(XD, gi, F32), lanes), flags=FAST)
                    part_sum = b.fmul(b.sitofp(isum, f32v), scale, flags=FAST)
                    acc = b.fadd(b.load(accs[t]), part_sum, flags=FAST)
                    if has_min:
                        offs = b.fmul(mw, broadcast(b, arr.load(XS, gi, F32), lanes), flags=FAST)
                        acc = b.fadd(acc, offs, flags=FAST)
                    b.store(acc, accs[t])
            for t in range(TOKENS):
                at = b.add(b.mul(b.add(t0_, k(t)), n_rows_), b.mul(unit_, k(lanes)))
                ptr = b.bitcast(b.gep(arr.data[OUT], [at]), f32v.as_pointer())
                b.store(b.load(accs[t]), ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = name
    return intrinsic(impl)


@lru_cache(maxsize=None)
def tile_kernel(group: int, has_min: bool, native: bool = VNNI512):
    """The 512-bit micro-kernel (`_micro_kernel` over whole tiles): one vpdpbusd (or its generic
    IR) per quad and token, from the rows' c; x with the sign bit flipped."""

    def int_sum(b, xb, wv, cw):
        isum = cw
        for i in range(group // 4):
            isum = dot4_512(b, isum, xb(i), wv(i), native)
        return isum

    name = f"q8_tile_g{group}{'_min' if has_min else ''}{'' if native else '_generic'}"
    return _micro_kernel(name, group, has_min, ROWS, True, int_sum)


def _sign_form(q_bound: int) -> bool:
    """Whether AVX2's pmaddubsw needs the weights' signs moved onto signed activations: a pair
    of unsigned activation bytes (up to 255) times |q| up to 128 overflows its 16 bits, 127 x
    128 x 2 does not."""
    return q_bound > 64


@lru_cache(maxsize=None)
def half_tile_kernel(group: int, has_min: bool, q_bound: int):
    """The AVX2 micro-kernel (`_micro_kernel` over half tiles of 8 rows, 256-bit vectors: eight
    float accumulators, where a whole tile's sixteen would be every register AVX2 has):
    pmaddubsw's 16-bit pair sums, then pmaddwd with ones. Where |q| <= 32, two quads' pair sums
    are added in 16 bits first (2 x 2 x 255 x 32 < 2^15); where `_sign_form`, x is signed and
    takes the weights' signs, else it has the sign bit flipped and the sums start from c."""
    quads, sign = group // 4, _sign_form(q_bound)
    step = 2 if q_bound <= 32 and quads % 2 == 0 else 1
    ones = simd.splat(I16, 16, 1)

    def int_sum(b, xb, wv, cw):
        def u8(v):
            return b.bitcast(v, vec(I8, 32))

        isum = cw
        for i in range(0, quads, step):
            if sign:
                w = u8(wv(i))
                p = simd.maddubs(b, simd.abs8(b, w), simd.sign_of(b, u8(xb(i)), w))
            else:
                p = simd.maddubs(b, u8(xb(i)), u8(wv(i)))
                if step == 2:
                    p = b.add(p, simd.maddubs(b, u8(xb(i + 1)), u8(wv(i + 1))))
            s = simd.madd(b, p, ones)
            isum = s if isum is None else b.add(isum, s)
        return isum

    name = f"q8_half_tile_g{group}{'_min' if has_min else ''}_q{q_bound}"
    return _micro_kernel(name, group, has_min, ROWS // 2, not sign, int_sum)


# which micro-kernel a host runs: 512-bit vpdpbusd, AVX2's pmaddubsw on half tiles, or generic IR
ISA = "vnni512" if VNNI512 else "avx2" if simd.AVX2 else "generic"


def signed_activations(isa: str, q_bound: int) -> bool:
    """Whether the kernel takes the activations as signed bytes (else with the sign bit flipped)."""
    return isa == "avx2" and _sign_form(q_bound)


@lru_cache(maxsize=None)
def gemm_kernel(group: int, has_min: bool, q_bound: int, isa: str = ISA):
    if isa == "avx2":
        kernel, parts = half_tile_kernel(group, has_min, q_bound), 2
    else:
        kernel, parts = tile_kernel(group, has_min, isa == "vnni512"), 1

    @njit(parallel=True)
    def gemm(q, d, m, c, x, xd, xs, out, n_tiles, n_groups, n_cols, n_rows):
        n_chunks = xd.size // (n_cols // 32) // TOKENS
        for unit in prange(parts * n_tiles):  # a tile's parts on one thread: its lines once
            for ch in range(n_chunks):
                kernel(q, d, m, c, x, xd, xs, out, unit, ch * TOKENS, n_groups, n_cols, n_rows)

    return gemm


def product(panel, q8: tuple, out: np.ndarray) -> None:
    """out [T, n_rows] = the activations (`cpu.quantize_activations`' x8, xd, xs) times the
    repacked weight (`q8_panel.Panel`), on the calling thread's Numba threads. Tokens go in
    whole micro-kernel calls: a count that is not a multiple of 8 is padded with zero tokens."""
    x8, xd, xs = q8
    n_tokens, n_cols = x8.shape
    padded = -(-n_tokens // TOKENS) * TOKENS
    if signed_activations(ISA, panel.q_bound):
        xu = np.zeros((padded, n_cols), np.uint8)
        xu[:n_tokens] = x8.view(np.uint8)
    else:
        xu = np.full((padded, n_cols), 128, np.uint8)
        np.bitwise_xor(x8.view(np.uint8), np.uint8(128), out=xu[:n_tokens])
    if padded != n_tokens:
        xd = np.concatenate([xd, np.zeros((padded - n_tokens, xd.shape[1]), np.float32)])
        xs = np.concatenate([xs, np.zeros((padded - n_tokens, xs.shape[1]), np.float32)])
    full = out if padded == n_tokens else np.empty((padded, panel.n_rows), np.float32)
    gemm_kernel(panel.group, panel.has_min, panel.q_bound)(
        panel.q, panel.d, panel.m, panel.c, xu.reshape(-1), np.ascontiguousarray(xd).reshape(-1),
        np.ascontiguousarray(xs).reshape(-1), full.reshape(-1), panel.n_rows // ROWS,
        panel.n_cols // panel.group, panel.n_cols, panel.n_rows,
    )  # fmt: skip
    if full is not out:
        out[:] = full[:n_tokens]
