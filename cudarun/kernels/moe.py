"""Mixture of experts on the GPU: the router's top-k, the expert matmuls over only the selected
experts, and the weighted sum of their outputs (reference: `refengine.reference.moe_route` and
`moe_ffn`).

An expert tensor holds E matrices back to back ([E, n_rows, n_cols] in GGUF blocks), so expert e's
row r starts at block row e * n_rows + r. A "slot" is one (token, chosen expert) pair, t * k + j:
the gate and up matmuls read token t's input, the down matmul reads the slot's own hidden state.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from .. import compat  # noqa: F401  (before numba.cuda)
from . import elementwise, matvec

# module level: the simulator swaps this global for its fake module
from numba import cuda, float32, int64  # noqa: E402

from . import THREADS  # noqa: E402
from .dequant import quad_layout  # noqa: E402
from .elementwise import FULL_MASK, warp_max, warp_sum  # noqa: E402

MAX_EXPERTS = 256


@cuda.jit(device=True)
def warp_argmax(p, e):
    """The largest p over the warp's lanes and its id e (ties: the lower id); every lane gets it."""
    step = THREADS // 2
    while step > 0:
        q = cuda.shfl_xor_sync(FULL_MASK, p, step)
        f = cuda.shfl_xor_sync(FULL_MASK, e, step)
        if q > p or (q == p and f < e):
            p, e = q, f
        step //= 2
    return p, e


@cuda.jit
def route(logits, n_used, normalize, ids, weights):
    """Per token (a warp each, lanes striding over the E experts): softmax over the router logits,
    the n_used most probable (ties: the lower id, as the reference's stable sort), optionally
    renormalized to sum 1. The probabilities live in shared memory, each lane touching only its
    own experts' cells."""
    t, lane = cuda.blockIdx.x, cuda.threadIdx.x
    n = logits.shape[1]
    probs = cuda.shared.array(MAX_EXPERTS, float32)
    top = float32(-3.0e38)
    for e in range(lane, n, THREADS):
        top = max(top, logits[t, e])
    top = warp_max(top)
    total = float32(0.0)
    for e in range(lane, n, THREADS):
        p = math.exp(logits[t, e] - top)
        probs[e] = p
        total += p
    total = warp_sum(total)
    kept = float32(0.0)
    for j in range(n_used):
        best_p, best = float32(-1.0), n
        for e in range(lane, n, THREADS):
            if probs[e] > best_p:  # strictly: the lowest of this lane's tied ids
                best_p, best = probs[e], e
        best_p, best = warp_argmax(best_p, best)
        if lane == 0:
            ids[t, j] = best
            weights[t, j] = best_p / total
        kept += best_p / total
        if best % THREADS == lane:
            probs[best] = -1.0  # taken
    if normalize and lane == 0:
        for j in range(n_used):
            weights[t, j] /= kept


def route_top_k(logits, n_used: int, normalize: bool, ids, weights, stream=0) -> None:
    """ids, weights [T, n_used] (device) = the router's choice per token of logits [T, E]."""
    assert logits.shape[1] <= MAX_EXPERTS
    route[logits.shape[0], THREADS, stream](logits, np.int64(n_used), normalize, ids, weights)


