"""The reference operations against direct, loop-by-loop restatements of their definitions."""

import math

import numpy as np
import pytest

from refengine import reference as ref


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def test_rms_norm(rng):
    x = rng.normal(size=(3, 16)).astype(np.float32)
    w = rng.normal(size=16).astype(np.float32)
    for i in range(3):
        expect = x[i] / math.sqrt(np.mean(x[i].astype(np.float64) ** 2) + 1e-6) * w
        np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6)[i], expect, rtol=1e-5)


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_rotates_pairs_by_position(rng, style):
    T, H, D, n_rot, base = 5, 2, 16, 12, 10000.0
    x = rng.normal(size=(T, H, D)).astype(np.float32)
    pos = np.array([0, 1, 7, 100, 4095])
    y = ref.rope(x, pos, n_rot, base, style, scale=0.5)
    for t in range(T):
        for i in range(n_rot // 2):
            theta = pos[t] * 0.5 * base ** (-2 * i / n_rot)
            a, b = (2 * i, 2 * i + 1) if style == "norm" else (i, i + n_rot // 2)
            c, s = math.cos(theta), math.sin(theta)
            np.testing.assert_allclose(y[t, :, a], x[t, :, a] * c - x[t, :, b] * s, atol=1e-5)
            np.testing.assert_allclose(y[t, :, b], x[t, :, a] * s + x[t, :, b] * c, atol=1e-5)
    np.testing.assert_array_equal(y[:, :, n_rot:], x[:, :, n_rot:])  # past n_rot: untouched
    np.testing.assert_allclose(y[0], x[0], atol=1e-7)  # position 0: identity


def test_attention_mask_is_causal_with_standard_sliding_window():
    m = ref.attention_mask(np.arange(6), np.arange(6), window=3)
    for q in range(6):
        for k in range(6):
            assert m[q, k] == (k <= q and q - k < 3)


@pytest.mark.parametrize("window", [0, 3])
def test_attention_with_grouped_heads_matches_loops(rng, window):
    T, S, H, Hkv, D = 4, 9, 6, 2, 8
    q = rng.normal(size=(T, H, D)).astype(np.float32)
    k = rng.normal(size=(S, Hkv, D)).astype(np.float32)
    v = rng.normal(size=(S, Hkv, D + 2)).astype(np.float32)
    q_pos, k_pos = np.arange(S - T, S), np.arange(S)
    out = ref.attention(q, k, v, q_pos, k_pos, scale=0.3, window=window)
    for t in range(T):
        for h in range(H):
            kv = h // (H // Hkv)
            keys = [s for s in range(S) if s <= q_pos[t] and (not window or q_pos[t] - s < window)]
            sc = np.array([0.3 * q[t, h] @ k[s, kv] for s in keys], dtype=np.float64)
            p = np.exp(sc - sc.max())
            p /= p.sum()
            np.testing.assert_allclose(
                out[t, h], sum(pi * v[s, kv] for pi, s in zip(p, keys)), rtol=1e-4, atol=1e-5
            )


def test_activations():
    np.testing.assert_allclose(
        ref.silu(np.array([0.0, 1.0, -2.0])),
        [0.0, 1 / (1 + math.exp(-1)), -2 / (1 + math.exp(2))],
        rtol=1e-6,
    )
    # tanh-approximate GELU, as ggml_gelu
    x = np.array([-3.0, -0.5, 0.0, 1.0, 2.5])
    expect = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(ref.gelu(x), expect, rtol=1e-6)
    g, u = np.array([1.0, 2.0]), np.array([3.0, -1.0])
    np.testing.assert_allclose(ref.gated("silu", g, u), ref.silu(g) * u)


def test_moe_route_softmax_topk_renormalized(rng):
    logits = rng.normal(size=(5, 8)).astype(np.float32)
    ids, w = ref.moe_route(logits, 2, normalize=True)
    for t in range(5):
        p = np.exp(logits[t] - logits[t].max())
        p /= p.sum()
        top = np.argsort(-p)[:2]
        np.testing.assert_array_equal(ids[t], top)
        np.testing.assert_allclose(w[t], p[top] / p[top].sum(), rtol=1e-5)
    _, w_raw = ref.moe_route(logits, 2, normalize=False)
    assert np.all(w_raw.sum(-1) < 1.0)


def test_moe_ffn_mixes_only_selected_experts(rng):
    T, d, f, E = 3, 8, 16, 4
    x = rng.normal(size=(T, d)).astype(np.float32)
    gate, up = (
        rng.normal(size=(E, f, d)).astype(np.float32),
        rng.normal(size=(E, f, d)).astype(np.float32),
    )
    down = rng.normal(size=(E, d, f)).astype(np.float32)
    ids = np.array([[0, 2], [3, 1], [2, 0]])
    w = np.array([[0.7, 0.3], [0.5, 0.5], [0.9, 0.1]], dtype=np.float32)
    out = ref.moe_ffn(x, ids, w, gate, up, down, "silu")
    for t in range(T):
        expect = sum(
            w[t, j] * down[e] @ (ref.silu(gate[e] @ x[t]) * (up[e] @ x[t]))
            for j, e in enumerate(ids[t])
        )
        np.testing.assert_allclose(out[t], expect, rtol=1e-4, atol=1e-5)


def test_matmul_q_and_get_rows_read_quantized_tensors(rng):
    from refengine.quants import Q, dequantize, quantize

    w = rng.normal(size=(16, 64)).astype(np.float32)
    raw = quantize(w, Q.Q4_0)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    wd = dequantize(raw, Q.Q4_0, (16, 64))
    np.testing.assert_allclose(ref.matmul_q(x, raw, Q.Q4_0, (16, 64)), x @ wd.T, rtol=1e-5)
    np.testing.assert_array_equal(
        ref.get_rows(raw, Q.Q4_0, (16, 64), np.array([3, 0, 3])), wd[[3, 0, 3]]
    )
