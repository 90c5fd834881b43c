"""Row dot products for the CPU kernels, written as LLVM IR through Numba intrinsics.

Numba's auto-vectorizer turns a scalar loop over 4-bit or 8-bit quants into float conversions and
FMAs, 8 values per instruction: on a two-core host that decoded Q4_K at a quarter of llama.cpp's
rate. These intrinsics do what ggml's CPU kernels do, with activations quantized to int8 (the
"q8" path; docs/contracts.md tolerance for int8 activation dot products): unsigned-by-signed byte
products summed in pairs (`pmaddubsw`), pairs of those summed with the sub-block scales
(`pmaddwd`), the block sums kept in a float vector and reduced once per row. On x86 with AVX2
those two instructions are named, and where the host has VNNI one `vpdpbusd` does both for the
32-value types and Q8_0; elsewhere the same operations are generic IR.

A row intrinsic (`q8_row(type, tokens)`) returns one row's dot products with `tokens` tokens'
quantized activations: `x8` int8 values, `xd` their float32 scale per 32 values, `xs` the sum
per 32 of the quantized values times their scale. The weight's minimums and offsets multiply
`xs`: using the quantized sum makes a block's result the exact dot of its dequantized weights
with the dequantized activations, whose error does not grow with the weights' mean. llama.cpp
groups K-quant activations by 256; groups of 32 cost a float multiply per sub-block and halve
the error on Gaussian inputs. Weight offsets are bytes of the GGUF tensor.
"""

from __future__ import annotations

import os
from functools import lru_cache

from gguf import GGMLQuantizationType as Q
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from refengine.quants import QTYPES

I8, I16, I32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
F32 = ir.FloatType()
FAST = ("fast",)


def vec(ty, n):
    return ir.VectorType(ty, n)


def splat(ty, n, value):
    return ir.Constant(vec(ty, n), [value] * n)


