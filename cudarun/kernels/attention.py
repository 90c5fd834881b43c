"""Attention as a CUDA kernel: causal, optionally sliding-window, grouped K/V heads, for decode
(one query, split over the KV length by the threads) and prefill (one thread block per query
token and head). Each thread runs an online softmax over its share of the keys (running max,
sum and weighted V); the shares are then merged through shared memory. K and V are read as
stored (fp32 or fp16 arrays [S, Hkv, D])."""

from __future__ import annotations

import math

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import cuda, float32  # noqa: E402

from . import THREADS  # noqa: E402
MAX_HEAD_DIM = 256


@cuda.jit
def attention(q, k, v, q_pos, k_pos, out, scale, window):
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> out [T, H, Dv]; grid (T, H)."""
    t, h, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    n_keys, d, dv = k.shape[0], q.shape[2], v.shape[2]
    kv = h // (q.shape[1] // k.shape[1])
    acc = cuda.local.array(MAX_HEAD_DIM, float32)
    for i in range(dv):
        acc[i] = 0.0
    m, s = float32(-math.inf), float32(0.0)
    for j in range(tid, n_keys, THREADS):
        if k_pos[j] > q_pos[t] or (window > 0 and q_pos[t] - k_pos[j] >= window):
            continue
        score = float32(0.0)
        for i in range(d):
            score += q[t, h, i] * float32(k[j, kv, i])
        score *= scale
        new_m = max(m, score)
        shrink = math.exp(m - new_m) if m > -math.inf else 0.0
        p = math.exp(score - new_m)
        s = s * shrink + p
        for i in range(dv):
            acc[i] = acc[i] * shrink + p * float32(v[j, kv, i])
        m = new_m
    ms = cuda.shared.array(THREADS, float32)
    ss = cuda.shared.array(THREADS, float32)
    accs = cuda.shared.array((THREADS, MAX_HEAD_DIM), float32)
    ms[tid], ss[tid] = m, s
    for i in range(dv):
        accs[tid, i] = acc[i]
    cuda.syncthreads()
    if tid == 0:
        top = ms[0]
        for r in range(1, THREADS):
            top = max(top, ms[r])
        total = float32(0.0)
        for r in range(THREADS):
            w = math.exp(ms[r] - top) if ms[r] > -math.inf else 0.0
            ms[r] = w
            total += ss[r] * w
        for i in range(dv):
            o = float32(0.0)
            for r in range(THREADS):
                o += accs[r, i] * ms[r]
            out[t, h, i] = o / total
