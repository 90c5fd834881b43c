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

On a host without AVX-512 VNNI the same IR is written with generic integer vectors (LLVM's own
lowering): correct, slower.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import FAST, F32, I32, I8, Arrays, _host_has, _shuffle, _x86, broadcast, vec

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


@lru_cache(maxsize=None)
def tile_kernel(group: int, has_min: bool, native: bool = VNNI512):
    """The micro-kernel `tile(q, d, m, c, xu, xd, xs, out, tile, t0, n_groups, n_cols, n_rows)`:
    out[t0 + t, 16 tile + r] for t < 8, r < 16 = row 16 tile + r of the panel (q, d, m, c as
    `q8_panel.Panel` lays them out, flat) times token t0 + t's activations (xu: their int8 bytes
    with the sign bit flipped, [T, n_cols] flat; xd, xs: [T, n_cols / 32] flat)."""
    quads = group // 4

    def impl(typingctx, q, d, m, c, xu, xd, xs, out, tile, t0, n_groups, n_cols, n_rows):
        sig = types.void(q, d, m, c, xu, xd, xs, out, tile, t0, n_groups, n_cols, n_rows)

        def codegen(context, b, sig, args):
            arr = Arrays(context, b, sig, args)
            tile_, t0_, n_groups_, n_cols_, n_rows_ = args[8:]
            i64 = tile_.type

            def k(v):
                return ir.Constant(i64, v)

            f32x16 = vec(F32, 16)
            accs = [cgutils.alloca_once_value(b, ir.Constant(f32x16, [0.0] * 16))
                    for _ in range(TOKENS)]  # fmt: skip
            tile_groups = b.mul(tile_, n_groups_)
            n_xgroups = b.udiv(n_cols_, k(32))
            with cgutils.for_range(b, n_groups_) as loop:
                g = loop.index
                tg = b.add(tile_groups, g)  # the (tile, group) index
                qbase = b.mul(tg, k(quads * ROWS * 4))
                w = [arr.load(Q, b.add(qbase, k(64 * i)), I32, 16) for i in range(quads)]
                sbase = b.mul(tg, k(ROWS))
                dw = arr.load(D, sbase, F32, 16)
                cw = arr.load(C, sbase, I32, 16)
                mw = arr.load(M, sbase, F32, 16) if has_min else None
                col = b.mul(g, k(group))
                xg = b.udiv(col, k(32))
                for t in range(TOKENS):
                    tok = b.add(t0_, k(t))
                    xrow = b.mul(tok, n_cols_)
                    isum = cw
                    for i in range(quads):
                        xq = arr.load(XU, b.add(xrow, b.add(col, k(4 * i))), I32)
                        isum = dot4_512(b, isum, broadcast(b, xq, 16), w[i], native)
                    gi = b.add(b.mul(tok, n_xgroups), xg)
                    scale = b.fmul(dw, broadcast(b, arr.load(XD, gi, F32), 16), flags=FAST)
                    part = b.fmul(b.sitofp(isum, f32x16), scale, flags=FAST)
                    acc = b.fadd(b.load(accs[t]), part, flags=FAST)
                    if has_min:
                        offs = b.fmul(mw, broadcast(b, arr.load(XS, gi, F32), 16), flags=FAST)
                        acc = b.fadd(acc, offs, flags=FAST)
                    b.store(acc, accs[t])
            for t in range(TOKENS):
                at = b.add(b.mul(b.add(t0_, k(t)), n_rows_), b.mul(tile_, k(ROWS)))
                ptr = b.bitcast(b.gep(arr.data[OUT], [at]), f32x16.as_pointer())
                b.store(b.load(accs[t]), ptr, align=4)
            return context.get_dummy_value()

        return sig, codegen

    impl.__name__ = f"q8_tile_g{group}{'_min' if has_min else ''}{'' if native else '_generic'}"
    return intrinsic(impl)


@lru_cache(maxsize=None)
def gemm_kernel(group: int, has_min: bool, native: bool = VNNI512):
    tile = tile_kernel(group, has_min, native)

    @njit(parallel=True)
    def gemm(q, d, m, c, xu, xd, xs, out, n_tiles, n_groups, n_cols, n_rows):
        n_chunks = xd.size // (n_cols // 32) // TOKENS
        for tl in prange(n_tiles):
            for ch in range(n_chunks):
                tile(q, d, m, c, xu, xd, xs, out, tl, ch * TOKENS, n_groups, n_cols, n_rows)

    return gemm


def product(panel, q8: tuple, out: np.ndarray) -> None:
    """out [T, n_rows] = the activations (`cpu.quantize_activations`' x8, xd, xs) times the
    repacked weight (`q8_panel.Panel`), on the calling thread's Numba threads. Tokens go in
    whole micro-kernel calls: a count that is not a multiple of 8 is padded with zero tokens."""
    x8, xd, xs = q8
    n_tokens, n_cols = x8.shape
    padded = -(-n_tokens // TOKENS) * TOKENS
    xu = np.full((padded, n_cols), 128, np.uint8)
    np.bitwise_xor(x8.view(np.uint8), np.uint8(128), out=xu[:n_tokens])
    if padded != n_tokens:
        xd = np.concatenate([xd, np.zeros((padded - n_tokens, xd.shape[1]), np.float32)])
        xs = np.concatenate([xs, np.zeros((padded - n_tokens, xs.shape[1]), np.float32)])
    full = out if padded == n_tokens else np.empty((padded, panel.n_rows), np.float32)
    gemm_kernel(panel.group, panel.has_min)(
        panel.q, panel.d, panel.m, panel.c, xu.reshape(-1), np.ascontiguousarray(xd).reshape(-1),
        np.ascontiguousarray(xs).reshape(-1), full.reshape(-1), panel.n_rows // ROWS,
        panel.n_cols // panel.group, panel.n_cols, panel.n_rows,
    )  # fmt: skip
    if full is not out:
        out[:] = full[:n_tokens]