@lru_cache(maxsize=None)
def expert_matvec_kernel(qtype):
    dots = matvec.row_dots(qtype)
    _, per_block, block_nbytes = quad_layout(qtype)

    @cuda.jit
    def expert_matvec(raw, cache, x, ids, out, n_rows, n_cols, per_slot_input, n_cached):
        """out [slots, n_rows]: a warp per (row, slot), ROWS rows per thread block; the slot's
        expert's row times x[slot] (per_slot_input) or x[slot's token]. The expert at place p
        (ids) is the p-th of `cache` below `n_cached`, else the (p - n_cached)-th of `raw`
        (an expert cache, and a routed copy); both bytes as uint16."""
        lane, warp = cuda.threadIdx.x % THREADS, cuda.threadIdx.x // THREADS
        row, slot = cuda.blockIdx.x * matvec.ROWS + warp, cuda.blockIdx.y
        k = ids.shape[1]
        t, j = slot // k, slot % k
        src = slot if per_slot_input else t
        place = int64(ids[t, j])
        held = place < n_cached
        stack = cache if held else raw
        # past the last row: run on the clamped row, store nothing (as in `matvec`)
        expert_row = (place if held else place - n_cached) * n_rows + min(row, n_rows - 1)
        a, _, _, _ = dots(stack, expert_row * (n_cols // per_block) * block_nbytes, x, src,
                          src + 1, n_cols, lane)  # fmt: skip
        a = warp_sum(a)
        if lane == 0 and row < n_rows:
            out[slot, row] = a

    return expert_matvec


def expert_matvec(raw, x, ids, out, qtype, shape: tuple[int, int], per_slot_input: bool,
                  stream=0, cache=None, n_cached: int = 0) -> None:  # fmt: skip
    """out [slots, n_rows] (device) = each slot's expert (ids [T, k]) of the expert tensor in `raw`
    (device bytes; per-expert shape `shape`) times x[slot] or x[slot's token]; with an expert
    `cache` of `n_cached` experts, ids are places: in the cache first, then in `raw`."""
    n_rows, n_cols = shape
    grid = (-(-n_rows // matvec.ROWS), out.shape[0])
    words = raw.view(np.uint16)
    expert_matvec_kernel(qtype)[grid, matvec.ROWS * THREADS, stream](
        words, words if cache is None else cache.view(np.uint16), x, ids, out, np.int64(n_rows),
        np.int64(n_cols), per_slot_input, np.int64(n_cached),
    )  # fmt: skip


@cuda.jit
def combine(y, weights, out):
    """out [T, n] = sum_j weights[t, j] * y[t * k + j]; a thread block per token."""
    t, tid = cuda.blockIdx.x, cuda.threadIdx.x
    k = weights.shape[1]
    for i in range(tid, out.shape[1], THREADS):
        s = float32(0.0)
        for j in range(k):
            s += weights[t, j] * y[t * k + j, i]
        out[t, i] = s


def moe_ffn(x, router_logits, gate, up, down, qtypes, shapes, n_used, normalize, act, stream=0):
    """The selected experts' gated FFNs mixed by the router's weights, all on the device.

    x [T, d] and router_logits [T, E] (device arrays); gate, up, down: the expert tensors' raw
    device bytes, of types `qtypes` and per-expert shapes `shapes` ((n_ff, d), (n_ff, d),
    (d, n_ff)). Returns the [T, d] output (device)."""
    n_tokens, n_experts = router_logits.shape
    assert n_experts <= MAX_EXPERTS
    slots = n_tokens * n_used
    ids = cuda.device_array((n_tokens, n_used), "int32", stream=stream)
    weights = cuda.device_array((n_tokens, n_used), "float32", stream=stream)
    route_top_k(router_logits, n_used, normalize, ids, weights, stream)
    n_ff, d = shapes[0]
    g = cuda.device_array((slots, n_ff), "float32", stream=stream)
    u = cuda.device_array((slots, n_ff), "float32", stream=stream)
    for raw, qtype, out in ((gate, qtypes[0], g), (up, qtypes[1], u)):
        expert_matvec(raw, x, ids, out, qtype, (n_ff, d), False, stream)
    h = cuda.device_array((slots, n_ff), "float32", stream=stream)
    elementwise.launch_rows(elementwise.gated, slots, g, u, h, act == "gelu", stream=stream)
    y = cuda.device_array((slots, d), "float32", stream=stream)
    expert_matvec(down, h, ids, y, qtypes[2], (d, n_ff), True, stream)
    out = cuda.device_array((n_tokens, d), "float32", stream=stream)
    combine[n_tokens, THREADS, stream](y, weights, out)
    return out
