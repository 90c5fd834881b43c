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

from .. import compat  # noqa: F401  (before numba.cuda)
from ..blocks import LAYOUTS
from . import elementwise

# module level: the simulator swaps this global for its fake module
from numba import cuda, float32, int32  # noqa: E402

from . import THREADS  # noqa: E402

MAX_EXPERTS = 256


@cuda.jit
def route(logits, n_used, normalize, ids, weights):
    """Per token (one thread each): softmax over the E router logits, the n_used most probable
    (ties: the lower id, as the reference's stable sort), optionally renormalized to sum 1."""
    t = cuda.grid(1)
    if t >= logits.shape[0]:
        return
    n = logits.shape[1]
    probs = cuda.local.array(MAX_EXPERTS, float32)
    top = logits[t, 0]
    for e in range(1, n):
        top = max(top, logits[t, e])
    total = float32(0.0)
    for e in range(n):
        probs[e] = math.exp(logits[t, e] - top)
        total += probs[e]
    kept = float32(0.0)
    for j in range(n_used):
        best = -1
        for e in range(n):
            if probs[e] >= 0 and (best < 0 or probs[e] > probs[best]):
                best = e
        ids[t, j] = best
        weights[t, j] = probs[best] / total
        kept += probs[best] / total
        probs[best] = -1.0  # taken
    if normalize:
        for j in range(n_used):
            weights[t, j] /= kept


@lru_cache(maxsize=None)
def expert_matvec_kernel(qtype):
    decode, per_block, block_nbytes = LAYOUTS[qtype]

    @cuda.jit
    def expert_matvec(raw, x, ids, out, n_rows, n_cols, per_slot_input):
        """out [slots, n_rows]: one thread block per (row, slot); the slot's expert's row times
        x[slot] (per_slot_input) or x[slot's token]."""
        row, slot, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
        k = ids.shape[1]
        t, j = slot // k, slot % k
        src = slot if per_slot_input else t
        partial = cuda.shared.array(THREADS, float32)
        vals = cuda.local.array(per_block, float32)
        blocks = n_cols // per_block
        row_base = (int32(ids[t, j]) * n_rows + row) * blocks * block_nbytes
        acc = float32(0.0)
        for b in range(tid, blocks, THREADS):
            decode(raw, row_base + b * block_nbytes, vals)
            for i in range(per_block):
                acc += vals[i] * x[src, b * per_block + i]
        partial[tid] = acc
        total = elementwise.block_reduce(partial, tid, False)
        if tid == 0:
            out[slot, row] = total

    return expert_matvec


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
    route.forall(n_tokens, stream=stream)(router_logits, n_used, normalize, ids, weights)
    n_ff, d = shapes[0]
    g = cuda.device_array((slots, n_ff), "float32", stream=stream)
    u = cuda.device_array((slots, n_ff), "float32", stream=stream)
    for raw, qtype, out in ((gate, qtypes[0], g), (up, qtypes[1], u)):
        expert_matvec_kernel(qtype)[(n_ff, slots), THREADS, stream](
            raw, x, ids, out, n_ff, d, False
        )
    h = cuda.device_array((slots, n_ff), "float32", stream=stream)
    elementwise.launch_rows(elementwise.gated, slots, g, u, h, act == "gelu", stream=stream)
    y = cuda.device_array((slots, d), "float32", stream=stream)
    expert_matvec_kernel(qtypes[2])[(d, slots), THREADS, stream](down, h, ids, y, d, n_ff, True)
    out = cuda.device_array((n_tokens, d), "float32", stream=stream)
    combine[n_tokens, THREADS, stream](y, weights, out)
    return out
