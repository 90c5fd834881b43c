"""The CPU side of a layer beyond its matmuls (`cpu.matmul`): RMSNorm, RoPE, attention over the
KV cache, SiLU/GELU gating, softmax — Numba `parallel=True` over rows or (token, head), fp32
storage with fp32 accumulation (fp64 inside the norm's sum). Each is compiled twice, parallel and
serial: a decode token's norm or gating is a few microseconds of work, less than waking the
thread team costs, so below `PARALLEL_WORK` the serial twin runs; and `parallel=False` while BLAS's
threads own the cores (`hostmath`: a prompt's ubatch), since two busy-waiting thread teams on the
same cores slowed a prompt 4x. Semantics are the reference's
(`refengine.reference`), against which each is tested; a plan that computes a whole layer on the
host runs these on the activations it downloads.
"""

from __future__ import annotations

import math
import types
from functools import lru_cache

import numpy as np
from numba import njit, prange
from numba.extending import register_jitable

from .simd import float_of_bits, half_bits


# values touched (times a rough cost per value) below which a kernel runs serially
PARALLEL_WORK = 1 << 15


def twins(fastmath: bool = False):
    """(parallel, serial) compilations of one kernel body written with prange."""

    def compile_both(fn):
        # a twin under its own name, so Numba's on-disk cache keeps the two apart; the error
        # model is what parallel=True implies: Python's check of every division for a zero
        # raises from inside the loop, which then does not vectorize
        twin = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial")
        twin.__qualname__ = twin.__name__
        return (njit(parallel=True, fastmath=fastmath, cache=True)(fn),
                njit(fastmath=fastmath, cache=True, error_model="numpy")(twin))  # fmt: skip

    return compile_both