class Arrays:
    """Typed pointers to the data of the intrinsic's array arguments."""

    def __init__(self, context, builder, sig, args):
        self.builder = builder
        self.data = {}
        for i, (ty, value) in enumerate(zip(sig.args, args)):
            if isinstance(ty, types.Array):
                self.data[i] = context.make_array(ty)(context, builder, value).data

    def load(self, arg, offset, elem, count=0):
        """`count` elements of `elem` (a scalar if 0) at element `offset` of array argument `arg`;
        the element type of a load may differ from the array's (offset is in the array's)."""
        b = self.builder
        ptr = b.gep(self.data[arg], [offset])
        ty = elem if count == 0 else vec(elem, count)
        return b.load(b.bitcast(ptr, ty.as_pointer()), align=1)

    def prefetch(self, arg, offset):
        """A hint to bring the cache line at element `offset` of array argument `arg` into L1
        (`prefetcht0`): no fault if it lies past the array."""
        b = self.builder
        i8p = I8.as_pointer()
        ptr = b.bitcast(b.gep(self.data[arg], [offset]), i8p)
        name = "llvm.prefetch.p0i8"
        fn = b.module.globals.get(name) or ir.Function(
            b.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), name)
        b.call(fn, [ptr, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def _shuffle(b, v, idx):
    return b.shuffle_vector(v, v, ir.Constant(vec(I32, len(idx)), list(idx)))


def _halves(b, v):
    n = v.type.count // 2
    return _shuffle(b, v, range(n)), _shuffle(b, v, range(n, 2 * n))


def _pairs(b, v):
    n = v.type.count // 2
    return _shuffle(b, v, range(0, 2 * n, 2)), _shuffle(b, v, range(1, 2 * n, 2))


def _host_has(feature: str) -> bool:
    import llvmlite.binding as llvm

    try:
        return bool(llvm.get_host_cpu_features().get(feature, False))
    except RuntimeError:  # no feature list on this host: the generic IR
        return False


# LLVM does not recognize pmaddubsw in the generic form below when the IR is already vectorized,
# so on x86 with AVX2 the instruction is named; elsewhere the generic form is correct, slower.
AVX2 = _host_has("avx2")
# vpdpbusd: four unsigned-by-signed byte products summed into each int32 lane, one instruction
# where pmaddubsw + pmaddwd take two (and a third for a sign-extended Q8_0 block); AVX512-VNNI
# (with VL, for 256-bit vectors) or AVX-VNNI
VNNI = AVX2 and ((_host_has("avx512vnni") and _host_has("avx512vl")) or _host_has("avxvnni"))


def _x86(b, name, ret, *args):
    fn = b.module.globals.get(name) or ir.Function(
        b.module, ir.FunctionType(ret, [a.type for a in args]), name
    )
    return b.call(fn, list(args))


def maddubs(b, u8, s8):
    """<2n x i8> unsigned u, signed s -> <n x i16>: u[2i] s[2i] + u[2i+1] s[2i+1], saturated
    (pmaddubsw; our operands never reach the saturation)."""
    n = u8.type.count // 2
    if AVX2 and n == 16:
        return _x86(b, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), u8, s8)
    (ue, uo), (se, so) = _pairs(b, u8), _pairs(b, s8)
    wide = vec(I32, n)
    total = b.add(
        b.mul(b.zext(ue, wide), b.sext(se, wide)), b.mul(b.zext(uo, wide), b.sext(so, wide))
    )
    lo, hi = splat(I32, n, -32768), splat(I32, n, 32767)
    total = b.select(b.icmp_signed("<", total, lo), lo, total)
    total = b.select(b.icmp_signed(">", total, hi), hi, total)
    return b.trunc(total, vec(I16, n))


def madd(b, x16, y16):
    """<2n x i16> -> <n x i32>: x[2i] y[2i] + x[2i+1] y[2i+1] (pmaddwd)."""
    n = x16.type.count // 2
    if AVX2 and n == 8:
        return _x86(b, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), x16, y16)
    if AVX2 and n == 16:  # two instructions
        (x0, x1), (y0, y1) = _halves(b, x16), _halves(b, y16)
        lo, hi = madd(b, x0, y0), madd(b, x1, y1)
        return b.shuffle_vector(lo, hi, ir.Constant(vec(I32, 16), list(range(16))))
    (xe, xo), (ye, yo) = _pairs(b, x16), _pairs(b, y16)
    wide = vec(I32, n)
    return b.add(
        b.mul(b.sext(xe, wide), b.sext(ye, wide)), b.mul(b.sext(xo, wide), b.sext(yo, wide))
    )


def dot4(b, u8, s8):
    """<32 x i8> unsigned u, signed s -> <8 x i32>: lane j = sum of u[i] s[i] over i = 4j..4j+3
    (vpdpbusd where the host has VNNI, else pmaddubsw then pmaddwd with ones: the same sums, since
    our operands never reach pmaddubsw's saturation)."""
    if VNNI:
        name = ("llvm.x86.avx512.vpdpbusd.256" if _host_has("avx512vnni")
                else "llvm.x86.avxvnni.vpdpbusd.256")  # fmt: skip
        i32x8 = vec(I32, 8)
        zero = ir.Constant(i32x8, [0] * 8)
        return _x86(b, name, i32x8, zero, b.bitcast(u8, i32x8), b.bitcast(s8, i32x8))
    return madd(b, maddubs(b, u8, s8), splat(I16, 16, 1))


