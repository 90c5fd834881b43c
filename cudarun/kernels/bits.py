"""Floats from and to their bit patterns inside CUDA kernels: an fp16 or an fp32 read as an integer
(a GGUF block's scale, two fp16 KV values in one 32-bit word) becomes a float32 by a bitcast and the
hardware's conversion (`cvt.f32.f16`), and four float32 go out as four fp16 packed in one 64-bit
word (`cvt.rn.f16.f32`, round to nearest even) for one wide store, and both fp16 of a 32-bit word
convert where they sit (`half_pair`), a byte of a word becomes a float32 in one or two instructions
(`byte_float`); `load_pair` is one vector load of two words (16 bytes of fp16 KV in one LDG.128,
as llama.cpp's attention reads it) and `store_pair` one vector store; `dp4a` is the integer dot
product of four signed bytes (`dp4a.s32.s32`, one IDP instruction) that the int8 products use,
and `shr32` a 32-bit shift by a variable amount (Numba widens integer arithmetic to 64 bits, and
LLVM cannot narrow a variable shift back: a 64-bit shift is several instructions).

Numba has no bitcast between integers and floats, so these are LLVM intrinsics; no arithmetic,
no f64, nothing in local memory. Under the CUDA simulator the same functions are NumPy views, with
NumPy's round-to-nearest-even fp16 conversion."""

from __future__ import annotations

import numpy as np
from numba import config