def _rms_norm(x, weight, eps):
    rows, n = x.shape
    out = np.empty_like(x)
    for r in prange(rows):
        s = 0.0
        for i in range(n):
            s += np.float64(x[r, i]) * x[r, i]
        scale = np.float32(1.0 / math.sqrt(s / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * scale * (weight[i] if weight.size else np.float32(1.0))
    return out


_RMS_NORM = twins(fastmath=True)(_rms_norm)


def rms_norm(x, weight, eps, parallel: bool = True):
    """x [R, n] (rows: tokens, or tokens x heads) -> x / rms(x) * weight (weight may be empty)."""
    return _RMS_NORM[not parallel or x.size < PARALLEL_WORK](x, weight, eps)


def _rope_table(positions, n_rot, base, scale):
    half = n_rot // 2
    inv_freq = np.empty(half)
    for i in range(half):
        inv_freq[i] = base ** (-2.0 * i / n_rot)
    cos = np.empty((positions.size, half))
    sin = np.empty((positions.size, half))
    for t in prange(positions.size):
        for i in range(half):
            theta = positions[t] * scale * inv_freq[i]
            cos[t, i], sin[t, i] = math.cos(theta), math.sin(theta)
    return cos, sin


_ROPE_TABLE = twins()(_rope_table)


def rope_table(positions, n_rot, base, scale, parallel: bool = True):
    """(cos, sin) [T, n_rot / 2] fp64 of theta_i = pos * scale * base^(-2i / n_rot): the sines
    and cosines were most of a prompt's RoPE, and q and k share them."""
    return _ROPE_TABLE[not parallel or positions.size * n_rot * 8 < PARALLEL_WORK](
        positions, n_rot, base, scale
    )


def _rope(x, cos, sin, neox):
    n_tokens, n_heads, dim = x.shape
    half = cos.shape[1]
    out = x.copy()
    for t in prange(n_tokens):
        c, s = cos[t], sin[t]
        for h in range(n_heads):
            xr, o = x[t, h], out[t, h]
            if neox:
                for i in range(half):
                    a, b = np.float64(xr[i]), np.float64(xr[i + half])
                    o[i], o[i + half] = a * c[i] - b * s[i], a * s[i] + b * c[i]
            else:
                for i in range(half):
                    a, b = np.float64(xr[2 * i]), np.float64(xr[2 * i + 1])
                    o[2 * i], o[2 * i + 1] = a * c[i] - b * s[i], a * s[i] + b * c[i]
    return out


_ROPE = twins()(_rope)


def rope(x, positions, n_rot, base, scale, neox, parallel: bool = True, table=None):
    """x [T, H, D]: rotate the first n_rot dims of each head (pairs, or NeoX halves); `table`:
    `rope_table(positions, n_rot, base, scale)` if the caller has it."""
    cos, sin = table or rope_table(positions, n_rot, base, scale, parallel)
    return _ROPE[not parallel or x.shape[0] * x.shape[1] * n_rot * 8 < PARALLEL_WORK](
        x, cos, sin, neox
    )


@register_jitable
def hidden(k_pos, q_pos, window):
    """Whether a query at q_pos cannot see a key at k_pos: a later key, or one `window` or more
    behind it (window > 0)."""
    return k_pos > q_pos or (window > 0 and q_pos - k_pos >= window)


@register_jitable
def _f32(a):
    return np.float32(a)


@register_jitable
def _f16(a):
    return half_bits(a)


@lru_cache(maxsize=None)
def _attention_kernel(f16: bool, parallel: bool):
    read = _f16 if f16 else _f32

    @njit(parallel=parallel, fastmath=True, error_model="numpy")
    def attention(q, k, v, q_pos, k_pos, scale, window):
        n_tokens, n_heads, dim = q.shape
        n_keys, n_kv, dv = k.shape[0], k.shape[1], v.shape[2]
        group = n_heads // n_kv
        out = np.empty((n_tokens, n_heads, dv), np.float32)
        for th in prange(n_tokens * n_heads):
            t, h = th // n_heads, th % n_heads
            g = h // group
            acc = np.zeros(dv, np.float32)
            m, total = -np.inf, np.float32(0.0)
            for j in range(n_keys):
                if hidden(k_pos[j], q_pos[t], window):
                    continue
                score = np.float32(0.0)
                for i in range(dim):
                    score += q[t, h, i] * read(k[j, g, i])
                score *= scale
                new_m = max(m, score)
                shrink = np.float32(math.exp(m - new_m)) if m > -np.inf else np.float32(0.0)
                p = np.float32(math.exp(score - new_m))
                total = total * shrink + p
                for i in range(dv):
                    acc[i] = acc[i] * shrink + p * read(v[j, g, i])
                m = new_m
            for i in range(dv):
                out[t, h, i] = acc[i] / total
        return out

    return attention


def attention(q, k, v, q_pos, k_pos, scale: float, window: int = 0):
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] (fp32, or fp16 as the cache stores it) ->
    [T, H, Dv]: causal, optionally sliding-window, grouped heads; an online softmax per
    (token, head)."""
    f16 = k.dtype == np.float16
    if f16:
        k, v = k.view(np.uint16), v.view(np.uint16)
    work = q.shape[0] * q.shape[1] * k.shape[0] * (q.shape[2] + v.shape[2])
    return _attention_kernel(f16, work >= PARALLEL_WORK)(q, k, v, q_pos, k_pos, scale, window)


@register_jitable
def exp32(x):
    """e^x in fp32 within ~2 ulp, in arithmetic a loop vectorizes (libm's expf is a call per
    value: a prompt's GELU over 128 x 2048 values took 4.3 ms of Gemma-3's 17 ms layer): 2^n
    from the exponent field, a degree-6 polynomial on the remainder (|r| <= ln 2 / 2); x is
    clamped to [-87.3, 88.3] (SiLU's and tanh's limits are the same there)."""
    x = min(max(x, np.float32(-87.3)), np.float32(88.3))
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))  # math.floor: an int64
    r = x - n * np.float32(0.693145751953125) - n * np.float32(1.4286067653e-06)
    p = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (
        np.float32(1.0 / 6) + r * (np.float32(1.0 / 24) + r * (
            np.float32(1.0 / 120) + r * np.float32(1.0 / 720))))))
    return p * float_of_bits(np.int32((np.int32(n) + 127) << 23))


@register_jitable
def activation32(g, use_gelu):
    """SiLU, or GELU in ggml's tanh form, in fp32: 0.5 g (1 + tanh z) = g / (1 + e^-2z), the
    division SiLU's. The form 0.5 g (2 - 2 / (e^2z + 1)) read -1.2e-5 at g = -200 on a Zen 4 host,
    where fast math divides by a reciprocal estimate and 2 - 2 (1 - 2^-23) is not 0."""
    if use_gelu:
        z = np.float32(0.7978845608028654) * (g + np.float32(0.044715) * g * g * g)
        return g / (np.float32(1.0) + exp32(-(z + z)))
    return g / (np.float32(1.0) + exp32(-g))


def _gated(gate, up, use_gelu):
    # the activation chosen outside the loop over a row's views: a branch in it, or 2-D indexing,
    # kept LLVM from vectorizing (1.2 ms for a prompt's 128 x 2048 GELU, 0.2 ms vectorized)
    out = np.empty_like(gate)
    for t in prange(gate.shape[0]):
        g, u, o = gate[t], up[t], out[t]
        if use_gelu:
            for i in range(g.size):
                o[i] = activation32(g[i], True) * u[i]
        else:
            for i in range(g.size):
                o[i] = activation32(g[i], False) * u[i]
    return out


_GATED = twins(fastmath=True)(_gated)


def gated(gate, up, use_gelu, parallel: bool = True):
    """act(gate) * up over [T, n]: SiLU, or GELU in ggml's tanh form."""
    return _GATED[not parallel or gate.size * 16 < PARALLEL_WORK](gate, up, use_gelu)


def _masked_softmax(s, q_pos, k_pos, scale, window):
    group, rows, n_keys = s.shape
    for gr in prange(group * rows):
        row, t = s[gr // rows, gr % rows], gr % rows
        top = -np.inf
        for j in range(n_keys):
            v = -np.inf if hidden(k_pos[j], q_pos[t], window) else row[j] * scale
            row[j] = v
            top = max(top, v)
        total = np.float32(0.0)
        for j in range(n_keys):
            # below e^-80 of the row's largest, 0: exp32's floor (e^-87) scaled by the sum would
            # be subnormal, and the product with V then ran 50x slow
            x = row[j] - top
            e = exp32(x) if x > np.float32(-80.0) else np.float32(0.0)
            row[j] = e
            total += e
        inv = np.float32(1.0) / total
        for j in range(n_keys):
            row[j] *= inv


_MASKED_SOFTMAX = twins(fastmath=True)(_masked_softmax)


def masked_softmax(s, q_pos, k_pos, scale: float, window: int = 0, parallel: bool = True):
    """In place over scores s [G, T, S] (fp32) of T queries at q_pos and S keys at k_pos: scaled,
    the keys after a query (or `window` or more behind it) hidden, a softmax per row (every row
    sees its own key, so none is empty)."""
    _MASKED_SOFTMAX[not parallel or s.size * 8 < PARALLEL_WORK](
        s, q_pos, k_pos, np.float32(scale), window)  # fmt: skip


@njit(parallel=True, cache=True)
def softmax(x):
    """Row-wise softmax of x [T, n], in fp64."""
    out = np.empty_like(x)
    for t in prange(x.shape[0]):
        top = x[t].max()
        s = 0.0
        for i in range(x.shape[1]):
            s += math.exp(np.float64(x[t, i]) - top)
        for i in range(x.shape[1]):
            out[t, i] = math.exp(np.float64(x[t, i]) - top) / s
    return out


@njit(parallel=True, cache=True)
def _gated_sum(down, gates, ids, out):
    n_tokens, k, n = down.shape
    for t in prange(n_tokens):
        order = np.argsort(ids[t])  # the reference's order: by expert id
        o = out[t]
        for i in range(n):
            o[i] = np.float32(0.0)
        for j in order:
            g, d = gates[t, j], down[t, j]
            for i in range(n):
                o[i] += g * d[i]


def gated_sum(down: np.ndarray, gates: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Each token's chosen experts' outputs down [T, k, n] weighted by their gates [T, k] and
    summed -> [T, n]: fp32 products added in increasing expert id, as the reference's loop over
    the experts adds them (a NumPy pass per expert took 6 ms of a 128-token MoE layer)."""
    out = np.empty((down.shape[0], down.shape[2]), np.float32)
    _gated_sum(np.ascontiguousarray(down, np.float32), np.ascontiguousarray(gates, np.float32),
               np.ascontiguousarray(ids), out)  # fmt: skip
    return out


@njit(cache=True)
def _route(logits, n_used, normalize, ids, weights):
    n_expert = logits.shape[1]
    probs = np.empty(n_expert, np.float64)
    chosen = np.empty(n_used, np.float64)
    for t in range(logits.shape[0]):
        top = -np.inf
        for e in range(n_expert):
            top = max(top, np.float64(logits[t, e]))
        s = 0.0
        for e in range(n_expert):
            s += math.exp(np.float64(logits[t, e]) - top)
        for e in range(n_expert):  # rounded to fp32, as the reference's softmax returns them
            probs[e] = np.float32(math.exp(np.float64(logits[t, e]) - top) / s)
        total = 0.0
        for j in range(n_used):  # the most probable left, the lower id on a tie
            best = 0
            for e in range(1, n_expert):
                if probs[e] > probs[best]:
                    best = e
            ids[t, j] = best
            chosen[j] = probs[best]
            total += probs[best]
            probs[best] = -1.0
        for j in range(n_used):
            weights[t, j] = chosen[j] / total if normalize else chosen[j]


def route(logits: np.ndarray, n_used: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """`refengine.reference.moe_route` compiled: [T, E] router logits -> (expert ids [T, k],
    weights [T, k]). NumPy's argsort and temporaries took ~32 us a layer of a decode token."""
    ids = np.empty((logits.shape[0], n_used), np.int64)
    weights = np.empty((logits.shape[0], n_used), np.float32)
    _route(np.ascontiguousarray(logits, np.float32), n_used, normalize, ids, weights)
    return ids, weights
