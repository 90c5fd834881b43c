"""A transformer layer for a few tokens (decode) as one Numba call, or two for a routed layer:
the host's forward pass without a return to Python between its operations.

A decode token's layer is ~1 MB of weights on a small model; run as a dozen calls from Python
(norm, three matmuls, RoPE, attention, ...) it spent as much time in dispatch and in waking the
thread team as in its kernels. The attention half (`attention_kernel`) has three parallel regions
(the Q/K/V rows together, the attention heads — serial for a short context, the output rows), a
dense FFN (`ffn_kernel`) two (the gate and up rows together, each group of 32 gated and quantized
where it was computed; the down rows), the small operations serial between them; a
dense layer (`layer_kernel`) is both in one call. A routed layer's experts (`moe_ffn_kernel`) are
a second call, after the router (whose rule differs by architecture) has run in Python. The
matmuls are the named int8 path (`simd.q8_row`: activations quantized to int8 per 32 as
`cpu.quantize_activations` does), the rest the `cpu_ops` semantics: RMSNorm with an fp64 sum,
RoPE in fp64 (pairs or NeoX), attention over the fp16 KV cache (scores, one softmax, then V), SiLU
or GELU gating in fp32. K and V are written into the cache (fp16, round to nearest even) before the
attention reads it. The tokens may be of several sequences (a decode step of many): each writes
its own cell and attends over its own cells (`kvstore.CellMap`).

The kernels are compiled per tuple of matrix types and token count (a model has one or a few
such tuples). Optional tensors (biases, Q/K norms, the post-norms) are passed as empty arrays
when the architecture has none.
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, register_jitable

from solver.cost import HOST_ATTENTION_PARALLEL_PAIRS

from ..blocks import layout
from .cpu import quantize_activations, quantize_group, row_dots
from .cpu_ops import activation32, hidden, twins
from .simd import half_bits

# the integer parameters, in order, of a layer call (`ints`)
INTS = ("n_head", "n_kv", "head_dim", "head_dim_v", "n_rot", "neox", "window", "gelu", "n_ff")
FLOATS = ("eps", "rope_base", "rope_scale", "attn_scale")


@intrinsic
def f32_bits(typingctx, x):
    """The 32 bits of a float32, as a uint32."""

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@register_jitable
def half_of(x):
    """float32 -> the bits of the nearest fp16 (ties to even; overflow to inf, NaN kept), as
    numpy's float16 conversion rounds."""
    b = np.int64(f32_bits(np.float32(x)))
    sign = (b >> 16) & 0x8000
    exp = (b >> 23) & 0xFF
    man = b & 0x7FFFFF
    if exp == 0xFF:  # inf or NaN
        return np.uint16(sign | 0x7C00 | (0x200 if man else 0))
    e = exp - 127 + 15
    if e >= 31:
        return np.uint16(sign | 0x7C00)
    if e <= 0:  # subnormal fp16 (or zero)
        if e < -10:
            return np.uint16(sign)
        man |= 0x800000
        shift = 14 - e
        half = man >> shift
        rest = man & ((1 << shift) - 1)
        mid = 1 << (shift - 1)
        if rest > mid or (rest == mid and half & 1):
            half += 1
        return np.uint16(sign | half)
    half = (e << 10) | (man >> 13)
    rest = man & 0x1FFF
    if rest > 0x1000 or (rest == 0x1000 and half & 1):
        half += 1  # may carry into the exponent: still the right rounding
    return np.uint16(sign | half)


@register_jitable
def _norm_rows(x, weight, eps, out):
    """out[r] = x[r] / rms(x[r]) * weight (weight may be empty), fp64 sum as cpu_ops.rms_norm."""
    rows, n = x.shape
    for r in range(rows):
        s = 0.0
        for i in range(n):
            s += np.float64(x[r, i]) * x[r, i]
        scale = np.float32(1.0 / math.sqrt(s / n + eps))
        for i in range(n):
            out[r, i] = x[r, i] * scale * (weight[i] if weight.size else np.float32(1.0))


