"""Matrix x activations for 1..MAX_TOKENS tokens (decode and small batches), reading the weight's
GGUF blocks directly: the weight is read once for all tokens.

GPU: a warp per output row, ROWS rows per thread block. The lanes of a warp walk the row four values
at a time, consecutive lanes on consecutive fours (`dequant.QUADS`: the quant bytes of a block are
read in one contiguous sweep, as 16-bit loads of the tensor viewed as uint16, fp16 scales converted
by bit operations), dequantize them in registers and multiply them with the activations, which
consecutive lanes also read consecutively; a warp-shuffle sum ends the row. Up to four tokens ride
one pass over the row in four scalar accumulators (no local array: no stack frame); more tokens
take more passes, which find the row's bytes in L1. It computes out[t, r] = sum_c x[t, c] * W[r, c]
in fp32. (CPU: `kernels.cpu`.)
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import compat  # noqa: F401  (before numba.cuda)

# module level, not inside the factories: the simulator swaps this global for its fake module
from numba import cuda, float32  # noqa: E402

from . import THREADS  # noqa: E402
from .dequant import quad_layout  # noqa: E402
from .elementwise import activation, warp_sum  # noqa: E402
from solver.workspace import MAX_DECODE_TOKENS  # noqa: E402

MAX_TOKENS = MAX_DECODE_TOKENS
ROWS = 4  # warps, one row each, per thread block


@lru_cache(maxsize=None)
def row_dots(qtype):
    """The device function that gives one lane's share of the dot products of a weight row (its
    first byte at `row_base` of `raw`, as uint16) with rows t0..t0+3 of x that are below
    `n_tokens` (the others come back 0)."""
    quad, per_block, block_nbytes = quad_layout(qtype)

    @cuda.jit(device=True)
    def dots(raw, row_base, x, t0, n_tokens, n_cols, lane):
        a0 = a1 = a2 = a3 = float32(0.0)
        for q in range(lane, n_cols // 4, THREADS):
            v = 4 * q
            block = v // per_block
            w0, w1, w2, w3 = quad(raw, row_base + block * block_nbytes, v - block * per_block)
            a0 += w0 * x[t0, v] + w1 * x[t0, v + 1] + w2 * x[t0, v + 2] + w3 * x[t0, v + 3]
            if t0 + 1 < n_tokens:
                t = t0 + 1
                a1 += w0 * x[t, v] + w1 * x[t, v + 1] + w2 * x[t, v + 2] + w3 * x[t, v + 3]
            if t0 + 2 < n_tokens:
                t = t0 + 2
                a2 += w0 * x[t, v] + w1 * x[t, v + 1] + w2 * x[t, v + 2] + w3 * x[t, v + 3]
            if t0 + 3 < n_tokens:
                t = t0 + 3
                a3 += w0 * x[t, v] + w1 * x[t, v + 1] + w2 * x[t, v + 2] + w3 * x[t, v + 3]
        return a0, a1, a2, a3

    return dots


@lru_cache(maxsize=None)
def row_product(qtype):
    """The device function a warp runs for one output row: its dot products with every token,
    the row's bias added (`has_bias`) and, with `glu` (1 SiLU, 2 GELU), act[t, row] =
    act(gate[t, row]) * out[t, row] written too: the up projection's epilogue that saves the
    gating kernel. A row past n_rows runs on the clamped row and stores nothing: the simulator's
    shuffles wait for every thread of the block."""
    dots = row_dots(qtype)
    _, per_block, block_nbytes = quad_layout(qtype)

    @cuda.jit(device=True)
    def store(out, gate, act, glu, t, row, v):
        out[t, row] = v
        if glu != 0:
            act[t, row] = activation(gate[t, row], glu == 2) * v

    @cuda.jit(device=True)
    def product(raw, x, out, bias, has_bias, gate, act, glu, row, n_rows, n_cols, n_tokens, lane):
        row_base = min(row, n_rows - 1) * (n_cols // per_block) * block_nbytes
        for t0 in range(0, n_tokens, 4):
            a0, a1, a2, a3 = dots(raw, row_base, x, t0, n_tokens, n_cols, lane)
            a0, a1, a2, a3 = warp_sum(a0), warp_sum(a1), warp_sum(a2), warp_sum(a3)
            if lane == 0 and row < n_rows:
                b = bias[row] if has_bias else float32(0.0)
                store(out, gate, act, glu, t0, row, a0 + b)
                if t0 + 1 < n_tokens:
                    store(out, gate, act, glu, t0 + 1, row, a1 + b)
                if t0 + 2 < n_tokens:
                    store(out, gate, act, glu, t0 + 2, row, a2 + b)
                if t0 + 3 < n_tokens:
                    store(out, gate, act, glu, t0 + 3, row, a3 + b)

    return product


@lru_cache(maxsize=None)
def gpu_kernel(qtype):
    product = row_product(qtype)

    @cuda.jit
    def matvec(raw, x, out, bias, has_bias, gate, act, glu, n_cols):
        """out [T, n_rows] = x [T, n_cols] times the weight whose bytes `raw` holds as uint16
        (+ bias; the gated epilogue with glu != 0)."""
        lane, warp = cuda.threadIdx.x % THREADS, cuda.threadIdx.x // THREADS
        row = cuda.blockIdx.x * ROWS + warp
        product(raw, x, out, bias, has_bias, gate, act, glu, row, out.shape[1], n_cols,
                x.shape[0], lane)  # fmt: skip

    return matvec


@lru_cache(maxsize=None)
def triple_kernel(qa, qb, qc):
    """Three products of one input in one launch (Q, K and V): the grid's first blocks make a's
    rows, the next b's, the last c's, each with its optional bias."""
    pa, pb, pc = row_product(qa), row_product(qb), row_product(qc)

    @cuda.jit
    def matvec3(ra, rb, rc, x, oa, ob, oc, ba, bb, bc, has_a, has_b, has_c, n_cols):
        lane, warp = cuda.threadIdx.x % THREADS, cuda.threadIdx.x // THREADS
        n_tokens, blk = x.shape[0], cuda.blockIdx.x
        grid_a = (oa.shape[1] + ROWS - 1) // ROWS
        grid_b = (ob.shape[1] + ROWS - 1) // ROWS
        if blk < grid_a:
            pa(ra, x, oa, ba, has_a, oa, oa, 0, blk * ROWS + warp, oa.shape[1], n_cols,
               n_tokens, lane)  # fmt: skip
        elif blk < grid_a + grid_b:
            row = (blk - grid_a) * ROWS + warp
            pb(rb, x, ob, bb, has_b, ob, ob, 0, row, ob.shape[1], n_cols, n_tokens, lane)
        else:
            row = (blk - grid_a - grid_b) * ROWS + warp
            pc(rc, x, oc, bc, has_c, oc, oc, 0, row, oc.shape[1], n_cols, n_tokens, lane)

    return matvec3


def _blocks(n_rows: int) -> int:
    return -(-n_rows // ROWS)


def matvec_gpu(raw, x, out, qtype, shape: tuple[int, int], stream=0, bias=None,
               gated=None) -> None:  # fmt: skip
    """out [T, n_rows] (device) = x [T, n_cols] (device) times the weight in `raw` (device bytes,
    starting at an even byte), + bias [n_rows] when given; `gated` = (gate, act, use_gelu):
    act [T, n_rows] = act(gate) * out as well."""
    n_rows, n_cols = shape
    assert x.shape[0] <= MAX_TOKENS and n_cols % max(4, quad_layout(qtype)[1]) == 0
    assert out.shape[1] == n_rows
    gate, act, glu = (out, out, 0) if gated is None else (gated[0], gated[1], 1 + bool(gated[2]))
    gpu_kernel(qtype)[_blocks(n_rows), ROWS * THREADS, stream](
        raw.view(np.uint16), x, out, out[0] if bias is None else bias, bias is not None,
        gate, act, np.int64(glu), np.int64(n_cols),
    )  # fmt: skip


def matvec3_gpu(raws, x, outs, qtypes, n_cols: int, biases, stream=0) -> None:
    """outs[i] [T, rows_i] = x [T, n_cols] times weight i (+ biases[i] where not None), i = 0, 1,
    2, in one launch."""
    assert x.shape[0] <= MAX_TOKENS and all(n_cols % max(4, quad_layout(q)[1]) == 0 for q in qtypes)
    grid = sum(_blocks(o.shape[1]) for o in outs)
    triple_kernel(*qtypes)[grid, ROWS * THREADS, stream](
        *(r.view(np.uint16) for r in raws), x, *outs,
        *(o[0] if b is None else b for b, o in zip(biases, outs)),
        *(b is not None for b in biases), np.int64(n_cols),
    )  # fmt: skip