def dot2_16(b, x16, y16):
    """<32 x i16> x, y -> <8 x i32>: lane j = the sum of x[i] y[i] over i = 2j, 2j+1 and
    2j+16, 2j+17 (two vpdpwssd where the host has VNNI, else two pmaddwd and an add)."""
    if VNNI:
        name = ("llvm.x86.avx512.vpdpwssd.256" if _host_has("avx512vnni")
                else "llvm.x86.avxvnni.vpdpwssd.256")  # fmt: skip
        i32x8 = vec(I32, 8)
        (x0, x1), (y0, y1) = _halves(b, x16), _halves(b, y16)
        acc = ir.Constant(i32x8, [0] * 8)
        for xh, yh in ((x0, y0), (x1, y1)):
            acc = _x86(b, name, i32x8, acc, b.bitcast(xh, i32x8), b.bitcast(yh, i32x8))
        return acc
    return sum8(b, madd(b, x16, y16))


def sign_of(b, x8, w8):
    """<32 x i8>: x where w > 0, -x where w < 0, 0 where w = 0 (psignb), so that
    |w| (unsigned) times it is w x; x is never -128 (activations are quantized to +-127)."""
    if AVX2:
        return _x86(b, "llvm.x86.avx2.psign.b", vec(I8, 32), x8, w8)
    zero = splat(I8, 32, 0)
    neg = b.select(b.icmp_signed("<", w8, zero), b.sub(zero, x8), x8)
    return b.select(b.icmp_signed("==", w8, zero), zero, neg)


def abs8(b, w8):
    """<32 x i8> |w|, read as unsigned (|-128| = 128)."""
    zero = splat(I8, 32, 0)
    return b.select(b.icmp_signed("<", w8, zero), b.sub(zero, w8), w8)


def sum8(b, v16):
    """<16 x i32> -> <8 x i32> by adding its halves."""
    lo, hi = _halves(b, v16)
    return b.add(lo, hi)


def reduce_fadd(b, v):
    mod = b.module
    name = f"llvm.vector.reduce.fadd.v{v.type.count}f32"
    fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(F32, [F32, v.type]), name)
    return b.call(fn, [ir.Constant(F32, 0.0), v], fastmath=FAST)


@intrinsic
def half_bits(typingctx, bits):
    """The fp16 with these 16 bits (a uint16), as float32: Numba's CPU target has no float16
    arrays, so an f16 KV cache is read as uint16 (x86 F16C: one vcvtph2ps)."""

    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)

    return types.float32(bits), codegen


