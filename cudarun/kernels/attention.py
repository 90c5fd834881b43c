"""Attention as CUDA kernels over the runtime's fp16 KV ring: causal, optionally sliding-window,
grouped K/V heads, in fp32.

One block computes a tile of query rows against a range of keys, flash-attention style: the rows
are consecutive (token, head) pairs of one KV head's group (row p is token p // group, head
g * group + p % group), so every K/V row it loads serves all of them. Per tile of TILE keys:

1. the keys' positions decide, for the whole block at once (`syncthreads_or`), whether any row can
   see any of them; a tile no row can see (the future, past the window, never-written cells whose
   position is kvstore.EMPTY) is skipped without reading K or V;
2. the warps copy the tile's K rows into shared memory (`_stage`): consecutive lanes read
   consecutive 64-bit words (four fp16; 32-bit pairs where the head dim or the address is not a
   multiple of 4), each lane four rows' words before it stores any, converted to fp32 once. A key
   no row can see is stored as 0, so the NaN an unwritten cell may hold never reaches the
   arithmetic (0 * NaN is NaN);
3. lane j of a warp scores key j for one row, and the warp's shuffles give the tile's max and sum:
   the online softmax (running max, sum, rescale) in fp32;
4. the V rows are copied the same way, and each thread updates its (row, dim) entries of the
   output accumulator in shared memory.

A staged row keeps the fp16 values of a word apart, in planes: value c of word w at c * words + w
(`_slot`), so the lanes' stores fall in distinct banks. A dot product does not care about the
order; the queries are laid out the same way, and the output is read back through it.

Decode (1..MAX_DECODE_TOKENS tokens) runs `attention_vec`'s kernel (llama.cpp's fattn-vec design)
where a lane's share of a row fits its registers, else this one over `splits` blocks per row tile;
each writes its running max, sum and unnormalized output to `partial` [T, splits, H, Dv + 2], and a
second kernel merges them per head. Prefill gives each block all the keys and writes the output.

No f64 (float32 scalars; NEG below any score stands in for -inf, whose literal is an f64), no
local arrays, warp-shuffle reductions: `python -m cudarun.ptx_check --out DIR` shows each kernel
with a 0-byte stack frame and no spills."""

from __future__ import annotations

import math

import numpy as np

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import config, cuda, float32, uint64  # noqa: E402

from . import THREADS, attention_vec  # noqa: E402
from .attention_vec import MAX_HEAD_DIM, NEG, cache_words  # noqa: E402
from .bits import half_to_float  # noqa: E402
from .elementwise import warp_max, warp_sum  # noqa: E402

TILE = THREADS  # keys per tile: one per lane when scoring
WARPS = 2 if config.ENABLE_CUDASIM else 4  # per block; the simulator runs every thread in Python
BLOCK_THREADS = WARPS * THREADS
MAX_ROWS = 16  # query rows per block
ROW_FLOATS = 1024  # rows x head dim a block keeps in shared memory (queries, and the output)
KV_FLOATS = TILE * (MAX_HEAD_DIM + 1)  # a tile of K or V rows in fp32, each padded by one
PS_FLOATS = MAX_ROWS * TILE  # the tile's softmax weights per row
# unsigned index arithmetic in the inner loops: a signed index costs Numba's negative-index
# wraparound (three instructions an access) and its range loops a few more, five times the loads
# and FMAs they carry
ZERO, ONE, TWO, THREE, FOUR, LANES = (uint64(x) for x in (0, 1, 2, 3, 4, THREADS))
SHIFTS = tuple(uint64(16 * c) for c in range(4))
# Five blocks' 43 KB of shared memory fill an H100 SM; the launch bounds ask ptxas for registers
# for as many (at most 102 a thread), which it gives without spilling
BLOCKS_PER_SM = 5
tiled = (
    cuda.jit if config.ENABLE_CUDASIM else cuda.jit(launch_bounds=(BLOCK_THREADS, BLOCKS_PER_SM))
)


