"""Row-wise and element-wise CUDA kernels of the forward pass: RMSNorm (with or without a
weight), softmax (over the vocabulary's logits, for sampling), RoPE (adjacent pairs or NeoX halves,
per-layer base and scale), SiLU/GELU gating, the residual add, and the embedding row gather from a
quantized table (`dequant.QUADS`). Each kernel writes every element of its output, in fp32.

All arithmetic is fp32 (scalars arrive as float32: a Python float would compile an f64 kernel), a
row is one warp whose lanes stride over it and reduce by shuffles, and nothing lives in local
memory: `python -m cudarun.ptx_check --out DIR` shows each with no stack frame and no f64."""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .. import compat  # before numba.cuda

# module level: the simulator swaps this global for its fake module
from numba import config, cuda, float32  # noqa: E402

from . import THREADS  # noqa: E402
from .dequant import quad_layout  # noqa: E402

compat.simulator_intrinsics()  # warp shuffles and a fused fma for the simulator

FULL_MASK = 0xFFFFFFFF  # every lane of the warp takes part in a shuffle
TWO_PI_HI = float32(6.2831854820251465)  # 2*pi = TWO_PI_HI + TWO_PI_LO to about 1e-14
TWO_PI_LO = float32(-1.7484555314695172e-07)
INV_TWO_PI = float32(0.15915493667125702)

if config.ENABLE_CUDASIM:  # the simulator has no libdevice; the same values through math

    def _sin(x):
        return math.sin(x)

    def _cos(x):
        return math.cos(x)

else:
    # sin.approx/cos.approx: 2^-21 absolute error on [-pi, pi], where RoPE reduces its angle
    # first. The accurate sinf/cosf carry a Payne-Hanek path for huge arguments that keeps its
    # digits in local memory, a stack frame in every kernel that calls them.
    from numba.cuda.libdevice import fast_cosf as _cos, fast_sinf as _sin


@cuda.jit(device=True)
def warp_sum(v):
    """The sum of v over the THREADS lanes of a warp (a butterfly: every lane gets it)."""
    step = THREADS // 2
    while step > 0:
        v += cuda.shfl_xor_sync(FULL_MASK, v, step)
        step //= 2
    return v


@cuda.jit(device=True)
def warp_max(v):
    step = THREADS // 2
    while step > 0:
        v = max(v, cuda.shfl_xor_sync(FULL_MASK, v, step))
        step //= 2
    return v


@cuda.jit
def rms_norm(x, weight, out, eps, has_weight):
    """One warp per row of x [T, n]; eps is a float32."""
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    s = float32(0.0)
    for i in range(tid, n, THREADS):
        v = x[row, i]
        s += v * v
    scale = float32(1.0) / math.sqrt(warp_sum(s) / float32(n) + eps)
    for i in range(tid, n, THREADS):
        v = x[row, i] * scale
        out[row, i] = v * weight[i] if has_weight else v


@cuda.jit
def softmax(x, out):
    """Row-wise softmax of x [T, n] (one warp per row), max-subtracted."""
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n = x.shape[1]
    top = float32(-math.inf)
    for i in range(tid, n, THREADS):
        top = max(top, x[row, i])
    top = warp_max(top)
    s = float32(0.0)
    for i in range(tid, n, THREADS):
        e = math.exp(x[row, i] - top)
        out[row, i] = e
        s += e
    inv = float32(1.0) / warp_sum(s)
    for i in range(tid, n, THREADS):
        out[row, i] = out[row, i] * inv


# -- RoPE's angle in fp32 without losing it at long contexts --------------------------------------
#
# ggml computes theta = pos * theta_scale^i in fp32: at position 32K that is 2-4e-3 rad off the exact
# angle (theta's own rounding, 2^-9 at 32K, and theta_scale's, times i, times 32K; measured against
# fp64). Here the frequency scale * theta_scale^i is carried as a float32 pair (hi + lo, ~44 bits),
# pos * frequency split exactly by an fma, and the angle reduced to [-pi, pi] against 2*pi as a pair:
# about 1e-6 rad at any position below 2^24, with no f64.


@cuda.jit(device=True)
def _mul_pair(ah, al, bh, bl):
    """(ah + al) * (bh + bl) as a float32 pair (Dekker's product; the fma gives the exact error).
    Products that must stay rounded products are written as fma(a, b, +0): the compiler may fuse a
    plain product into a later add or subtract (PTX's mul.f32 + add.f32 -> fma), which here would
    count the product's rounding error twice."""
    p = cuda.fma(ah, bh, float32(0.0))
    e = cuda.fma(ah, bh, -p) + (ah * bl + al * bh)
    hi = p + e
    return hi, e - (hi - p)


