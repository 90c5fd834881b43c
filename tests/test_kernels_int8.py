"""The int8 decode products (cudarun.kernels.int8) against the reference on fresh random inputs,
outputs poisoned with NaN: the integer arithmetic exactly (the reference product of the same
quantized activations, within fp32 rounding), and the path's error against fp32 activations.
Without a GPU they run on the Numba simulator at tiny shapes."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cudarun.kernels import cpu, int8
from cudarun.kernels.matvec import matvec_gpu
from refengine.reference import gated, matmul_q

from .kernels_common import normwise, poisoned, quantize_host, weights

TYPES = sorted(int8.UNITS, key=lambda t: t.name)


def dequantized(x):
    """The values the int8 activations stand for: d * q per group of 32."""
    xq, xds = quantize_host(x)
    q = xq.view(np.int8).astype(np.float32).reshape(x.shape[0], -1, int8.GROUP)
    d = xds.view(np.float32).reshape(x.shape[0], -1, 2)[:, :, :1]
    return (q * d).reshape(x.shape)


def activations(x, n_tokens=None):
    """x quantized on the device, in buffers of the words a product of n_tokens reads."""
    from numba import cuda

    words, groups = int8.activation_words(n_tokens or x.shape[0], x.shape[1])
    xq, xds = (cuda.to_device(np.zeros(n, np.uint64)) for n in (words, groups))
    int8.quantize_gpu(cuda.to_device(x), xq, xds)
    return xq, xds


def test_activations_quantized_as_the_cpu_quantizes_them():
    """The device's int8 values, scales and sums are the host reference's, which are the cpu
    engine's (kernels.cpu.quantize_activations); an all-zero group gets d = 0."""
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((3, 96)) * rng.uniform(0.1, 8, (3, 96))).astype(np.float32)
    x[1, 32:64] = 0.0
    xq, xds = activations(x)
    want_q, want_ds = quantize_host(x)
    np.testing.assert_array_equal(xq.copy_to_host()[: want_q.size], want_q)
    np.testing.assert_allclose(xds.copy_to_host()[: want_ds.size].view(np.float32),
                               want_ds.view(np.float32), rtol=1e-6)  # fmt: skip
    x8, xd, xs = cpu.quantize_activations(x)
    np.testing.assert_array_equal(want_q.view(np.int8).reshape(x.shape), x8)
    ds = want_ds.view(np.float32).reshape(3, -1, 2)
    np.testing.assert_allclose(ds[:, :, 0], xd, rtol=1e-6)
    np.testing.assert_allclose(ds[:, :, 1], xs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 6, 11])
def test_int8_matvec(qtype, tokens):
    """1 token, 3 (the 4-token pass), 6 (an 8-token pass) and 11 (two): each row's integer dot
    products equal the reference's over the same quantized activations; five rows leave the
    second thread block's last warps without a row (they must store nothing)."""
    rng = np.random.default_rng(300 + int(qtype) + tokens)
    n_rows, n_cols = 5, max(64, int8.UNITS[qtype].values)
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((tokens, n_cols)).astype(np.float32)
    out = poisoned((tokens, n_rows))
    int8.matvec_gpu(_device(raw), *activations(x), out, qtype, (n_rows, n_cols))
    got = out.copy_to_host()
    assert normwise(got, matmul_q(dequantized(x), raw, qtype, (n_rows, n_cols))) < 1e-5
    assert normwise(got, matmul_q(x, raw, qtype, (n_rows, n_cols))) < 3e-2


@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("path", ["fp32", "int8"])
def test_matvec_epilogue_adds_the_bias_and_gates(path, act):
    """The up product's epilogue on either decode path: out = x W^T + bias and act(gate) * out,
    both written; the int8 path's x is its quantized activations."""
    from numba import cuda

    rng = np.random.default_rng(41)
    qtype, n_rows, n_cols, tokens = Q.Q4_K, 6, 256, 5
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((tokens, n_cols)).astype(np.float32)
    bias = rng.standard_normal(n_rows).astype(np.float32)
    gate = rng.standard_normal((tokens, n_rows)).astype(np.float32)
    out, act_out = poisoned((tokens, n_rows)), poisoned((tokens, n_rows))
    epilogue = dict(bias=cuda.to_device(bias), gated=(cuda.to_device(gate), act_out, act == "gelu"))
    if path == "int8":
        int8.matvec_gpu(_device(raw), *activations(x), out, qtype, (n_rows, n_cols), **epilogue)
        x, bound = dequantized(x), 1e-5
    else:
        matvec_gpu(_device(raw), cuda.to_device(x), out, qtype, (n_rows, n_cols), **epilogue)
        bound = 1e-3
    want = matmul_q(x, raw, qtype, (n_rows, n_cols)) + bias
    assert normwise(out.copy_to_host(), want) < bound
    assert normwise(act_out.copy_to_host(), gated(act, gate, want)) < bound


