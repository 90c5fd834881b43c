"""The prompt's int8 products (`q8_panel`, `q8_gemm`) against the reference on fresh random weights
and activations, outputs poisoned with NaN: the repacked tiles hold the weight exactly, and the
products are the q8 rows' (the same int8 activations, the same exact integer sums)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cudarun.kernels import cpu, q8_gemm, q8_panel, simd
from refengine.quants import dequantize
from refengine.reference import matmul_q

from .kernels_common import cols, normwise, weights

TYPES = sorted(q8_panel.INTS, key=lambda t: t.name)


def unpacked(panel: q8_panel.Panel) -> np.ndarray:
    """The tiles read back as the [n_rows, n_cols] values d * q + m, per the panel's layout."""
    g, rows = panel.group, q8_gemm.ROWS
    n_tiles, n_groups = panel.n_rows // rows, panel.n_cols // g
    q = panel.q.reshape(n_tiles, n_groups, g // 4, rows, 4).transpose(0, 3, 1, 2, 4)
    q = q.reshape(n_tiles, rows, n_groups, g).astype(np.float32)
    d, m = (a.reshape(n_tiles, n_groups, rows).transpose(0, 2, 1)[..., None]
            for a in (panel.d, panel.m))
    return (d * q + m).reshape(panel.n_rows, panel.n_cols)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_tiles_hold_the_weight_and_its_sums(qtype):
    rng = np.random.default_rng(700 + int(qtype))
    n_rows, n_cols = 32, cols(qtype, 512)
    raw = weights(rng, qtype, n_rows, n_cols)
    panel = q8_panel.repack(raw, qtype, (n_rows, n_cols))
    want = dequantize(raw, qtype, (n_rows, n_cols)).reshape(n_rows, n_cols)
    np.testing.assert_array_equal(unpacked(panel), want)
    sums = panel.q.reshape(-1, panel.group // 4, q8_gemm.ROWS, 4).sum(axis=(1, 3), dtype=np.int32)
    np.testing.assert_array_equal(panel.c.reshape(sums.shape), -128 * sums)
    assert panel.q.ctypes.data % 64 == 0


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [8, 13])
def test_products_are_the_q8_rows_to_rounding(qtype, tokens):
    """13 tokens pad the second micro-kernel call with three zero tokens (never stored)."""
    rng = np.random.default_rng(800 + int(qtype) + tokens)
    n_rows, n_cols = 48, cols(qtype, 512)
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((tokens, n_cols)).astype(np.float32)
    q8 = cpu.quantize_activations(x)
    out = np.full((tokens, n_rows), np.nan, np.float32)
    q8_gemm.product(q8_panel.repack(raw, qtype, (n_rows, n_cols)), q8, out)
    rows = np.full((tokens, n_rows), np.nan, np.float32)
    cpu.q8_matvec(raw, q8, qtype, (n_rows, n_cols), rows)
    assert normwise(out, rows) < 1e-5
    assert normwise(out, matmul_q(x, raw, qtype, (n_rows, n_cols))) < 1e-2


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q6_K, Q.Q8_0], ids=lambda t: t.name)
def test_every_micro_kernel_the_host_runs_equals_the_generic_ir(qtype):
    """The three micro-kernels (`q8_gemm.ISA`: 512-bit vpdpbusd, AVX2's half tiles with their
    16-bit pair sums, generic IR for any host) give the same products, each over fresh random
    weights whose q span the type's range (an AVX2 pair sum that saturated would differ): two
    16-bit pair sums added (Q4_K), at |q| = 32 (Q6_K), the sign form (Q8_0)."""
    rng = np.random.default_rng(900 + int(qtype))
    n_rows, n_cols, tokens = 32, cols(qtype, 256), 8
    panel = q8_panel.repack(weights(rng, qtype, n_rows, n_cols), qtype, (n_rows, n_cols))
    assert np.abs(panel.q.astype(np.int32)).max() >= panel.q_bound - 1  # the range is reached
    x8, xd, xs = cpu.quantize_activations(rng.standard_normal((tokens, n_cols)).astype(np.float32))
    isas = ["generic", *(["avx2"] if simd.AVX2 else []), *(["vnni512"] if q8_gemm.VNNI512 else [])]
    outs = []
    for isa in isas:
        signed = q8_gemm.signed_activations(isa, panel.q_bound)
        x = x8.view(np.uint8) if signed else x8.view(np.uint8) ^ np.uint8(128)
        out = np.full(tokens * n_rows, np.nan, np.float32)
        q8_gemm.gemm_kernel(panel.group, panel.has_min, panel.q_bound, isa)(
            panel.q, panel.d, panel.m, panel.c, np.ascontiguousarray(x).reshape(-1),
            xd.reshape(-1), xs.reshape(-1), out, n_rows // q8_gemm.ROWS, n_cols // panel.group,
            n_cols, n_rows)  # fmt: skip
        outs.append(out)
    assert not np.isnan(outs[0]).any()
    for out in outs[1:]:  # the integer sums are equal; the fp32 scaling may contract differently
        assert normwise(out, outs[0]) < 1e-6


def test_matmul_takes_the_tiles_for_a_prompt_of_whole_tiles():
    rng = np.random.default_rng(950)
    raw = weights(rng, Q.Q4_K, 64, 512)
    x = rng.standard_normal((cpu.BLAS_TOKENS + 3, 512)).astype(np.float32)
    assert cpu.path(Q.Q4_K, x.shape[0], (64, 512)) == "q8gemm"
    assert cpu.path(Q.Q4_K, x.shape[0], (72, 512)) == "blas"  # not whole tiles
    assert cpu.path(Q.Q4_K, 1, (64, 512)) == "q8"
    got = cpu.matmul(raw, x, Q.Q4_K, (64, 512), threads=2)
    assert normwise(got, matmul_q(x, raw, Q.Q4_K, (64, 512))) < 1e-2
    exact = cpu.matmul(raw, x, Q.Q4_K, (64, 512), exact=True)
    assert normwise(exact, matmul_q(x, raw, Q.Q4_K, (64, 512))) < 1e-5


def test_the_profiles_prompt_rate_times_the_kept_tiles_products(monkeypatch):
    """`bench_cpu.matmul_rate` on a type that repacks times the products a prompt's ubatch runs
    on tiles repacked once before the timing (the engine keeps them), not a repack per product,
    which priced a prompt at a fraction of its speed; the activations are quantized before it too
    (a profile prices that per value, apart)."""
    from cudarun import bench_cpu

    calls, product = [], q8_gemm.product
    for module, name in ((q8_panel, "repack"), (cpu, "quantize_activations")):
        monkeypatch.setattr(module, name, lambda *a, f=getattr(module, name), n=name: (
            calls.append(n) or f(*a)))  # fmt: skip
    monkeypatch.setattr(q8_gemm, "product", lambda *a: calls.append("product") or product(*a))
    r = bench_cpu.matmul_rate("Q4_K", (32, 256), 16, threads=1, runs=2, rotate_nbytes=1)
    assert r.path == "q8gemm" and r.seconds > 0
    # two weights and two inputs rotate: prepared, then 1 warm-up and 2 runs x 2 products
    assert calls == ["repack"] * 2 + ["quantize_activations"] * 2 + ["product"] * 5