def rows_per_block(n_tokens: int, group: int, head_dim: int, head_dim_v: int) -> int:
    """How many (token, head) rows one block attends: MAX_ROWS, fewer when its head dims would
    not fit the shared-memory tiles, never more than there are."""
    return max(1, min(MAX_ROWS, ROW_FLOATS // max(head_dim, head_dim_v), n_tokens * group))


@cuda.jit(device=True)
def _slot(i, words, per):
    """Where dim i of a row sits once staged: value i % per of word i // per, in planes."""
    return (i & (per - 1)) * words + i // per


@cuda.jit(device=True)
def _seen(kp, lo, hi, window):
    """Whether a key at position kp is visible to some query at a position in [lo, hi]."""
    return kp <= hi and not (window > 0 and lo - kp >= window)


@cuda.jit(device=True)
def _put(kv, at, word, words, per):
    """The fp16 values of one cache word (2 or 4) as fp32, in planes from kv[at]."""
    kv[at] = half_to_float(word)
    kv[at + words] = half_to_float(word >> SHIFTS[1])
    if per == FOUR:
        kv[at + TWO * words] = half_to_float(word >> SHIFTS[2])
        kv[at + THREE * words] = half_to_float(word >> SHIFTS[3])


@cuda.jit(device=True)
def _stage(src, tile, g, n, lo, hi, window, kpos, kv):
    """Rows tile..tile + n of src [S, Hkv, words] (uint64 or uint32 words of fp16) at KV head g
    into kv (fp32, row j from j * (width + 1), in planes). A warp per row and consecutive lanes on
    consecutive words; each lane loads its words of four rows before it stores one, so four loads
    are in flight. A row no query of the block can see is written as zeros instead of read."""
    tid = cuda.threadIdx.x
    lane, warp, nw = tid % THREADS, tid // THREADS, cuda.blockDim.x // THREADS
    words = src.shape[2]
    width = src.shape[2] * (src.itemsize // 2)
    uw, ug, per, stride = uint64(words), uint64(g), uint64(width // words), uint64(width + 1)
    for j0 in range(warp, n, 4 * nw):
        j1, j2, j3 = j0 + nw, j0 + 2 * nw, j0 + 3 * nw
        l0 = _seen(kpos[j0], lo, hi, window)
        l1 = j1 < n and _seen(kpos[j1], lo, hi, window)
        l2 = j2 < n and _seen(kpos[j2], lo, hi, window)
        l3 = j3 < n and _seen(kpos[j3], lo, hi, window)
        r0, r1, r2, r3 = uint64(tile + j0), uint64(tile + j1), uint64(tile + j2), uint64(tile + j3)
        d0, d1 = uint64(j0) * stride, uint64(j1) * stride
        d2, d3 = uint64(j2) * stride, uint64(j3) * stride
        w = uint64(lane)
        while w < uw:
            x0 = uint64(src[r0, ug, w]) if l0 else ZERO
            x1 = uint64(src[r1, ug, w]) if l1 else ZERO
            x2 = uint64(src[r2, ug, w]) if l2 else ZERO
            x3 = uint64(src[r3, ug, w]) if l3 else ZERO
            _put(kv, d0 + w, x0, uw, per)
            if j1 < n:
                _put(kv, d1 + w, x1, uw, per)
            if j2 < n:
                _put(kv, d2 + w, x2, uw, per)
            if j3 < n:
                _put(kv, d3 + w, x3, uw, per)
            w += LANES


@cuda.jit(device=True)
def _attend(q, k, v, q_pos, k_pos, scale, window, g, p0, rows, start, stop,
            qs, kv, ps, acc, ms, ss, shrink, kpos, rpos):  # fmt: skip
    """Rows p0..p0 + rows of KV head g attend keys [start, stop). q [T, H, D] fp32; k, v the
    caches as words (`_words`). Leaves acc[r * Dv + _slot(i)] (unnormalized), ms[r] (the running
    max, NEG if the row saw no key) and ss[r] (the sum); the caller syncs before reading them."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    lane, warp, nw = tid % THREADS, tid // THREADS, nt // THREADS
    group = q.shape[1] // k.shape[1]
    d = q.shape[2]
    dv = v.shape[2] * (v.itemsize // 2)
    k_words = k.shape[2]
    k_per = d // k_words
    ud, row_v = uint64(d), uint64(dv + 1)
    # the rows' scaled queries (in K's planes), warp per row, lanes along it
    for r in range(warp, rows, nw):
        p = p0 + r
        t, h = p // group, g * group + p % group
        for i in range(lane, d, THREADS):
            qs[r * d + _slot(i, k_words, k_per)] = q[t, h, i] * scale
        for i in range(lane, dv, THREADS):
            acc[r * dv + i] = float32(0.0)
        if lane == 0:
            rpos[r] = q_pos[t]
            ms[r] = NEG
            ss[r] = float32(0.0)
    # the block's query positions span [lo, hi]: a key past hi, or window or more before lo, is
    # masked for every row
    lo = q_pos[p0 // group]
    hi = lo
    for t in range(p0 // group + 1, (p0 + rows - 1) // group + 1):
        lo = min(lo, q_pos[t])
        hi = max(hi, q_pos[t])
    # this thread's first (row, dim) output entry; it steps by nt
    e_row, e_dim = tid // dv, tid % dv
    for tile in range(start, stop, TILE):
        n = min(TILE, stop - tile)
        seen = 0
        if tid < n:
            kp = k_pos[tile + tid]
            kpos[tid] = kp
            if _seen(kp, lo, hi, window):
                seen = 1
        if cuda.syncthreads_or(seen) == 0:
            continue
        _stage(k, tile, g, n, lo, hi, window, kpos, kv)
        cuda.syncthreads()
        # scores: warp per row, lane per key; every warp runs the same rounds (its shuffles)
        for r0 in range(0, rows, nw):
            r = r0 + warp
            mine = r < rows
            if not mine:
                r = 0  # a spare warp's shuffles, with nothing written
            score = NEG
            valid = False
            if mine and lane < n:
                kp, qp = kpos[lane], rpos[r]
                valid = kp <= qp and not (window > 0 and qp - kp >= window)
            if valid:
                dot = float32(0.0)
                qa = uint64(r) * ud
                end = qa + ud
                ka = uint64(lane) * (ud + ONE)
                while qa < end:
                    dot += qs[qa] * kv[ka]
                    qa += ONE
                    ka += ONE
                score = dot
            m_old = ms[r]
            m_new = max(m_old, warp_max(score))
            p = math.exp(score - m_new) if valid else float32(0.0)
            if mine:
                ps[r * TILE + lane] = p
            total = warp_sum(p)
            # every lane has read ms[r] before the shuffles above could finish: lane 0 may write
            if mine and lane == 0:
                f = math.exp(m_old - m_new)
                shrink[r] = f
                ms[r] = m_new
                ss[r] = ss[r] * f + total
        cuda.syncthreads()
        _stage(v, tile, g, n, lo, hi, window, kpos, kv)
        cuda.syncthreads()
        # acc[r, i] = acc * shrink + sum_j p[r, j] v[j, i]: consecutive threads, consecutive i
        r, i = e_row, e_dim
        while r < rows:
            ea = uint64(r * dv + i)
            o = acc[ea] * shrink[r]
            pa = uint64(r * TILE)
            end = pa + uint64(n)
            va = uint64(i)
            while pa < end:
                o += ps[pa] * kv[va]
                pa += ONE
                va += row_v
            acc[ea] = o
            i += nt
            while i >= dv:
                i -= dv
                r += 1


@tiled
def attention(q, k, v, q_pos, k_pos, out, scale, window, rows):
    """Prefill: grid (row tiles, Hkv); out [T, H, Dv] fp32; k, v the caches as words
    (`attention_prefill`)."""
    b, g = cuda.blockIdx.x, cuda.blockIdx.y
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    lane, warp, nw = tid % THREADS, tid // THREADS, nt // THREADS
    group = q.shape[1] // k.shape[1]
    dv = out.shape[2]
    v_words = v.shape[2]
    v_per = dv // v_words
    p0 = b * rows
    rows = min(rows, q.shape[0] * group - p0)
    qs = cuda.shared.array(ROW_FLOATS, float32)
    acc = cuda.shared.array(ROW_FLOATS, float32)
    kv = cuda.shared.array(KV_FLOATS, float32)
    ps = cuda.shared.array(PS_FLOATS, float32)
    ms = cuda.shared.array(MAX_ROWS, float32)
    ss = cuda.shared.array(MAX_ROWS, float32)
    shrink = cuda.shared.array(MAX_ROWS, float32)
    kpos = cuda.shared.array(TILE, np.int64)
    rpos = cuda.shared.array(MAX_ROWS, np.int64)
    _attend(q, k, v, q_pos, k_pos, scale, window, g, p0, rows, 0, k.shape[0],
            qs, kv, ps, acc, ms, ss, shrink, kpos, rpos)  # fmt: skip
    cuda.syncthreads()
    for r in range(warp, rows, nw):
        p = p0 + r
        t, h = p // group, g * group + p % group
        inv = float32(1.0) / ss[r]
        for i in range(lane, dv, THREADS):
            out[t, h, i] = acc[r * dv + _slot(i, v_words, v_per)] * inv


@tiled
def decode_partial(q, k, v, q_pos, k_pos, scale, window, chunk, rows, partial):
    """Grid (Hkv, splits, row tiles). Block (g, c, b) attends row tile b of KV head g to keys
    [c * chunk, (c + 1) * chunk) and writes each row's unnormalized output, running max and sum:
    partial [T, splits, H, Dv + 2]."""
    g, c, b = cuda.blockIdx.x, cuda.blockIdx.y, cuda.blockIdx.z
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    lane, warp, nw = tid % THREADS, tid // THREADS, nt // THREADS
    group = q.shape[1] // k.shape[1]
    dv = partial.shape[3] - 2
    v_words = v.shape[2]
    v_per = dv // v_words
    p0 = b * rows
    rows = min(rows, q.shape[0] * group - p0)
    start = c * chunk
    stop = min(k.shape[0], start + chunk)
    qs = cuda.shared.array(ROW_FLOATS, float32)
    acc = cuda.shared.array(ROW_FLOATS, float32)
    kv = cuda.shared.array(KV_FLOATS, float32)
    ps = cuda.shared.array(PS_FLOATS, float32)
    ms = cuda.shared.array(MAX_ROWS, float32)
    ss = cuda.shared.array(MAX_ROWS, float32)
    shrink = cuda.shared.array(MAX_ROWS, float32)
    kpos = cuda.shared.array(TILE, np.int64)
    rpos = cuda.shared.array(MAX_ROWS, np.int64)
    _attend(q, k, v, q_pos, k_pos, scale, window, g, p0, rows, start, stop,
            qs, kv, ps, acc, ms, ss, shrink, kpos, rpos)  # fmt: skip
    cuda.syncthreads()
    for r in range(warp, rows, nw):
        p = p0 + r
        t, h = p // group, g * group + p % group
        for i in range(lane, dv, THREADS):
            partial[t, c, h, i] = acc[r * dv + _slot(i, v_words, v_per)]
        if lane == 0:
            partial[t, c, h, dv] = ms[r]
            partial[t, c, h, dv + 1] = ss[r]


@cuda.jit
def decode_merge(partial, out):
    """Grid (T, H): the splits' outputs rescaled to their common max and normalized. A split that
    saw no key has max NEG and weighs exp(NEG - top) = 0."""
    t, h, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    splits, dv = partial.shape[1], out.shape[2]
    top = NEG
    for c in range(splits):
        top = max(top, partial[t, c, h, dv])
    total = float32(0.0)
    for c in range(splits):
        total += partial[t, c, h, dv + 1] * math.exp(partial[t, c, h, dv] - top)
    inv = float32(1.0) / total
    for i in range(tid, dv, THREADS):
        o = float32(0.0)
        for c in range(splits):
            o += partial[t, c, h, i] * math.exp(partial[t, c, h, dv] - top)
        out[t, h, i] = o * inv


def decode_splits(n_keys: int, n_kv_heads: int, n_tokens: int, sms: int = 132) -> int:
    """The tiled kernel's splits, its blocks counted a token a KV head: none shorter than a tile."""
    return attention_vec.decode_splits(n_keys, n_kv_heads, n_tokens, sms, split_keys=TILE)


def _rows(q, k, v) -> int:
    return rows_per_block(q.shape[0], q.shape[1] // k.shape[1], q.shape[2], v.shape[2])


def attention_decode(q, k, v, q_pos, k_pos, out, scale, window, splits, partial, stream=0):
    """Decode attention (any few query tokens) split over the KV length, in at most `splits`
    splits: `partial` is scratch [T, splits, H, Dv + 2] fp32 (from the memory map). k, v: fp16
    [S, Hkv, D]. The vec kernel (`attention_vec`) where a lane's share of a row fits its
    registers, else the tiled one."""
    n_tokens, n_heads, _ = q.shape
    n_keys, n_kv = k.shape[0], k.shape[1]
    shape = attention_vec.kernel_shape(q, k, v)
    if shape is not None:
        tiles = -(-n_tokens * (n_heads // n_kv) // shape.rows)
        splits = min(splits, attention_vec.decode_splits(n_keys, n_kv, tiles))
        partial = partial[:, :splits]
        attention_vec.attend(q, k, v, q_pos, k_pos, scale, window, partial, shape, stream)
    else:
        rows = _rows(q, k, v)
        chunk = -(-n_keys // splits)
        tiles = -(-n_tokens * (n_heads // n_kv) // rows)
        decode_partial[(n_kv, splits, tiles), BLOCK_THREADS, stream](
            q, cache_words(k), cache_words(v), q_pos, k_pos, np.float32(scale), np.int64(window),
            np.int64(chunk), np.int64(rows), partial,
        )  # fmt: skip
    decode_merge[(n_tokens, n_heads), THREADS, stream](partial, out)


def attention_prefill(q, k, v, q_pos, k_pos, out, scale, window, stream=0):
    """Attention of a prompt's ubatch over the whole cache: q [T, H, D] fp32, k, v fp16
    [S, Hkv, D], out [T, H, Dv] fp32."""
    n_tokens, n_heads, _ = q.shape
    n_kv = k.shape[1]
    rows = _rows(q, k, v)
    tiles = -(-n_tokens * (n_heads // n_kv) // rows)
    attention[(tiles, n_kv), BLOCK_THREADS, stream](
        q, cache_words(k), cache_words(v), q_pos, k_pos, out, np.float32(scale), np.int64(window),
        np.int64(rows),
    )  # fmt: skip