@register_jitable
def _rope_rows(x, pos, n_heads, dim, n_rot, base, scale, neox):
    """Rotate the first n_rot dims of each head of x [T, n_heads * dim] in place, fp64."""
    half = n_rot // 2
    for t in range(x.shape[0]):
        for i in range(half):
            theta = pos[t] * scale * base ** (-2.0 * i / n_rot)
            c, s = math.cos(theta), math.sin(theta)
            a_i, b_i = (i, i + half) if neox else (2 * i, 2 * i + 1)
            for h in range(n_heads):
                a, b = np.float64(x[t, h * dim + a_i]), np.float64(x[t, h * dim + b_i])
                x[t, h * dim + a_i] = a * c - b * s
                x[t, h * dim + b_i] = a * s + b * c


@register_jitable
def _add_bias(y, bias):
    if bias.size:
        for t in range(y.shape[0]):
            for i in range(y.shape[1]):
                y[t, i] += bias[i]


KEYS_PER_CHUNK = 64  # a thread's share of a token's cells: chunks keep every core busy
MASKED = np.float32(-3.0e38)  # a masked score: finite, since fastmath assumes no infinities


def _attention_chunks(q, kc, vc, pos, lo, hi, seq, cell_pos, cell_seq, n_head, n_kv, window,
                      attn_scale, out):  # fmt: skip
    """Attention over the cache, in fp32, for the tokens of a decode step: per (token, chunk of
    KEYS_PER_CHUNK cells of [lo, hi)) the scores of every query head, cell by cell, so the cache
    streams through in order (a head at a time over a cell's strided rows was latency-bound:
    SmolLM2 at depth 1024 spent ~25 ms a token in it, now ~8); the chunks' softmax partials are
    then merged per (token, head). A cell of another sequence, later, or out of the window is
    masked after its score, as a masked matrix product computes it (a masked cell may hold
    anything, even NaN)."""
    n_tok = q.shape[0]
    hd, hdv = kc.shape[2], vc.shape[2]
    group = n_head // n_kv
    longest = 0
    for t in range(n_tok):
        longest = max(longest, hi[t] - lo[t])
    n_chunks = max(1, -(-longest // KEYS_PER_CHUNK))
    top = np.zeros((n_tok, n_head, n_chunks), np.float32)
    mass = np.zeros((n_tok, n_head, n_chunks), np.float32)
    part = np.zeros((n_tok, n_head, n_chunks, hdv), np.float32)
    for item in prange(n_tok * n_chunks):
        t, c = item // n_chunks, item % n_chunks
        first = lo[t] + c * KEYS_PER_CHUNK
        last = min(first + KEYS_PER_CHUNK, hi[t])
        if first >= last:
            continue
        # cell by cell, every KV head of a cell (its K and V rows are contiguous in the cache)
        scores = np.empty((n_head, last - first), np.float32)
        for j in range(first, last):
            at = cell_pos[j]
            masked = cell_seq[j] != seq[t] or hidden(at, pos[t], window)
            for hh in range(n_head):
                k_row = kc[j, hh // group]
                q_row = q[t, hh * hd : (hh + 1) * hd]
                score = np.float32(0.0)
                for i in range(hd):
                    score += q_row[i] * half_bits(k_row[i])
                scores[hh, j - first] = MASKED if masked else score * attn_scale
        for hh in range(n_head):
            m = MASKED
            for j in range(last - first):
                m = max(m, scores[hh, j])
            top[t, hh, c] = m
            if m == MASKED:  # every cell of the chunk masked: its mass stays 0
                continue
            total = np.float32(0.0)
            for j in range(last - first):
                scores[hh, j] = np.exp(scores[hh, j] - m)
                total += scores[hh, j]
            mass[t, hh, c] = total
        for j in range(first, last):
            for hh in range(n_head):
                w = scores[hh, j - first]
                if w > 0:
                    v_row = vc[j, hh // group]
                    acc = part[t, hh, c]
                    for i in range(hdv):
                        acc[i] += w * half_bits(v_row[i])
    for th in range(n_tok * n_head):  # the merge: too small to pay for a parallel region
        t, hh = th // n_head, th % n_head
        m = MASKED
        for c in range(n_chunks):
            if mass[t, hh, c] > 0:
                m = max(m, top[t, hh, c])
        row = out[t, hh * hdv : (hh + 1) * hdv]
        row[:] = 0.0
        total = np.float32(0.0)
        for c in range(n_chunks):
            if mass[t, hh, c] == 0:
                continue
            f = np.exp(top[t, hh, c] - m)
            total += f * mass[t, hh, c]
            for i in range(hdv):
                row[i] += f * part[t, hh, c, i]
        for i in range(hdv):
            row[i] /= total


_attention_parallel, _attention_serial = twins(fastmath=True)(_attention_chunks)


@register_jitable
def _attention(q, kc, vc, pos, lo, hi, seq, cell_pos, cell_seq, n_head, n_kv, window, attn_scale,
               out):  # fmt: skip
    """`_attention_chunks`, serial below HOST_ATTENTION_PARALLEL_PAIRS (which the cost model
    prices)."""
    cells = 0
    for t in range(q.shape[0]):
        cells += hi[t] - lo[t]
    if cells * n_head < HOST_ATTENTION_PARALLEL_PAIRS:
        _attention_serial(q, kc, vc, pos, lo, hi, seq, cell_pos, cell_seq, n_head, n_kv, window,
                          attn_scale, out)  # fmt: skip
    else:
        _attention_parallel(q, kc, vc, pos, lo, hi, seq, cell_pos, cell_seq, n_head, n_kv, window,
                            attn_scale, out)  # fmt: skip


@register_jitable
def _gate_rows(gate, up, gelu):
    """gate = act(gate) * up (cpu_ops.gated's activation)."""
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            gate[t, i] = activation32(gate[t, i], gelu) * up[t, i]


@register_jitable
def _gate_group(gate, up, t, g, gelu):
    """`_gate_rows` for values 32 g .. 32 g + 31 of token t."""
    for i in range(32 * g, 32 * g + 32):
        gate[t, i] = activation32(gate[t, i], gelu) * up[t, i]


@register_jitable
def _add_rows(x, f):
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += f[t, i]


@lru_cache(maxsize=None)
def attention_kernel(qtypes: tuple, tokens: int | None):
    """A layer's attention half for matrices of these types (q, k, v, o): the residual x updated
    in place, and h = its FFN-normed copy (the FFN's input)."""
    rq, rk, rv, ro = (row_dots(q.name, tokens) for q in qtypes)
    (pq, bq), (pk, bk), (pv, bv), (po, bo) = (layout(q)[1:] for q in qtypes)

    @njit(parallel=True, fastmath=True)
    def attention(x, wq, wk, wv, wo, biases_q, biases_k, biases_v, attn_norm, q_norm, k_norm,
                  post_attn_norm, ffn_norm, kc, vc, pos, write, lo, hi, seq, cell_pos, cell_seq,
                  ints, floats, h):  # fmt: skip
        n_tok, d = x.shape
        n_head, n_kv, hd, hdv, n_rot, neox, window = ints[:7]
        eps, rope_base, rope_scale, attn_scale = floats
        nq, nk, nv = n_head * hd, n_kv * hd, n_kv * hdv

        # -- in: norm, Q/K/V rows together, biases, Q/K norms, RoPE, the cache write
        _norm_rows(x, attn_norm, eps, h)
        x8, xd, xs = quantize_activations(h)
        q = np.empty((n_tok, nq), np.float32)
        k = np.empty((n_tok, nk), np.float32)
        v = np.empty((n_tok, nv), np.float32)
        for r in prange(nq + nk + nv):
            if r < nq:
                rq(wq, r * (d // pq) * bq, x8, xd, xs, d // pq, q, r)
            elif r < nq + nk:
                j = r - nq
                rk(wk, j * (d // pk) * bk, x8, xd, xs, d // pk, k, j)
            else:
                j = r - nq - nk
                rv(wv, j * (d // pv) * bv, x8, xd, xs, d // pv, v, j)
        _add_bias(q, biases_q)
        _add_bias(k, biases_k)
        _add_bias(v, biases_v)
        if q_norm.size:
            q3, k3 = q.reshape(n_tok * n_head, hd), k.reshape(n_tok * n_kv, hd)
            _norm_rows(q3, q_norm, eps, q3)
            _norm_rows(k3, k_norm, eps, k3)
        _rope_rows(q, pos, n_head, hd, n_rot, rope_base, rope_scale, neox)
        _rope_rows(k, pos, n_kv, hd, n_rot, rope_base, rope_scale, neox)
        for t in range(n_tok):
            for i in range(nk):
                kc[write[t], i // hd, i % hd] = half_of(k[t, i])
            for i in range(nv):
                vc[write[t], i // hdv, i % hdv] = half_of(v[t, i])

        a = np.empty((n_tok, n_head * hdv), np.float32)
        _attention(q, kc, vc, pos, lo, hi, seq, cell_pos, cell_seq, n_head, n_kv, window,
                   attn_scale, a)  # fmt: skip

        # -- out: output rows, post-norm, residual; the FFN's norm
        a8, ad, a_s = quantize_activations(a)
        na = n_head * hdv
        f = np.empty((n_tok, d), np.float32)
        for r in prange(d):
            ro(wo, r * (na // po) * bo, a8, ad, a_s, na // po, f, r)
        if post_attn_norm.size:
            _norm_rows(f, post_attn_norm, eps, f)
        _add_rows(x, f)
        _norm_rows(x, ffn_norm, eps, h)

    return attention


@lru_cache(maxsize=None)
def ffn_kernel(qtypes: tuple, tokens: int | None):
    """A dense layer's FFN half for matrices of these types (gate, up, down): x += the FFN of h
    (post-normed where the architecture has one)."""
    rg, ru, rd = (row_dots(q.name, tokens) for q in qtypes)
    (pg, bg), (pu, bu), (pd, bd) = (layout(q)[1:] for q in qtypes)

    @njit(parallel=True, fastmath=True)
    def ffn(x, h, wg, wu, wd, post_ffw_norm, ints, floats):
        n_tok, d = x.shape
        gelu, n_ff = ints[7], ints[8]
        eps = floats[0]
        x8, xd, xs = quantize_activations(h)
        gate = np.empty((n_tok, n_ff), np.float32)
        up = np.empty((n_tok, n_ff), np.float32)
        g8 = np.empty((n_tok, n_ff), np.int8)
        gd = np.empty((n_tok, n_ff // 32), np.float32)
        gs = np.empty((n_tok, n_ff // 32), np.float32)
        # a group of 32 gate rows and the same 32 up rows a job, then their gating and the down
        # matrix's int8 activations of the group: serial after the region, those two took 24 us
        # of a qwen2-1.5B layer's ~1.1 ms
        for g in prange(n_ff // 32):
            for r in range(32 * g, 32 * g + 32):
                rg(wg, r * (d // pg) * bg, x8, xd, xs, d // pg, gate, r)
            for r in range(32 * g, 32 * g + 32):
                ru(wu, r * (d // pu) * bu, x8, xd, xs, d // pu, up, r)
            for t in range(n_tok):
                _gate_group(gate, up, t, g, gelu)
                quantize_group(gate, t, g, g8, gd, gs)
        f = np.empty((n_tok, d), np.float32)
        for r in prange(d):
            rd(wd, r * (n_ff // pd) * bd, g8, gd, gs, n_ff // pd, f, r)
        if post_ffw_norm.size:
            _norm_rows(f, post_ffw_norm, eps, f)
        _add_rows(x, f)

    return ffn


@lru_cache(maxsize=None)
def moe_ffn_kernel(qtypes: tuple):
    """A routed layer's FFN half for expert stacks of these types (gate, up, down): each (token,
    slot) through its expert, one token a row, and x += the slots' products weighted, summed in
    ascending expert id (the part-by-part path's order), post-normed where the architecture has
    one. `nbytes` [3]: an expert's bytes in each stack."""
    rg, ru, rd = (row_dots(q.name, 1) for q in qtypes)
    (pg, bg), (pu, bu), (pd, bd) = (layout(q)[1:] for q in qtypes)

    @njit(parallel=True, fastmath=True)
    def moe_ffn(x, h, ids, weights, wg, wu, wd, nbytes, post_ffw_norm, ints, floats):
        n_tok, d = x.shape
        k = ids.shape[1]
        gelu, n_ff = ints[7], ints[8]
        eps = floats[0]
        pairs = n_tok * k
        x8, xd, xs = quantize_activations(h)
        gate = np.empty((pairs, n_ff), np.float32)
        up = np.empty((pairs, n_ff), np.float32)
        for job in prange(pairs * 2 * n_ff):  # a pair's rows in order: its expert streams in
            pair, r = job // (2 * n_ff), job % (2 * n_ff)
            t, e = pair // k, ids[pair // k, pair % k]
            if r < n_ff:
                rg(wg, e * nbytes[0] + r * (d // pg) * bg, x8[t : t + 1], xd[t : t + 1],
                   xs[t : t + 1], d // pg, gate[pair : pair + 1], r)  # fmt: skip
            else:
                j = r - n_ff
                ru(wu, e * nbytes[1] + j * (d // pu) * bu, x8[t : t + 1], xd[t : t + 1],
                   xs[t : t + 1], d // pu, up[pair : pair + 1], j)  # fmt: skip
        _gate_rows(gate, up, gelu)
        g8, gd, gs = quantize_activations(gate)
        down = np.empty((pairs, d), np.float32)
        for job in prange(pairs * d):
            pair, r = job // d, job % d
            e = ids[pair // k, pair % k]
            rd(wd, e * nbytes[2] + r * (n_ff // pd) * bd, g8[pair : pair + 1],
               gd[pair : pair + 1], gs[pair : pair + 1], n_ff // pd, down[pair : pair + 1], r)  # fmt: skip
        f = np.zeros((n_tok, d), np.float32)
        for t in range(n_tok):
            for s in np.argsort(ids[t]):
                w = weights[t, s]
                for i in range(d):
                    f[t, i] += w * down[t * k + s, i]
        if post_ffw_norm.size:
            _norm_rows(f, post_ffw_norm, eps, f)
        _add_rows(x, f)

    return moe_ffn


@lru_cache(maxsize=None)
def layer_kernel(qtypes: tuple, tokens: int | None):
    """The dense layer function for matrices of these types (q, k, v, o, gate, up, down), for
    `tokens` tokens or (None) any count (`cpu.token_key`): its two halves in one call."""
    attention, ffn = attention_kernel(qtypes[:4], tokens), ffn_kernel(qtypes[4:], tokens)

    @njit
    def layer(x, wq, wk, wv, wo, biases_q, biases_k, biases_v, attn_norm, q_norm, k_norm,
              post_attn_norm, ffn_norm, kc, vc, pos, write, lo, hi, seq, cell_pos, cell_seq, ints,
              floats, wg, wu, wd, post_ffw_norm):  # fmt: skip
        h = np.empty_like(x)
        attention(x, wq, wk, wv, wo, biases_q, biases_k, biases_v, attn_norm, q_norm, k_norm,
                  post_attn_norm, ffn_norm, kc, vc, pos, write, lo, hi, seq, cell_pos, cell_seq,
                  ints, floats, h)  # fmt: skip
        ffn(x, h, wg, wu, wd, post_ffw_norm, ints, floats)

    return layer
