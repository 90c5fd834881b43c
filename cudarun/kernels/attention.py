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
from .elementwise import block_reduce  # noqa: E402

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


# -- decode: split over the KV length, one K/V read per group of query heads ---------------------

MAX_GROUP = 16  # query heads per KV head
TILE = THREADS  # keys scored at once: one per thread
DIMS_PER_THREAD = MAX_HEAD_DIM // TILE + 1  # output dims a thread accumulates (tid + r * TILE)


@cuda.jit
def decode_partial(q, k, v, q_pos, k_pos, scale, window, chunk, partial):
    """Grid (Hkv, splits, T). Block (g, c, t) attends query token t's heads of KV group g to
    keys [c * chunk, (c + 1) * chunk): each thread scores one key of a tile for all heads of the
    group (K read once per group), the tile's softmax weights go through shared memory, and each
    thread accumulates V for its share of the output dims. It writes the split's running max,
    sum and unnormalized output per head: partial [T, splits, H, Dv + 2]."""
    g, c, t = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid = cuda.threadIdx.x
    n_keys, d, dv = k.shape[0], q.shape[2], v.shape[2]
    group = q.shape[1] // k.shape[1]
    qs = cuda.shared.array((MAX_GROUP, MAX_HEAD_DIM), float32)
    ps = cuda.shared.array((MAX_GROUP, TILE), float32)
    red = cuda.shared.array(TILE, float32)
    ms = cuda.shared.array(MAX_GROUP, float32)  # running max per head
    ss = cuda.shared.array(MAX_GROUP, float32)  # running sum per head
    shrink = cuda.shared.array(MAX_GROUP, float32)
    for i in range(tid, group * d, THREADS):
        qs[i // d, i % d] = q[t, g * group + i // d, i % d] * scale
    if tid < group:
        ms[tid] = -math.inf
        ss[tid] = 0.0
    acc = cuda.local.array((MAX_GROUP, DIMS_PER_THREAD), float32)
    for h in range(group):
        for r in range(DIMS_PER_THREAD):
            acc[h, r] = 0.0
    cuda.syncthreads()
    start = c * chunk
    stop = min(n_keys, start + chunk)
    for tile in range(start, stop, TILE):
        j = tile + tid
        valid = j < stop
        if valid:
            valid = k_pos[j] <= q_pos[t] and not (window > 0 and q_pos[t] - k_pos[j] >= window)
        for h in range(group):
            score = -math.inf
            if valid:
                score = float32(0.0)
                for i in range(d):
                    score += qs[h, i] * float32(k[j, g, i])
            ps[h, tid] = score
        cuda.syncthreads()
        for h in range(group):  # tile max per head, then the new running max
            red[tid] = ps[h, tid]
            top = block_reduce(red, tid, True)
            if tid == 0:
                new_m = max(ms[h], top)
                shrink[h] = math.exp(ms[h] - new_m) if new_m > -math.inf else 1.0
                ms[h] = new_m
            cuda.syncthreads()
        for h in range(group):
            p = float32(0.0)
            if ms[h] > -math.inf and ps[h, tid] > -math.inf:
                p = math.exp(ps[h, tid] - ms[h])
            ps[h, tid] = p
            red[tid] = p
            total = block_reduce(red, tid, False)
            if tid == 0:
                ss[h] = ss[h] * shrink[h] + total
            cuda.syncthreads()
        for r in range(DIMS_PER_THREAD):  # this thread's output dims: tid + r * TILE
            i = tid + r * TILE
            if i < dv:
                for h in range(group):
                    o = acc[h, r] * shrink[h]
                    for jj in range(min(TILE, stop - tile)):
                        if ps[h, jj] != 0.0:  # a masked key's V may be anything, NaN included
                            o += ps[h, jj] * float32(v[tile + jj, g, i])
                    acc[h, r] = o
        cuda.syncthreads()
    for h in range(group):
        head = g * group + h
        for r in range(DIMS_PER_THREAD):
            i = tid + r * TILE
            if i < dv:
                partial[t, c, head, i] = acc[h, r]
        if tid == 0:
            partial[t, c, head, dv] = ms[h]
            partial[t, c, head, dv + 1] = ss[h]


@cuda.jit
def decode_merge(partial, out):
    """Grid (T, H): the splits' outputs rescaled to the common max and normalized."""
    t, h, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    splits, dv = partial.shape[1], out.shape[2]
    top = -math.inf
    for c in range(splits):
        top = max(top, partial[t, c, h, dv])
    total = float32(0.0)
    for c in range(splits):
        m = partial[t, c, h, dv]
        if m > -math.inf:
            total += partial[t, c, h, dv + 1] * math.exp(m - top)
    for i in range(tid, dv, THREADS):
        o = float32(0.0)
        for c in range(splits):
            m = partial[t, c, h, dv]
            if m > -math.inf:
                o += partial[t, c, h, i] * math.exp(m - top)
        out[t, h, i] = o / total


def decode_splits(n_keys: int, n_kv_heads: int, n_tokens: int, sms: int = 132) -> int:
    """Enough splits to give every SM a few blocks, none shorter than one tile."""
    want = max(1, -(-4 * sms // (n_kv_heads * n_tokens)))
    return max(1, min(want, -(-n_keys // TILE)))


def attention_decode(q, k, v, q_pos, k_pos, out, scale, window, splits, partial, stream=0):
    """Decode attention (any few query tokens) split over the KV length: `partial` is scratch
    [T, splits, H, Dv + 2] fp32 (from the memory map)."""
    n_tokens, n_heads, _ = q.shape
    n_keys, n_kv = k.shape[0], k.shape[1]
    assert n_heads // n_kv <= MAX_GROUP and q.shape[2] <= MAX_HEAD_DIM
    chunk = -(-n_keys // splits)
    decode_partial[(n_kv, splits, n_tokens), THREADS, stream](
        q, k, v, q_pos, k_pos, scale, window, chunk, partial
    )
    decode_merge[(n_tokens, n_heads), THREADS, stream](partial, out)
