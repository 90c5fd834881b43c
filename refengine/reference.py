"""The public reference operations: plain NumPy, fp32 storage with fp64 where it is cheap.

Every GPU and CPU kernel of the project is tested against these functions (docs/contracts.md), and
the NumPy engine is built from them. Shapes use T = tokens, S = key/value positions, H = query
heads, Hkv = key/value heads, D = head size, d = model width. Semantics are llama.cpp's.
"""

from __future__ import annotations

import numpy as np

from .quants import dequantize


def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """[..., n] -> [..., n]: x / sqrt(mean(x^2) + eps) * weight, over the last axis."""
    x64 = x.astype(np.float64)
    y = x64 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    if weight is not None:
        y = y * weight
    return y.astype(np.float32)


def rope_angles(positions: np.ndarray, n_rot: int, base: float, scale: float = 1.0) -> np.ndarray:
    """[T] -> [T, n_rot/2]: theta_i = pos * scale * base^(-2i/n_rot)."""
    inv_freq = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    return (np.asarray(positions, dtype=np.float64) * scale)[:, None] * inv_freq[None, :]


def rope(
    x: np.ndarray, positions: np.ndarray, n_rot: int, base: float, style: str, scale: float = 1.0
) -> np.ndarray:
    """[T, H, D] -> [T, H, D]: rotate the first n_rot dims of each head by position.

    style "norm" rotates adjacent pairs (2i, 2i+1); "neox" rotates (i, i + n_rot/2).
    Dims past n_rot pass through.
    """
    theta = rope_angles(positions, n_rot, base, scale)[:, None, :]  # [T, 1, n_rot/2]
    cos, sin = np.cos(theta), np.sin(theta)
    out = x.astype(np.float64, copy=True)
    if style == "norm":
        a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = a * cos - b * sin
        out[..., 1:n_rot:2] = a * sin + b * cos
    elif style == "neox":
        half = n_rot // 2
        a, b = x[..., :half], x[..., half:n_rot]
        out[..., :half] = a * cos - b * sin
        out[..., half:n_rot] = a * sin + b * cos
    else:
        raise ValueError(f"unknown RoPE style {style!r}")
    return out.astype(np.float32)


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    x64 = x.astype(np.float64)
    e = np.exp(x64 - np.max(x64, axis=axis, keepdims=True))
    return (e / np.sum(e, axis=axis, keepdims=True)).astype(np.float32)


def attention_mask(q_pos: np.ndarray, k_pos: np.ndarray, window: int = 0) -> np.ndarray:
    """[T, S] bool, True where query at q_pos may attend key at k_pos.

    Causal: k_pos <= q_pos. With a sliding window (llama.cpp's standard SWA), also
    q_pos - k_pos < window: each query sees itself and the window-1 positions before it.
    """
    q = np.asarray(q_pos)[:, None]
    k = np.asarray(k_pos)[None, :]
    ok = k <= q
    if window:
        ok &= (q - k) < window
    return ok


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_pos: np.ndarray,
    k_pos: np.ndarray,
    scale: float,
    window: int = 0,
) -> np.ndarray:
    """Causal (optionally sliding-window) multi-head attention with grouped K/V heads.

    q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, H, Dv]; query head h reads K/V head
    h // (H / Hkv).
    """
    n_head, n_kv = q.shape[1], k.shape[1]
    group = n_head // n_kv
    mask = attention_mask(q_pos, k_pos, window)  # [T, S]
    qg = q.reshape(q.shape[0], n_kv, group, q.shape[2]).astype(np.float32)
    # scores [Hkv, group, T, S]
    scores = np.einsum("tkgd,skd->kgts", qg, k.astype(np.float32), optimize=True) * scale
    scores = np.where(mask[None, None], scores, -np.inf)
    probs = softmax(scores, axis=-1)
    out = np.einsum("kgts,skd->tkgd", probs, v.astype(np.float32), optimize=True)
    return out.reshape(q.shape[0], n_head, v.shape[2])


def silu(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / (1.0 + np.exp(-x64))).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, tanh approximation (ggml_gelu)."""
    x64 = x.astype(np.float64)
    c = np.sqrt(2.0 / np.pi)
    return (0.5 * x64 * (1.0 + np.tanh(c * (x64 + 0.044715 * x64**3)))).astype(np.float32)


ACTIVATIONS = {"silu": silu, "gelu": gelu}


def gated(act: str, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """act(gate) * up — SiLU (SwiGLU) or GELU (GeGLU) gating."""
    return ACTIVATIONS[act](gate) * up


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T, n_in] times a weight w [n_out, n_in] -> [T, n_out], fp32."""
    return np.matmul(x.astype(np.float32, copy=False), w.T)


def matmul_q(x: np.ndarray, raw: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    """x [T, n_in] times a GGUF tensor of `shape` (n_out, n_in) given as raw bytes of `qtype`."""
    return matmul(x, dequantize(raw, qtype, shape))


def get_rows(raw: np.ndarray, qtype, shape: tuple[int, int], ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of a quantized [n_rows, n] table (embedding lookup) -> [len(ids), n] float32."""
    raw2 = np.asarray(raw).reshape(shape[0], -1)
    return dequantize(raw2[np.asarray(ids)], qtype, (len(ids), shape[1]))


def moe_route(
    router_logits: np.ndarray, n_used: int, normalize: bool
) -> tuple[np.ndarray, np.ndarray]:
    """[T, E] router logits -> (expert ids [T, k], weights [T, k]).

    Softmax over all experts, the k most probable kept (ties: lower id first), and, when
    `normalize`, their weights rescaled to sum to 1.
    """
    probs = softmax(router_logits, axis=-1).astype(np.float64)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :n_used]
    w = np.take_along_axis(probs, ids, axis=-1)
    if normalize:
        w = w / np.sum(w, axis=-1, keepdims=True)
    return ids, w.astype(np.float32)


def moe_ffn(
    x: np.ndarray,
    ids: np.ndarray,
    weights: np.ndarray,
    gate_exps: np.ndarray,
    up_exps: np.ndarray,
    down_exps: np.ndarray,
    act: str,
) -> np.ndarray:
    """Mix of the selected experts' gated FFNs.

    x [T, d]; ids, weights [T, k]; gate/up [E, n_ff, d]; down [E, d, n_ff] -> [T, d].
    """
    out = np.zeros((x.shape[0], down_exps.shape[1]), dtype=np.float32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        xe = x[rows]
        h = gated(act, matmul(xe, gate_exps[e]), matmul(xe, up_exps[e]))
        out[rows] += weights[rows, slot][:, None] * matmul(h, down_exps[e])
    return out