@cuda.jit(device=True)
def rope_angle(pos, i, theta_hi, theta_lo, scale_hi, scale_lo):
    """pos * scale * theta_scale^i, reduced to [-pi, pi] (theta_scale = base^(-2/n_rot), both it
    and scale given as float32 pairs: `rope_constants`)."""
    fh, fl = scale_hi, scale_lo
    bh, bl = theta_hi, theta_lo
    e = i
    while e > 0:  # theta_scale^i by squaring
        if e & 1:
            fh, fl = _mul_pair(fh, fl, bh, bl)
        bh, bl = _mul_pair(bh, bl, bh, bl)
        e >>= 1
    p = float32(pos)  # exact below 2^24
    th = cuda.fma(p, fh, float32(0.0))  # a rounded product, not fusable: see _mul_pair
    tl = cuda.fma(p, fh, -th) + p * fl
    k = float32(math.floor(th * INV_TWO_PI + float32(0.5)))
    return cuda.fma(-k, TWO_PI_LO, cuda.fma(-k, TWO_PI_HI, th)) + tl


def rope_constants(n_rot: int, base: float, scale: float) -> tuple:
    """The float32 pairs rope() takes for theta_scale = base^(-2/n_rot) and the frequency scale,
    split on the host in float64."""

    def pair(v: float):
        hi = np.float32(v)
        return hi, np.float32(v - float(hi))

    return (*pair(base ** (-2.0 / n_rot)), *pair(scale))


@cuda.jit
def rope_qk(q, k, positions, q_norm, k_norm, eps, has_norm, n_rot, theta_hi, theta_lo, scale_hi,
            scale_lo, neox):  # fmt: skip
    """RoPE of Q [T, Hq, D] and K [T, Hk, D] in place in one launch, one warp per (token, head):
    the grid's first Hq heads are Q's. With `has_norm` each head is RMS-normalized over D by its
    weight (q_norm or k_norm, eps a float32) first (Qwen3's and Gemma-3's Q/K norms)."""
    t, hh, lane = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    if hh < q.shape[1]:
        x, h, weight = q, hh, q_norm
    else:
        x, h, weight = k, hh - q.shape[1], k_norm
    d, half = x.shape[2], n_rot // 2
    scale = float32(1.0)
    if has_norm:  # every lane has read the whole head (the shuffles) before any lane writes
        s = float32(0.0)
        for i in range(lane, d, THREADS):
            v = x[t, h, i]
            s += v * v
        scale = float32(1.0) / math.sqrt(warp_sum(s) / float32(d) + eps)
    for i in range(lane, half, THREADS):
        theta = rope_angle(positions[t], i, theta_hi, theta_lo, scale_hi, scale_lo)
        c, sn = _cos(theta), _sin(theta)
        a_i, b_i = (i, i + half) if neox else (2 * i, 2 * i + 1)
        a, b = x[t, h, a_i] * scale, x[t, h, b_i] * scale
        if has_norm:
            a, b = a * weight[a_i], b * weight[b_i]
        x[t, h, a_i] = a * c - b * sn
        x[t, h, b_i] = a * sn + b * c
    for i in range(n_rot + lane, d, THREADS):
        x[t, h, i] = x[t, h, i] * scale * (weight[i] if has_norm else float32(1.0))


@cuda.jit(device=True)
def activation(g, use_gelu):
    """SiLU or GELU (tanh form, as ggml) of g."""
    if use_gelu:
        inner = float32(0.7978845608028654) * (g + float32(0.044715) * g * g * g)
        return float32(0.5) * g * (float32(1.0) + math.tanh(inner))
    return g / (float32(1.0) + math.exp(-g))


@cuda.jit
def gated(gate, up, out, use_gelu):
    """out = act(gate) * up over [T, n]."""
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    for i in range(i0, gate.shape[1], THREADS):
        out[t, i] = activation(gate[t, i], use_gelu) * up[t, i]


@cuda.jit
def add(a, b, out):
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    for i in range(i0, a.shape[1], THREADS):
        out[t, i] = a[t, i] + b[t, i]


@lru_cache(maxsize=None)
def get_rows_kernel(qtype):
    quad, per_block, block_nbytes = quad_layout(qtype)

    @cuda.jit
    def get_rows(raw, ids, out, n_cols):
        """out [len(ids), n_cols] = rows ids of the quantized table whose bytes `raw` holds (viewed
        as uint16: `dequant`); a warp per row, consecutive lanes decoding consecutive fours."""
        r, tid = cuda.blockIdx.x, cuda.threadIdx.x
        row_base = ids[r] * (n_cols // per_block) * block_nbytes
        for q in range(tid, n_cols // 4, THREADS):
            v = 4 * q
            block = v // per_block
            a, b, c, d = quad(raw, row_base + block * block_nbytes, v - block * per_block)
            out[r, v] = a
            out[r, v + 1] = b
            out[r, v + 2] = c
            out[r, v + 3] = d

    return get_rows


def get_rows(raw, ids, out, qtype, stream=0) -> None:
    """out [len(ids), n_cols] fp32 = rows `ids` of the quantized table in `raw` (device bytes;
    n_cols a multiple of 4, as every embedding width is)."""
    n_cols = out.shape[1]
    assert n_cols % 4 == 0, n_cols
    launch_rows(get_rows_kernel(qtype), ids.shape[0], raw.view(np.uint16), ids, out,
                np.int64(n_cols), stream=stream)  # fmt: skip


def launch_rows(kernel, rows: int, *args, stream=0) -> None:
    kernel[rows, THREADS, stream](*args)