if config.ENABLE_CUDASIM:

    def half_to_float(bits):
        """The fp16 in the low 16 bits of an integer, as a float32 (subnormals, inf, NaN kept)."""
        return np.float32(np.uint16(int(bits) & 0xFFFF).view(np.float16))

    def half_pair(bits):
        """The two fp16 in the low 32 bits of an integer, low half first, as float32."""
        pair = np.array([int(bits) & 0xFFFFFFFF], np.uint32).view(np.float16).astype(np.float32)
        return pair[0], pair[1]

    def load_pair(words, i):
        """words[i] and words[i + 1] of a 1-d array, i even (one 16-byte load on the GPU)."""
        return words[i], words[i + 1]

    def store_pair(words, i, a, b):
        """words[i], words[i + 1] = a, b, i even (one 16-byte store on the GPU)."""
        words[i], words[i + 1] = a, b

    def float_from_bits(bits):
        """The float32 whose bits are the low 32 bits of an integer."""
        return np.uint32(int(bits) & 0xFFFFFFFF).view(np.float32)

    def pack_halves(a, b, c, d):
        """Four float32 rounded to fp16, a in the low 16 bits: one int64 word to store."""
        return np.array([a, b, c, d], np.float32).astype(np.float16).view(np.int64)[0]

    def dp4a(a, b, c):
        """c + the dot product of a's and b's four bytes, each a signed int8 (the low 32 bits of
        each integer), wrapped to an int32 as the GPU's IDP does."""
        a, b, total = int(a) & 0xFFFFFFFF, int(b) & 0xFFFFFFFF, int(c)
        for shift in (0, 8, 16, 24):
            u, v = (a >> shift) & 255, (b >> shift) & 255
            total += (u - 256 * (u >> 7)) * (v - 256 * (v >> 7))
        return np.int32(((total + 2**31) & 0xFFFFFFFF) - 2**31)

    def shr32(a, s):
        """The low 32 bits of a, shifted right by s (0..31) as an unsigned 32-bit word."""
        return np.uint32((int(a) & 0xFFFFFFFF) >> int(s))

    def byte_float(x, k):
        """Byte k (a constant 0..3) of the integer x as a float32."""
        return np.float32((int(x) >> (8 * int(k))) & 255)

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    def _int_to(builder, value, bits):
        """An integer value truncated or zero-extended to `bits` bits."""
        have = value.type.width
        if have > bits:
            return builder.trunc(value, ir.IntType(bits))
        if have < bits:
            return builder.zext(value, ir.IntType(bits))
        return value

    @intrinsic
    def half_to_float(typingctx, bits):
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            h = builder.bitcast(_int_to(builder, args[0], 16), ir.HalfType())
            return builder.fpext(h, ir.FloatType())

        return types.float32(bits), codegen

    @intrinsic
    def half_pair(typingctx, bits):
        """Both fp16 of a 32-bit word converted where they sit (ptxas: two HADD2.F32 reading
        the register's halves), not shifted out first."""
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            pair = builder.bitcast(_int_to(builder, args[0], 32), ir.VectorType(ir.HalfType(), 2))
            lo, hi = (builder.fpext(builder.extract_element(pair, ir.Constant(ir.IntType(32), i)),
                                    ir.FloatType()) for i in (0, 1))  # fmt: skip
            return context.make_tuple(builder, signature.return_type, (lo, hi))

        return types.UniTuple(types.float32, 2)(bits), codegen

    def _pair_array(words, *ints) -> bool:
        """A 1-d C array of 64- or 32-bit integers, and integer operands."""
        return (isinstance(words, types.Array) and words.ndim == 1 and words.layout == "C"
                and isinstance(words.dtype, types.Integer) and words.dtype.bitwidth in (32, 64)
                and all(isinstance(x, types.Integer) for x in ints))  # fmt: skip

    def _pair_at(context, builder, signature, args):
        """The pointer to words[i] as one <2 x word> vector, and that vector type."""
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        at = builder.gep(ary.data, [_int_to(builder, args[1], 64)], inbounds=True)
        lanes = ir.VectorType(ir.IntType(signature.args[0].dtype.bitwidth), 2)
        return builder.bitcast(at, lanes.as_pointer()), lanes

    @intrinsic
    def load_pair(typingctx, words, i):
        """words[i] and words[i + 1] of a 1-d C array of 64- or 32-bit integers in one vector
        load (LDG.E.128 or .64), i even and the array's start aligned to the pair: no bounds or
        wraparound checks."""
        if not _pair_array(words, i):
            return None

        def codegen(context, builder, signature, args):
            at, lanes = _pair_at(context, builder, signature, args)
            vec = builder.load(at, align=2 * words.dtype.bitwidth // 8)
            pair = [builder.extract_element(vec, ir.Constant(ir.IntType(32), j)) for j in (0, 1)]
            return context.make_tuple(builder, signature.return_type, pair)

        return types.UniTuple(words.dtype, 2)(words, i), codegen

    @intrinsic
    def store_pair(typingctx, words, i, a, b):
        """words[i], words[i + 1] = a, b in one vector store (STG.E.128 or .64), as load_pair
        reads: i even, the array's start aligned to the pair, no bounds or wraparound checks."""
        if not _pair_array(words, i, a, b):
            return None

        def codegen(context, builder, signature, args):
            at, lanes = _pair_at(context, builder, signature, args)
            vec = ir.Constant(lanes, None)
            for j, x in enumerate(args[2:]):
                vec = builder.insert_element(vec, _int_to(builder, x, words.dtype.bitwidth),
                                             ir.Constant(ir.IntType(32), j))  # fmt: skip
            builder.store(vec, at, align=2 * words.dtype.bitwidth // 8)
            return context.get_dummy_value()

        return types.none(words, i, a, b), codegen

    @intrinsic
    def float_from_bits(typingctx, bits):
        if not isinstance(bits, types.Integer):
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(_int_to(builder, args[0], 32), ir.FloatType())

        return types.float32(bits), codegen

    @intrinsic
    def pack_halves(typingctx, a, b, c, d):
        if not all(x == types.float32 for x in (a, b, c, d)):
            return None

        def codegen(context, builder, signature, args):
            vec = ir.Constant(ir.VectorType(ir.HalfType(), 4), None)
            for i, x in enumerate(args):
                vec = builder.insert_element(
                    vec, builder.fptrunc(x, ir.HalfType()), ir.Constant(ir.IntType(32), i)
                )
            return builder.bitcast(vec, ir.IntType(64))

        return types.int64(a, b, c, d), codegen

    @intrinsic
    def dp4a(typingctx, a, b, c):
        if not all(isinstance(x, types.Integer) for x in (a, b, c)):
            return None

        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), "dp4a.s32.s32 $0, $1, $2, $3;",
                               "=r,r,r,r")  # fmt: skip
            return builder.call(asm, [_int_to(builder, x, 32) for x in args])

        return types.int32(a, b, c), codegen

    @intrinsic
    def byte_float(typingctx, x, k):
        """Byte k of a 32-bit word as a float32 in at most two instructions: the outer bytes
        converted where they sit (I2F.U8 reads a register's byte 0 or 3), the inner ones moved
        to byte 0 by one byte permutation (PRMT) first; Numba's shift and mask take three."""
        if not (isinstance(x, types.Integer) and isinstance(k, types.IntegerLiteral)):
            return None
        at = k.literal_value
        if at == 0:
            text = "cvt.rn.f32.u8 $0, $1;"
        elif at == 3:
            text = "{ .reg .b32 t; shr.u32 t, $1, 24; cvt.rn.f32.u32 $0, t; }"
        else:
            text = f"{{ .reg .b32 t; prmt.b32 t, $1, 0, {0x4440 + at}; cvt.rn.f32.u32 $0, t; }}"

        def codegen(context, builder, signature, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ir.IntType(32)]), text, "=f,r")
            return builder.call(asm, [_int_to(builder, args[0], 32)])

        return types.float32(x, k), codegen  # the literal in the signature: one body per byte

    @intrinsic
    def shr32(typingctx, a, s):
        if not (isinstance(a, types.Integer) and isinstance(s, types.Integer)):
            return None

        def codegen(context, builder, signature, args):
            return builder.lshr(_int_to(builder, args[0], 32), _int_to(builder, args[1], 32))

        return types.uint32(a, s), codegen