@intrinsic
def float_of_bits(typingctx, bits):
    """The float32 whose 32 bits are these (an int32): 2^n built in its exponent field."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], F32)

    return types.float32(types.int32), codegen


# positions of the activation arrays among a row intrinsic's arguments
X8, XD, XS = 2, 3, 4


def half_at(arrays, arg, offset):
    return arrays.builder.fpext(arrays.load(arg, offset, ir.HalfType()), F32)


def broadcast(b, scalar, n):
    one = b.insert_element(ir.Constant(vec(scalar.type, n), None), scalar, ir.Constant(I32, 0))
    return _shuffle(b, one, [0] * n)


def _const(value, like):
    return ir.Constant(like.type, value)


def _at(b, base, value):
    return b.add(base, _const(value, base))


# How far ahead of the block it decodes a row loop asks for the weight's cache lines: a decode
# reads each weight once, from DRAM, and two cores' hardware prefetchers alone fed a Q4_K matvec
# 6.7 GB/s where a 1 GiB parallel read gets 31; a prefetch 1 KiB ahead fed it 15.7, Q6_K 10.4 ->
# 19.0 (docs/measured/2026-12-01-cpu-prefetch.txt; scripts/cpu_prefetch.py sweeps the distance
# through the variable, 0 for none). Rows follow one another in the tensor, so the lines ahead of
# a row's end are the next row's.
PREFETCH_BYTES = int(os.environ.get("REFENGINE_PREFETCH_BYTES", "1024"))


def _row_intrinsic(name, block, nbytes, per_block, tokens=1):
    """An intrinsic `name(w, w_offset, x8, xd, xs, n_blocks)` -> a tuple of `tokens` float32: the
    dot products of one row, n_blocks blocks of w from byte w_offset, with the q8 activations of
    tokens 0.. tokens - 1 (x8 [T, n], xd and xs [T, n / 32]). `block(b, arr, base, x_at, g_at)`
    returns one block's contribution for one token, its activations from x8 element x_at and
    xd/xs element g_at: (<8 x float> partial sums, float offset or None). The tokens' calls share
    one block base, so LLVM computes the weight's loads and unpacking once for all of them."""

    def impl(typingctx, w, w_offset, x8, xd, xs, n_blocks):
        sig = types.UniTuple(types.float32, tokens)(w, w_offset, x8, xd, xs, n_blocks)

        def codegen(context, b, sig, args):
            arr = Arrays(context, b, sig, args)
            w_off, nb = args[1], args[5]
            n_cols = cgutils.unpack_tuple(
                b, context.make_array(sig.args[2])(context, b, args[2]).shape, 2
            )[1]
            n_groups = b.udiv(n_cols, _const(32, n_cols))
            zero8 = ir.Constant(vec(F32, 8), [0.0] * 8)
            accs = [cgutils.alloca_once_value(b, zero8) for _ in range(tokens)]
            offsets = [cgutils.alloca_once_value(b, ir.Constant(F32, 0.0)) for _ in range(tokens)]
            with cgutils.for_range(b, nb) as loop:
                blk = loop.index
                base = b.add(w_off, b.mul(blk, _const(nbytes, blk)))
                for line in range(0, nbytes if PREFETCH_BYTES else 0, 64):  # the block's lines
                    arr.prefetch(0, _at(b, base, PREFETCH_BYTES + line))
                groups = b.mul(blk, _const(per_block // 32, blk))
                for row, (acc, offs) in enumerate(zip(accs, offsets)):
                    x_at = b.add(
                        b.mul(_const(row, n_cols), n_cols), b.mul(blk, _const(per_block, blk))
                    )
                    g_at = b.add(b.mul(_const(row, n_groups), n_groups), groups)
                    part, offset = block(b, arr, base, x_at, g_at)
                    b.store(b.fadd(b.load(acc), part, flags=FAST), acc)
                    if offset is not None:
                        b.store(b.fadd(b.load(offs), offset, flags=FAST), offs)
            sums = [
                b.fadd(reduce_fadd(b, b.load(acc)), b.load(offs), flags=FAST)
                for acc, offs in zip(accs, offsets)
            ]
            if block in ROW_SCALED:
                sums = [b.fmul(v, _xd(b, arr, b.mul(_const(row, n_groups), n_groups), 0),
                               flags=FAST) for row, v in enumerate(sums)]  # fmt: skip
            return context.make_tuple(b, sig.return_type, sums)

        return sig, codegen

    impl.__name__ = name
    return intrinsic(impl)


def scaled(b, isum, scale):
    """float(<8 x i32> isum) * scale."""
    return b.fmul(b.sitofp(isum, vec(F32, 8)), broadcast(b, scale, 8), flags=FAST)


def _xd(b, arr, g_at, group):
    return arr.load(XD, _at(b, g_at, group), F32)


def _nibbles32(b, arr, at):
    """The 32 four-bit values packed in 16 bytes (low nibbles are values 0-15) as <32 x i8>."""
    w16 = arr.load(0, at, I8, 16)
    low = b.and_(w16, splat(I8, 16, 15))
    high = b.lshr(w16, splat(I8, 16, 4))  # one shift for all lanes: x86 has no per-byte shifts
    return b.shuffle_vector(low, high, ir.Constant(vec(I32, 32), list(range(32))))


def _fifth_bits(b, arr, at):
    """Bit j of the uint32 at byte `at`, as <32 x i8> of 0 or 16 (the Q5_0/Q5_1 fifth bit): its
    4 bytes spread to 8 lanes each, each lane masked by its own bit."""
    four = arr.load(0, at, I8, 4)
    spread = _shuffle(b, four, [j // 8 for j in range(32)])
    masks = ir.Constant(
        vec(I8, 32), [(1 << (j % 8)) - (256 if j % 8 == 7 else 0) for j in range(32)]
    )
    is_set = b.icmp_unsigned("!=", b.and_(spread, masks), splat(I8, 32, 0))
    return b.select(is_set, splat(I8, 32, 16), splat(I8, 32, 0))


def _block_q8_0(b, arr, base, x_at, g_at):
    w8 = arr.load(0, _at(b, base, QTYPES[Q.Q8_0].offset("qs")), I8, 32)
    x8 = arr.load(X8, x_at, I8, 32)
    if AVX2:  # |w| is shared by the tokens of a row; each token's x takes w's sign (pmaddubsw's
        # pairs stay below 2^15: 128 x 127 x 2)
        isum = dot4(b, abs8(b, w8), sign_of(b, x8, w8))
    else:
        isum = sum8(b, madd(b, b.sext(w8, vec(I16, 32)), b.sext(x8, vec(I16, 32))))
    scale = b.fmul(half_at(arr, 0, base), _xd(b, arr, g_at, 0), flags=FAST)
    return scaled(b, isum, scale), None


def _block_q8_0_x16(b, arr, base, x_at, g_at):
    """Q8_0 against int16 activations (`x8` is then an int16 array) of one scale a row: the head's
    path, 15 bits of each row's largest where int8 keeps 7 of each block's. The block's scale is
    the weight's alone; the row intrinsic applies the row's at the end (`ROW_SCALED`)."""
    w16 = b.sext(arr.load(0, _at(b, base, QTYPES[Q.Q8_0].offset("qs")), I8, 32), vec(I16, 32))
    isum = dot2_16(b, w16, arr.load(X8, x_at, I16, 32))
    return scaled(b, isum, half_at(arr, 0, base)), None


ROW_SCALED = {_block_q8_0_x16}  # blocks whose activations have one scale a row (xd[t, 0])


def _block_32(qs, qh, m, bias):
    """Q4_0, Q4_1, Q5_0, Q5_1: unsigned q (nibbles at byte qs, plus a fifth bit from the uint32 at
    qh, if any), value d (q - bias) or d q + m (the fp16 at byte m, if any); sum(x) comes from xs
    (the quantized activations' own sum)."""

    def block(b, arr, base, x_at, g_at):
        q = _nibbles32(b, arr, _at(b, base, qs))
        if qh:
            q = b.or_(q, _fifth_bits(b, arr, _at(b, base, qh)))
        isum = dot4(b, q, arr.load(X8, x_at, I8, 32))
        d = half_at(arr, 0, base)
        xs = arr.load(XS, g_at, F32)
        if m:
            offset = b.fmul(half_at(arr, 0, _at(b, base, m)), xs, flags=FAST)
        else:
            offset = b.fmul(b.fmul(d, ir.Constant(F32, -float(bias)), flags=FAST), xs, flags=FAST)
        return scaled(b, isum, b.fmul(d, _xd(b, arr, g_at, 0), flags=FAST)), offset

    return block


def k4_scales(b, arr, base):
    """The 8 six-bit scales and 8 minimums of a Q4_K/Q5_K block (12 bytes at base + 4) as two
    <8 x i8>: bytes 0-3 hold scales 0-3 and bytes 4-7 minimums 0-3 in their low 6 bits, whose top
    2 bits are the high bits of scales/minimums 4-7; bytes 8-11 hold the low 4 bits of those
    (low nibble: scale, high nibble: minimum)."""
    at = QTYPES[Q.Q4_K].offset("scales")  # Q5_K's too
    a, m, c = (arr.load(0, _at(b, base, at + 4 * i), I32) for i in range(3))

    def k(v):
        return ir.Constant(I32, v)

    low6, low4, two = k(0x3F3F3F3F), k(0x0F0F0F0F), k(0x03030303)
    sc_hi = b.or_(b.and_(c, low4), b.shl(b.and_(b.lshr(a, k(6)), two), k(4)))
    mn_hi = b.or_(b.and_(b.lshr(c, k(4)), low4), b.shl(b.and_(b.lshr(m, k(6)), two), k(4)))

    def bytes8(lo, hi):
        v = b.insert_element(ir.Constant(vec(I32, 2), None), lo, k(0))
        return b.bitcast(b.insert_element(v, hi, k(1)), vec(I8, 8))

    return bytes8(b.and_(a, low6), sc_hi), bytes8(b.and_(m, low6), mn_hi)


def _block_k(qh):
    """Q4_K (144 B) or Q5_K (176 B, qh: 32 bytes at 16 whose bit s is the fifth bit of sub-block
    s): d, dmin, 12 bytes of scales, 128 bytes of nibbles in 4 chunks of 32 bytes (low nibbles
    are sub-block 2c, high 2c+1); value d sc q - dmin m. Activations grouped by 256."""
    layout = QTYPES[Q.Q5_K if qh else Q.Q4_K]
    qs, dmin_at = layout.offset("qs"), layout.offset("dmin")
    qh_at = layout.offset("qh") if qh else 0

    def block(b, arr, base, x_at, g_at):
        scales, mins = k4_scales(b, arr, base)
        sc16 = b.zext(scales, vec(I16, 8))
        high = arr.load(0, _at(b, base, qh_at), I8, 32) if qh else None
        part = ir.Constant(vec(F32, 8), [0.0] * 8)
        for c in range(4):
            w8 = arr.load(0, _at(b, base, qs + 32 * c), I8, 32)
            for h, q in enumerate((b.and_(w8, splat(I8, 32, 15)), b.lshr(w8, splat(I8, 32, 4)))):
                s = 2 * c + h
                if qh:
                    bit = b.and_(b.lshr(high, splat(I8, 32, s)), splat(I8, 32, 1))
                    q = b.or_(q, b.shl(bit, splat(I8, 32, 4)))
                pairs = maddubs(b, q, arr.load(X8, _at(b, x_at, 32 * s), I8, 32))
                isum = madd(b, pairs, _shuffle(b, sc16, [s] * 16))
                part = b.fadd(part, scaled(b, isum, _xd(b, arr, g_at, s)), flags=FAST)
        # the minimums' term, lane s for sub-block s: added lane-wise to the partial sums (all
        # lanes are summed at the row's end), with no horizontal sum per block
        xs = arr.load(XS, g_at, F32, 8)
        dmin = broadcast(b, half_at(arr, 0, _at(b, base, dmin_at)), 8)
        mterm = b.fmul(b.fmul(b.uitofp(mins, vec(F32, 8)), xs, flags=FAST), dmin, flags=FAST)
        d = broadcast(b, half_at(arr, 0, base), 8)
        return b.fsub(b.fmul(part, d, flags=FAST), mterm, flags=FAST), None

    return block


def _block_q6_k(b, arr, base, x_at, g_at):
    """Q6_K (210 B / 256): ql[128], qh[64], int8 scales[16] (one per 16 values), d last; in each
    half n of 128 values, quarter k, lane l: q = (ql[64n + l + 32 (k & 1)] >> 4 (k >> 1)) & 15
    | ((qh[32n + l] >> 2k) & 3) << 4, value d sc[8n + l / 16 + 2k] (q - 32)."""
    layout = QTYPES[Q.Q6_K]
    sc16 = b.sext(arr.load(0, _at(b, base, layout.offset("scales")), I8, 16), vec(I16, 16))
    part = ir.Constant(vec(F32, 8), [0.0] * 8)
    bias = splat(I8, 32, 32)
    for n in range(2):
        high = arr.load(0, _at(b, base, layout.offset("qh") + 32 * n), I8, 32)
        for k in range(4):
            low = arr.load(0, _at(b, base, layout.offset("ql") + 64 * n + 32 * (k & 1)), I8, 32)
            low = b.and_(b.lshr(low, splat(I8, 32, 4 * (k >> 1))), splat(I8, 32, 15))
            hi2 = b.and_(b.lshr(high, splat(I8, 32, 2 * k)), splat(I8, 32, 3))
            q = b.or_(low, b.shl(hi2, splat(I8, 32, 4)))
            x8 = arr.load(X8, _at(b, x_at, 128 * n + 32 * k), I8, 32)
            pairs = b.sub(maddubs(b, q, x8), maddubs(b, bias, x8))  # (q - 32) x, in int16
            s = 8 * n + 2 * k
            isum = madd(b, pairs, _shuffle(b, sc16, [s] * 8 + [s + 1] * 8))
            part = b.fadd(part, scaled(b, isum, _xd(b, arr, g_at, 4 * n + k)), flags=FAST)
    d = broadcast(b, half_at(arr, 0, _at(b, base, layout.offset("d"))), 8)
    return b.fmul(part, d, flags=FAST), None


def _block_32_of(t):
    """`_block_32` at the type's field offsets; without a minimum, q less half its range."""
    q = QTYPES[t]
    qh = q.offset("qh") if q.has("qh") else 0
    m = q.offset("m") if q.has("m") else 0
    return _block_32(q.offset("qs"), qh, m, 0 if m else 8 << (1 if qh else 0))


# type name -> its block (bytes and values per block: refengine.quants.QTYPES)
Q8_BLOCKS = {
    "Q8_0": _block_q8_0,
    "Q4_0": _block_32_of(Q.Q4_0),
    "Q4_1": _block_32_of(Q.Q4_1),
    "Q5_0": _block_32_of(Q.Q5_0),
    "Q5_1": _block_32_of(Q.Q5_1),
    "Q4_K": _block_k(False),
    "Q5_K": _block_k(True),
    "Q6_K": _block_q6_k,
}


# type name -> the same against int16 activations (`quantize_activations16`)
Q16_BLOCKS = {"Q8_0": _block_q8_0_x16}


@lru_cache(maxsize=None)
def q8_row(type_name: str, tokens: int, wide: bool = False):
    """The row intrinsic of a type for `tokens` tokens at once (`wide`: int16 activations)."""
    block = (Q16_BLOCKS if wide else Q8_BLOCKS)[type_name]
    q = QTYPES[Q[type_name]]
    nbytes, per_block = q.block_nbytes, q.block_elems
    name = f"row_{type_name.lower()}_{'w' if wide else ''}x{tokens}"
    return _row_intrinsic(name, block, nbytes, per_block, tokens)


@intrinsic
def row_f16(typingctx, w, w_offset, x, x_offset, n):
    """sum_j fp16 w[j] * fp32 x[x_offset + j], j < n (a multiple of 8), w from byte w_offset of a
    uint8 array: an F16 row in fp32 accumulation (the exact path; no activation quantization)."""
    sig = types.float32(w, w_offset, x, x_offset, n)

    def codegen(context, b, sig, args):
        arr = Arrays(context, b, sig, args)
        w_off, x_off, count = args[1], args[3], args[4]
        acc = cgutils.alloca_once_value(b, ir.Constant(vec(F32, 8), [0.0] * 8))
        with cgutils.for_range(b, b.udiv(count, _const(8, count))) as loop:
            i = b.mul(loop.index, _const(8, loop.index))
            wv = arr.load(0, b.add(w_off, b.mul(i, _const(2, i))), ir.HalfType(), 8)
            xv = arr.load(2, b.add(x_off, i), F32, 8)
            prod = b.fmul(b.fpext(wv, vec(F32, 8)), xv, flags=FAST)
            b.store(b.fadd(b.load(acc), prod, flags=FAST), acc)
        return reduce_fadd(b, b.load(acc))

    return sig, codegen