def _device(raw):
    from numba import cuda

    return cuda.to_device(raw)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q5_1, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("per_slot", [False, True], ids=["token_input", "slot_input"])
def test_int8_expert_matvec_takes_each_slots_expert_from_the_cache_or_the_copy(qtype, per_slot):
    """Places below n_cached are the cache's experts, the others the routed copy's; each slot's
    row product equals the reference's over the same quantized activations (of the slot's own row
    for the down product, else of its token's)."""
    from numba import cuda

    rng = np.random.default_rng(500 + int(qtype) + per_slot)
    n_tokens, k, rows, n_cols = 2, 2, 3, max(64, int8.UNITS[qtype].values)
    experts = [weights(rng, qtype, rows, n_cols) for _ in range(4)]
    cache, copy = experts[3], np.concatenate(experts[:3])  # places: 0 -> E3, 1 + e -> E<e>
    places = np.array([[1, 0], [3, 2]], np.int32)
    which = [3 if p == 0 else p - 1 for p in places.ravel()]
    x = rng.standard_normal((n_tokens * k if per_slot else n_tokens, n_cols)).astype(np.float32)
    out = poisoned((n_tokens * k, rows))
    int8.expert_matvec_gpu(_device(copy), *activations(x), cuda.to_device(places), out, qtype,
                           (rows, n_cols), per_slot, cache=_device(cache), n_cached=1)  # fmt: skip
    xdq = dequantized(x)
    want = np.stack([
        matmul_q(xdq[s if per_slot else s // k][None], experts[e], qtype, (rows, n_cols))[0]
        for s, e in enumerate(which)
    ])  # fmt: skip
    assert normwise(out.copy_to_host(), want) < 1e-5


def test_the_device_maths_decode_products_run_in_integers():
    """DeviceMath at decode (cudarun.devicemath) on the simulator: Q, K and V in one launch from
    one quantization of h, and the up product reading the input the gate product quantized (its
    epilogue gating), each equal to the reference over the same quantized activations; Q5_1
    matrices (32-bit words) after the F32 norms."""
    from numba import cuda

    from cudarun.devicemath import DeviceMath
    from refengine.synthetic import SyntheticConfig, spec_from_hparams
    from solver.workspace import arrays, layout, nbytes

    spec = spec_from_hparams(SyntheticConfig("llama", n_layer=1, n_embd=64, n_ff=64, n_head=2,
                                             n_head_kv=1, n_vocab=260, qtype="Q5_1"))  # fmt: skip
    rng = np.random.default_rng(61)
    n = 3
    names = [f"blk.0.{m}.weight" for m in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up")]
    raws = {m: weights(rng, spec.by_name[m].qtype, *spec.by_name[m].shape) for m in names}
    assert {spec.by_name[m].qtype for m in names} == {Q.Q5_1}
    w = {m: _device(r) for m, r in raws.items()}
    w["blk.0.attn_norm.weight"] = cuda.to_device(np.ones(64, np.float32))
    slices = layout(spec, 4, 1, 16)
    ws = arrays(cuda.to_device(np.zeros(nbytes(slices), np.uint8)), slices)
    x = rng.standard_normal((n, 64)).astype(np.float32)
    math = DeviceMath(spec)
    math.glu_layers = frozenset({0})
    ws["x"][:n].copy_to_device(x)
    math.rope_qk = lambda *a: None  # the products alone
    math.qkv(ws, n, w, 0, 0)
    h = ws["h"][:n].copy_to_host()
    hq = dequantized(h)
    for m, out in zip(names[:3], ("q", "k", "v")):
        want = matmul_q(hq, raws[m], Q.Q5_1, spec.by_name[m].shape)
        assert normwise(ws[out][:n].copy_to_host().reshape(n, -1), want) < 1e-5, m
    ws["h"][:n].copy_to_device(x)
    math.ffn_gate(ws, n, w, 0, 0)
    math.ffn_up(ws, n, w, 0, 0)
    xq = dequantized(x)
    gate, up = (matmul_q(xq, raws[m], Q.Q5_1, spec.by_name[m].shape) for m in names[3:])
    assert normwise(ws["up"][:n].copy_to_host(), up) < 1e-5
    assert normwise(ws["act"][:n].copy_to_host(), gated("silu", gate, up)) < 1e-5


def test_the_solver_counts_a_quantize_launch_for_exactly_the_int8_types():
    """solver.workspace.INT8_TYPES (launch counts, the workspace) names the types the kernels
    multiply in integers."""
    from solver.workspace import INT8_TYPES

    assert {q.name for q in int8.UNITS} == INT8_TYPES
