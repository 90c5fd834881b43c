"""Row-wise and element-wise CUDA kernels of the forward pass: RMSNorm (with or without a
weight), softmax (over the vocabulary's logits, for sampling), RoPE (adjacent pairs or NeoX halves, per-layer base and scale), SiLU/GELU gating, the
residual add, and the embedding row gather from a quantized table (`blocks.LAYOUTS`). Each
kernel writes every element of its output, in fp32."""

from __future__ import annotations

import math
from functools import lru_cache

from .. import compat  # noqa: F401  (before numba.cuda)
from ..blocks import LAYOUTS

# module level: the simulator swaps this global for its fake module
from numba import cuda, float32  # noqa: E402

from . import THREADS  # noqa: E402


@cuda.jit(device=True)
def block_reduce(partial, tid, use_max):
    """The max or sum of partial[0:THREADS], which each thread has just written its share of;
    every thread gets it. The row kernels here, MoE and decode attention reduce through this."""
    cuda.syncthreads()
    step = THREADS // 2
    while step > 0:
        if tid < step:
            if use_max:
                partial[tid] = max(partial[tid], partial[tid + step])
            else:
                partial[tid] += partial[tid + step]
        cuda.syncthreads()
        step //= 2
    value = partial[0]
    cuda.syncthreads()
    return value


@cuda.jit
def rms_norm(x, weight, out, eps, has_weight):
    """One thread block per row of x [T, n]."""
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    partial = cuda.shared.array(THREADS, float32)
    s = float32(0.0)
    for i in range(tid, n, THREADS):
        s += x[row, i] * x[row, i]
    partial[tid] = s
    scale = 1.0 / math.sqrt(block_reduce(partial, tid, False) / n + eps)
    for i in range(tid, n, THREADS):
        v = x[row, i] * scale
        out[row, i] = v * weight[i] if has_weight else v


@cuda.jit
def softmax(x, out):
    """Row-wise softmax of x [T, n] (one thread block per row), max-subtracted."""
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    partial = cuda.shared.array(THREADS, float32)
    top = -math.inf
    for i in range(tid, n, THREADS):
        top = max(top, x[row, i])
    partial[tid] = top
    top = block_reduce(partial, tid, True)
    s = float32(0.0)
    for i in range(tid, n, THREADS):
        e = math.exp(x[row, i] - top)
        out[row, i] = e
        s += e
    partial[tid] = s
    total = block_reduce(partial, tid, False)
    for i in range(tid, n, THREADS):
        out[row, i] = out[row, i] / total


@cuda.jit
def rope(x, positions, out, n_rot, base, scale, neox):
    """x [T, H, D]: one thread block per (token, head); dims past n_rot pass through."""
    t, h, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    d = x.shape[2]
    half = n_rot // 2
    for i in range(tid, half, THREADS):
        theta = positions[t] * scale * base ** (-2.0 * i / n_rot)
        c, s = math.cos(theta), math.sin(theta)
        a_i, b_i = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a, b = x[t, h, a_i], x[t, h, b_i]
        out[t, h, a_i] = a * c - b * s
        out[t, h, b_i] = a * s + b * c
    for i in range(n_rot + tid, d, THREADS):
        out[t, h, i] = x[t, h, i]


@cuda.jit
def gated(gate, up, out, use_gelu):
    """out = act(gate) * up over [T, n], SiLU or GELU (tanh form, as ggml)."""
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    for i in range(i0, gate.shape[1], THREADS):
        g = gate[t, i]
        if use_gelu:
            a = 0.5 * g * (1.0 + math.tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        else:
            a = g / (1.0 + math.exp(-g))
        out[t, i] = a * up[t, i]


@cuda.jit
def add(a, b, out):
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    for i in range(i0, a.shape[1], THREADS):
        out[t, i] = a[t, i] + b[t, i]


@lru_cache(maxsize=None)
def get_rows_kernel(qtype):
    decode, per_block, block_nbytes = LAYOUTS[qtype]

    @cuda.jit
    def get_rows(raw, ids, out, n_cols):
        """out [len(ids), n_cols] = rows ids of the quantized table; a thread block per row."""
        r, tid = cuda.blockIdx.x, cuda.threadIdx.x
        vals = cuda.local.array(per_block, float32)
        blocks = n_cols // per_block
        row_base = ids[r] * blocks * block_nbytes
        for b in range(tid, blocks, THREADS):
            decode(raw, row_base + b * block_nbytes, vals)
            for j in range(per_block):
                out[r, b * per_block + j] = vals[j]

    return get_rows


def launch_rows(kernel, rows: int, *args, stream=0) -> None:
    kernel[rows, THREADS, stream](*args)
