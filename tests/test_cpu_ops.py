"""The CPU layer ops against the reference on fresh random inputs (fp32 tolerance 1e-3)."""

import numpy as np
import pytest

from cudarun.kernels import cpu_ops
from refengine import reference as ref

from .kernels_common import normwise

RNG = np.random.default_rng(30)


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(with_weight):
    x = RNG.standard_normal((5, 96)).astype(np.float32) * 3
    w = RNG.standard_normal(96).astype(np.float32)
    got = cpu_ops.rms_norm(x, w if with_weight else np.empty(0, np.float32), 1e-6)
    assert normwise(got, ref.rms_norm(x, w if with_weight else None, 1e-6)) < 1e-5


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_with_pass_through_dims(style):
    x = RNG.standard_normal((3, 4, 32)).astype(np.float32)
    pos = np.array([0, 7, 4095], np.int64)
    got = cpu_ops.rope(x, pos, 24, 1e6, 0.5, style == "neox")
    assert normwise(got, ref.rope(x, pos, 24, 1e6, style, 0.5)) < 1e-5


@pytest.mark.parametrize("tokens,window", [(1, 0), (6, 0), (6, 5)])
def test_attention_grouped_heads_f16_cache(tokens, window):
    q = RNG.standard_normal((tokens, 8, 32)).astype(np.float32)
    k = RNG.standard_normal((40, 2, 32)).astype(np.float16)
    v = RNG.standard_normal((40, 2, 32)).astype(np.float16)
    k_pos = np.arange(40, dtype=np.int64)
    q_pos = np.arange(40 - tokens, 40, dtype=np.int64)
    got = cpu_ops.attention(q, k, v, q_pos, k_pos, 0.2, window)
    assert normwise(got, ref.attention(q, k, v, q_pos, k_pos, 0.2, window)) < 1e-3


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gated(act):
    g, u = (RNG.standard_normal((3, 70)).astype(np.float32) * 4 for _ in range(2))
    assert normwise(cpu_ops.gated(g, u, act == "gelu"), ref.gated(act, g, u)) < 1e-5
    # past exp32's clamps: the activation's limits, 0 and g itself
    far = np.array([[-200.0, -90.0, -60.0, 60.0, 90.0, 200.0]], np.float32)
    np.testing.assert_allclose(cpu_ops.gated(far, np.ones_like(far), act == "gelu"),
                               np.maximum(far, 0), rtol=1e-6, atol=1e-20)  # fmt: skip


def test_softmax():
    x = RNG.standard_normal((2, 500)).astype(np.float32) * 10
    assert normwise(cpu_ops.softmax(x), ref.softmax(x)) < 1e-5


@pytest.mark.parametrize("normalize", [True, False])
def test_route_chooses_and_weighs_the_experts_as_the_reference(normalize):
    logits = RNG.standard_normal((37, 64)).astype(np.float32) * 3
    logits[0] = 0.5  # every expert tied: the lowest ids
    logits[1, [9, 40]] = 20.0  # two tied first: the lower id first
    ids, weights = cpu_ops.route(logits, 6, normalize)
    want_ids, want_weights = ref.moe_route(logits, 6, normalize)
    assert np.array_equal(ids, want_ids) and list(ids[1, :2]) == [9, 40]
    assert np.allclose(weights, want_weights, rtol=1e-6, atol=0)


def test_gated_sum_adds_the_experts_as_the_reference_does():
    """Bit for bit: fp32 products, added per token in increasing expert id (ref.moe_ffn's order)."""
    tokens, k, n = 37, 6, 70
    down = RNG.standard_normal((tokens, k, n)).astype(np.float32)
    gates = RNG.random((tokens, k)).astype(np.float32)
    ids = np.stack([RNG.choice(16, k, replace=False) for _ in range(tokens)])
    want = np.zeros((tokens, n), np.float32)
    for e in np.unique(ids):
        rows, slot = np.nonzero(ids == e)
        want[rows] += gates[rows, slot][:, None] * down[rows, slot]
    assert np.array_equal(cpu_ops.gated_sum(down, gates, ids), want)


def test_rows_taken_and_put_are_numpys():
    from cudarun.kernels import cpu

    src = RNG.standard_normal((50, 33)).astype(np.float32)
    rows = RNG.permutation(50)[:37]
    assert np.array_equal(cpu.take_rows(src, rows), src[rows])
    out, want = np.full((50, 33), np.nan, np.float32), np.full((50, 33), np.nan, np.float32)
    cpu.put_rows(out, rows, src[:37])
    want[rows] = src[:37]
    assert np.array_equal(out, want, equal_nan=True)
