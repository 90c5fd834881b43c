"""CPU kernels for the tensors a plan computes on the host: matrix x activations reading the GGUF
blocks in place, on a chosen number of threads.

The paths, named by what they compute (docs/contracts.md tolerances):
- `q8` (every quantized type): the activations are quantized to int8 with a scale per 32 values
  and each row's blocks are dotted in integers (`simd.row_*`), as llama.cpp's CPU backend does;
  normwise error <= 1e-2. This is the fast path.
- `f16` (F16 below the BLAS token count): fp16 rows widened in registers, fp32 accumulation.
- `f32` (any quantized type on request): the block decoders of `blocks.DECODERS` dequantize each
  block into fp32 and accumulate in fp32; <= 1e-3.
- `q8gemm`: large token counts (a prompt's ubatch) of the q8 types, in rows of whole 16-row
  tiles: the weight repacked into int8 tiles (`q8_panel`), products of 16 rows x 8 tokens in
  512-bit integer dot products (`q8_gemm`); the q8 path's activations and tolerance.
- `blas`: large token counts of the other types, and F32/F16/BF16 at any count, widen a panel
  of rows to fp32 and hand it to the BLAS matrix product.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from gguf import GGMLQuantizationType as Q
from numba import njit, prange
from numba.extending import register_jitable

from ..blocks import layout
from . import q8_gemm, q8_panel, simd

Q8_ROWS = tuple(Q[name] for name in simd.Q8_BLOCKS)
# from this many tokens on, int8 tiles (`q8gemm`) or a dequantized panel and BLAS; below it, one
# row intrinsic per token count unpacks each block once for all tokens
BLAS_TOKENS = 8
PANEL_ROWS = 256
# a decode step of up to this many sequences keeps the q8 rows (several tokens a row intrinsic,
# `row_dots`): a step reads each weight once for all of them where an fp32 panel reads four bytes
# a weight
MAX_DECODE_ROWS = 64
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)  # widened to fp32 panels by NumPy for BLAS


def path(qtype, tokens: int = 1, shape: tuple[int, int] | None = None) -> str:
    """Which path `matmul` takes: "q8", "q8gemm" (int8 tiles, `q8_gemm`; for a shape whose
    rows fill them), "f16" (fp16 rows, fp32 accumulation), "f32" (block decoders, fp32) or
    "blas" (fp32 panels)."""
    if tokens >= BLAS_TOKENS and shape is not None and q8_panel.fits(qtype, shape):
        return "q8gemm"
    if tokens >= BLAS_TOKENS or qtype in (Q.F32, Q.BF16):
        return "blas"
    if qtype == Q.F16:
        return "f16"
    return "q8" if qtype in Q8_ROWS else "f32"


@njit(parallel=True)
def _f16_matvec(raw, x, out, n_rows, n_cols):
    for r in prange(n_rows):
        for t in range(x.shape[0]):
            out[t, r] = simd.row_f16(raw, r * n_cols * 2, x[t], 0, n_cols)


def _float_panel(raw: np.ndarray, qtype, first: int, out: np.ndarray) -> None:
    """Rows first.. of an F32/F16/BF16 tensor into the fp32 panel `out`."""
    rows, n_cols = out.shape
    if qtype == Q.F32:
        out[:] = raw.view(np.float32).reshape(-1, n_cols)[first : first + rows]
    elif qtype == Q.F16:
        out[:] = raw.view(np.float16).reshape(-1, n_cols)[first : first + rows]
    else:  # bf16: the top half of an fp32
        bits = raw.view(np.uint16).reshape(-1, n_cols)[first : first + rows]
        out.view(np.uint32)[:] = bits.astype(np.uint32) << 16


@register_jitable
def quantize_group(x, t, g, x8, xd, xs):
    """Values 32 g .. 32 g + 31 of token t of x into x8, and their scale and quantized sum into
    xd[t, g] and xs[t, g] (`quantize_activations`, a group at a time: a fused FFN quantizes its
    gated activations group by group in the parallel region that computes them)."""
    amax = np.float32(0.0)
    for j in range(32 * g, 32 * g + 32):
        amax = max(amax, abs(x[t, j]))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
    xd[t, g] = d
    s = 0
    for j in range(32 * g, 32 * g + 32):
        q = np.int8(round(x[t, j] * inv))
        x8[t, j] = q
        s += np.int32(q)
    xs[t, g] = np.float32(s) * d


@njit(cache=True)
def quantize_activations(x):
    """x [T, n] fp32 -> (x8 int8 [T, n], xd fp32 [T, n / 32] (scale: value = xd * x8),
    xs fp32 [T, n / 32] (the quantized values' sum per 32, times their scale))."""
    n_tokens, n = x.shape
    x8 = np.empty((n_tokens, n), np.int8)
    xd = np.empty((n_tokens, n // 32), np.float32)
    xs = np.empty((n_tokens, n // 32), np.float32)
    for t in range(n_tokens):
        for g in range(n // 32):
            quantize_group(x, t, g, x8, xd, xs)
    return x8, xd, xs


def token_key(tokens: int) -> int | None:
    """What a kernel over `tokens` tokens is compiled for: each count below BLAS_TOKENS has its
    own row intrinsic; from there one compilation takes any count (`row_dots`)."""
    return tokens if tokens < BLAS_TOKENS else None


@lru_cache(maxsize=None)
def row_dots(type_name: str, tokens: int | None, wide: bool = False):
    """A jitable `dots(w, w_offset, x8, xd, xs, n_blocks, out, r)`: one row's dot products with
    each token's q8 activations into out[:, r]. For a count below BLAS_TOKENS, one row intrinsic
    of that count; for None (any count: a decode step of many sequences), chunks of four tokens
    and a remainder of one to three, which unpack the row's blocks again from L1 rather than read
    them from memory again. `wide`: int16 activations (`quantize_activations16`)."""
    if tokens is not None:
        row = simd.q8_row(type_name, tokens, wide)

        @register_jitable
        def dots(w, w_offset, x8, xd, xs, n_blocks, out, r):
            s = row(w, w_offset, x8, xd, xs, n_blocks)
            for t in range(tokens):
                out[t, r] = s[t]

        return dots
    one, two, three, four, eight = (simd.q8_row(type_name, n, wide) for n in (1, 2, 3, 4, 8))

    @register_jitable
    def dots_any(w, w_offset, x8, xd, xs, n_blocks, out, r):
        n, a = x8.shape[0], 0
        while a + 8 <= n:
            s8 = eight(w, w_offset, x8[a : a + 8], xd[a : a + 8], xs[a : a + 8], n_blocks)
            for t in range(8):
                out[a + t, r] = s8[t]
            a += 8
        while a + 4 <= n:
            s4 = four(w, w_offset, x8[a : a + 4], xd[a : a + 4], xs[a : a + 4], n_blocks)
            for t in range(4):
                out[a + t, r] = s4[t]
            a += 4
        if n - a == 1:
            s1 = one(w, w_offset, x8[a:], xd[a:], xs[a:], n_blocks)
            out[a, r] = s1[0]
        elif n - a == 2:
            s2 = two(w, w_offset, x8[a:], xd[a:], xs[a:], n_blocks)
            for t in range(2):
                out[a + t, r] = s2[t]
        elif n - a == 3:
            s3 = three(w, w_offset, x8[a:], xd[a:], xs[a:], n_blocks)
            for t in range(3):
                out[a + t, r] = s3[t]

    return dots_any


@lru_cache(maxsize=None)
def _q8_kernel(qtype, tokens: int | None, wide: bool = False):
    dots = row_dots(qtype.name, tokens, wide)
    _, per_block, block_nbytes = layout(qtype)

    @njit(parallel=True)
    def matvec(raw, x8, xd, xs, out, n_rows, n_cols):
        blocks = n_cols // per_block
        for r in prange(n_rows):
            dots(raw, r * blocks * block_nbytes, x8, xd, xs, blocks, out, r)

    return matvec


@lru_cache(maxsize=None)
def _f32_kernel(qtype):
    decode, per_block, block_nbytes = layout(qtype)

    @njit(parallel=True, fastmath=True)
    def matvec(raw, x, out, n_rows, n_cols):
        n_tokens = x.shape[0]
        blocks = n_cols // per_block
        for row in prange(n_rows):
            vals = np.empty(per_block, np.float32)
            acc = np.zeros(n_tokens, np.float32)
            row_base = row * blocks * block_nbytes
            for b in range(blocks):
                decode(raw, row_base + b * block_nbytes, vals)
                col = b * per_block
                for t in range(n_tokens):
                    s = np.float32(0.0)
                    for j in range(per_block):
                        s += vals[j] * x[t, col + j]
                    acc[t] += s
            for t in range(n_tokens):
                out[t, row] = acc[t]

    return matvec


@lru_cache(maxsize=None)
def _dequantize_kernel(qtype):
    decode, per_block, block_nbytes = layout(qtype)

    @njit(parallel=True)
    def dequantize(raw, first_row, out, n_cols):
        blocks = n_cols // per_block
        for r in prange(out.shape[0]):
            base = (first_row + r) * blocks * block_nbytes
            for b in range(blocks):
                decode(raw, base + b * block_nbytes, out[r, b * per_block : (b + 1) * per_block])

    return dequantize


@lru_cache(maxsize=None)
def _rows_kernel(qtype):
    decode, per_block, block_nbytes = layout(qtype)

    @njit
    def rows(raw, ids, out):
        blocks = out.shape[1] // per_block
        for r in range(ids.size):
            base = ids[r] * blocks * block_nbytes
            for b in range(blocks):
                decode(raw, base + b * block_nbytes, out[r, b * per_block : (b + 1) * per_block])

    return rows


def get_rows(raw: np.ndarray, qtype, shape: tuple[int, int], ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a [n_rows, n_cols] table held as GGUF blocks -> [len(ids), n_cols] fp32:
    an embedding lookup, row by row (NumPy's dequantize of a token's row took ~0.2 ms)."""
    out = np.empty((len(ids), shape[1]), np.float32)
    _rows_kernel(Q(qtype))(np.asarray(raw).reshape(-1), np.asarray(ids, np.int64), out)
    return out


class threads_set:
    """Run with `n` Numba threads (0: all), restoring the previous count after."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        import numba

        self.previous = numba.get_num_threads()
        if self.n:
            numba.set_num_threads(min(self.n, numba.config.NUMBA_NUM_THREADS))

    def __exit__(self, *exc):
        import numba

        numba.set_num_threads(self.previous)


Q16_ROWS = tuple(Q[name] for name in simd.Q16_BLOCKS)


@njit(cache=True)
def quantize_activations16(x):
    """x [T, n] fp32 -> (x16 int16 [T, n], xd fp32 [T, n / 32]: value = xd * x16): the head's
    activations to 15 bits of each row's largest (the logits are what is sampled). One scale a
    row, repeated per 32 for the row intrinsics' layout: a block's product then needs only the
    weight's scale, shared by the tokens, and the row's is applied once at its end."""
    n_tokens, n = x.shape
    x16 = np.empty((n_tokens, n), np.int16)
    xd = np.empty((n_tokens, n // 32), np.float32)
    for t in range(n_tokens):
        amax = np.float32(0.0)
        for j in range(n):
            amax = max(amax, abs(x[t, j]))
        d = amax / np.float32(32767.0)
        inv = np.float32(1.0) / d if d > 0 else np.float32(0.0)
        xd[t, :] = d
        for j in range(n):
            x16[t, j] = np.int16(round(x[t, j] * inv))
    return x16, xd


def q16_matvec(raw: np.ndarray, x16, xd, qtype, shape: tuple[int, int], out: np.ndarray) -> None:
    """out [T, n_rows] = int16 activations (`quantize_activations16`) times the weight (a type of
    Q16_ROWS), on the calling thread's Numba threads."""
    tokens = token_key(x16.shape[0])
    _q8_kernel(qtype, tokens, True)(raw, x16, xd, xd, out, shape[0], shape[1])


def quantize_two_planes(x: np.ndarray):
    """x [T, n] as two int8 planes stacked as 2T rows for `q8_matvec`: the activations quantized,
    then what that quantization left out, quantized again — about 15 bits for the price of a
    2-token product (a row intrinsic unpacks each weight block once for both planes). The sum of
    the two rows' results is the dot with x to that precision."""
    first = quantize_activations(x)
    kept = (first[0].reshape(x.shape[0], -1, 32) * first[1][..., None]).reshape(x.shape)
    second = quantize_activations(np.ascontiguousarray(x - kept, np.float32))
    return tuple(np.concatenate([a, b]) for a, b in zip(first, second))


@njit(parallel=True, cache=True)
def _take_rows(src, rows, out):
    for i in prange(rows.size):
        out[i] = src[rows[i]]


def take_rows(src: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """src[rows] for a 2-D src, copied on Numba's threads (NumPy's fancy indexing copies on one:
    the gathers and scatters around a MoE prompt layer's experts were a tenth of their time)."""
    out = np.empty((rows.size, src.shape[1]), src.dtype)
    _take_rows(src, rows, out)
    return out


@njit(parallel=True, cache=True)
def _put_rows(src, rows, out):
    for i in prange(rows.size):
        out[rows[i]] = src[i]


def put_rows(out: np.ndarray, rows: np.ndarray, src: np.ndarray) -> None:
    """out[rows] = src (2-D, rows distinct), on Numba's threads."""
    _put_rows(src, rows, out)


EXPERT_SPAN_ROWS = 32


@lru_cache(maxsize=None)
def _q8_experts_kernel(qtype, tokens):
    dots = row_dots(qtype.name, tokens)
    _, per_block, block_nbytes = layout(qtype)

    @njit(parallel=True)
    def experts(raw, expert_nbytes, used, first, x8, xd, xs, out, n_rows, n_cols):
        blocks = n_cols // per_block
        n_used = used.shape[0]
        n_spans = (n_rows + EXPERT_SPAN_ROWS - 1) // EXPERT_SPAN_ROWS
        # spans of consecutive rows, each expert's spans interleaved with the others': a thread
        # streams a span's rows in order (what the prefetcher follows) and takes rows of every
        # expert, so one that drew more tokens than the others does not leave a thread idle
        for job in prange(n_spans * n_used):
            span, i = job // n_used, job % n_used
            a, b = first[i], first[i + 1]
            x8i, xdi, xsi, outi = x8[a:b], xd[a:b], xs[a:b], out[a:b]
            base = used[i] * expert_nbytes
            for r in range(span * EXPERT_SPAN_ROWS, min(n_rows, (span + 1) * EXPERT_SPAN_ROWS)):
                dots(raw, base + r * blocks * block_nbytes, x8i, xdi, xsi, blocks, outi, r)

    return experts


def q8_experts(stack: np.ndarray, q8, used, first, qtype, shape: tuple[int, int],
               out: np.ndarray) -> None:  # fmt: skip
    """Every routed expert of a stack in one parallel pass (llama.cpp's mul_mat_id): `stack` the
    [E, ...] blocks of the 3-D tensor, `used` [U] the expert ids, and expert used[i]'s activation
    rows q8[..][first[i]:first[i + 1]] (quantized by `quantize_activations`), whose products with
    its [n_rows, n_cols] matrix go to the same rows of `out` [sum, n_rows]."""
    raw = stack.reshape(-1)
    counts = np.diff(first)
    tokens = token_key(int(counts[0])) if (counts == counts[0]).all() else None
    _q8_experts_kernel(Q(qtype), tokens)(raw, raw.size // stack.shape[0], used, first, *q8, out,
                                         shape[0], shape[1])  # fmt: skip


def q8_matvec(raw: np.ndarray, q8, qtype, shape: tuple[int, int], out: np.ndarray) -> None:
    """out [T, n_rows] = the activations quantized by `quantize_activations` (`q8`: x8, xd, xs)
    times the weight, on the calling thread's Numba threads."""
    _q8_kernel(qtype, token_key(q8[0].shape[0]))(raw, *q8, out, shape[0], shape[1])


def dense_panel(raw: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    """The whole weight [n_rows, n_cols] dequantized to fp32 (what the BLAS path multiplies)."""
    n_rows, n_cols = shape
    panel = np.empty((n_rows, n_cols), np.float32)
    if qtype in FLOAT_TYPES:
        _float_panel(raw, qtype, 0, panel)
    else:
        _dequantize_kernel(qtype)(raw, 0, panel, n_cols)
    return panel


def matmul(
    raw: np.ndarray,
    x: np.ndarray,
    qtype,
    shape: tuple[int, int],
    threads: int = 0,
    exact: bool = False,
):
    """x [T, n_cols] times the weight [n_rows, n_cols] held as GGUF blocks in `raw` (uint8) ->
    [T, n_rows] fp32, on `threads` threads (0: all). `exact` forbids the q8 path."""
    n_rows, n_cols = shape
    qtype = Q(qtype)
    x = np.ascontiguousarray(x, np.float32)
    out = np.empty((x.shape[0], n_rows), np.float32)
    kind = path(qtype, x.shape[0], shape)
    if kind == "q8" and exact:
        kind = "f32"
    if kind == "q8gemm" and exact:
        kind = "blas"
    if kind == "f16" and n_cols % 8:  # the fp16 rows go 8 values at a time
        kind = "blas"
    dequantize_rows = (
        (lambda first, panel: _float_panel(raw, qtype, first, panel))
        if qtype in FLOAT_TYPES
        else (lambda first, panel: _dequantize_kernel(qtype)(raw, first, panel, n_cols))
    )
    with threads_set(threads):
        if kind == "q8":
            x8, xd, xs = quantize_activations(x)
            _q8_kernel(qtype, token_key(x.shape[0]))(raw, x8, xd, xs, out, n_rows, n_cols)
        elif kind == "q8gemm":
            q8_gemm.product(q8_panel.repack(raw, qtype, shape), quantize_activations(x), out)
        elif kind == "f32":
            _f32_kernel(qtype)(raw, x, out, n_rows, n_cols)
        elif kind == "f16":
            _f16_matvec(raw, x, out, n_rows, n_cols)
        else:
            panel = np.empty((min(PANEL_ROWS, n_rows), n_cols), np.float32)
            for first in range(0, n_rows, PANEL_ROWS):
                rows = min(PANEL_ROWS, n_rows - first)
                dequantize_rows(first, panel[:rows])
                np.matmul(x, panel[:rows].T, out=out[:, first : first + rows])
    return out
