"""Kernels against the reference operations on fresh random inputs, outputs poisoned with NaN so
an unwritten element fails (docs/contracts.md tolerances: normwise max|a-b|/max|b| < 1e-3 in fp32).
Without a GPU the CUDA kernels run on the Numba simulator at tiny shapes; `gpu` tests run the
driver layer and real shapes on a GPU."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cudarun import driver
from cudarun.blocks import layout
from cudarun.kernels import cpu
from cudarun.kernels.matvec import matvec_gpu
from refengine.errors import UserError
from refengine.reference import matmul_q

from .conftest import GPU

from .kernels_common import TYPES, cols, normwise, poisoned, weights


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_block_decoders_match_ggml_dequantization(qtype):
    from refengine.quants import dequantize

    rng = np.random.default_rng(int(qtype))
    decode, per_block, nbytes = layout(qtype)
    n = cols(qtype, 64)
    raw = weights(rng, qtype, 2, n)
    got = np.full(2 * n, np.nan, np.float32)
    for b in range(2 * n // per_block):
        decode(raw, b * nbytes, got[b * per_block : (b + 1) * per_block])
    np.testing.assert_array_equal(got, dequantize(raw, qtype, (2, n)).reshape(-1))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, 6])
def test_gpu_matvec(qtype, tokens):
    """Six tokens take two passes over each row; five rows leave the second thread block's last
    warps without a row (they must store nothing)."""
    from numba import cuda

    rng = np.random.default_rng(100 + int(qtype) + tokens)
    n_rows, n_cols = 5, cols(qtype, 64)
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((tokens, n_cols)).astype(np.float32)
    out = cuda.to_device(np.full((tokens, n_rows), np.nan, np.float32))
    matvec_gpu(cuda.to_device(raw), cuda.to_device(x), out, qtype, (n_rows, n_cols))
    assert normwise(out.copy_to_host(), matmul_q(x, raw, qtype, (n_rows, n_cols))) < 1e-3


def test_gpu_matvec3_makes_q_k_and_v_of_three_types_in_one_launch():
    """Three weights of different types and heights (a Q4_K_M file's Q4_K Q and K and Q6_K V),
    only some of them biased; each output row written once (poisoned before)."""
    from numba import cuda

    from cudarun.kernels.matvec import matvec3_gpu

    rng = np.random.default_rng(32)
    n_cols, tokens = 256, 2
    qtypes, heights = (Q.Q4_K, Q.Q8_0, Q.Q6_K), (8, 5, 3)
    raws = [weights(rng, q, h, n_cols) for q, h in zip(qtypes, heights)]
    biases = [rng.standard_normal(8).astype(np.float32), None, rng.standard_normal(3).astype(np.float32)]
    x = rng.standard_normal((tokens, n_cols)).astype(np.float32)
    outs = [poisoned((tokens, h)) for h in heights]
    matvec3_gpu([cuda.to_device(r) for r in raws], cuda.to_device(x), outs, qtypes, n_cols,
                [None if b is None else cuda.to_device(b) for b in biases])  # fmt: skip
    for raw, q, h, b, out in zip(raws, qtypes, heights, biases, outs):
        want = matmul_q(x, raw, q, (h, n_cols)) + (0 if b is None else b)
        assert normwise(out.copy_to_host(), want) < 1e-3, q.name


# CPU paths and their tolerances (docs/contracts.md): int8 activations 1e-2, fp32 1e-3
CPU_TOLERANCE = {"q8": 1e-2, "f16": 1e-3, "f32": 1e-3, "blas": 1e-3}


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 3, cpu.BLAS_TOKENS + 1])
def test_cpu_matmul(qtype, tokens):
    rng = np.random.default_rng(200 + int(qtype) + tokens)
    n_rows = cpu.PANEL_ROWS + 8  # two panels, the second partial
    raw = weights(rng, qtype, n_rows, 512)
    x = rng.standard_normal((tokens, 512)).astype(np.float32)
    got = cpu.matmul(raw, x, qtype, (n_rows, 512), threads=2)
    error = normwise(got, matmul_q(x, raw, qtype, (n_rows, 512)))
    assert error < CPU_TOLERANCE[cpu.path(qtype, tokens)]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_cpu_embedding_rows_from_a_quantized_table(qtype):
    from refengine.reference import get_rows as ref

    rng = np.random.default_rng(400 + int(qtype))
    n_cols = cols(qtype, 64) * 2
    raw = weights(rng, qtype, 7, n_cols)
    ids = rng.integers(0, 7, 5)
    assert np.array_equal(cpu.get_rows(raw, qtype, (7, n_cols), ids),
                          ref(raw, qtype, (7, n_cols), ids))  # fmt: skip


@pytest.mark.parametrize("qtype", sorted(cpu.Q8_ROWS, key=lambda t: t.name), ids=lambda t: t.name)
def test_cpu_exact_path_on_request(qtype):
    rng = np.random.default_rng(300 + int(qtype))
    raw = weights(rng, qtype, 16, 512)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    got = cpu.matmul(raw, x, qtype, (16, 512), exact=True)
    assert normwise(got, matmul_q(x, raw, qtype, (16, 512))) < 1e-3


@pytest.mark.parametrize(
    "qtype, counts",
    [(q, (3, 0, 11, 1)) for q in (Q.Q4_1, Q.Q4_K, Q.Q6_K, Q.Q8_0)] + [(Q.Q4_K, (1, 1, 1))],
    ids=str,
)
def test_cpu_experts_in_one_pass_equal_each_expert_alone(qtype, counts):
    """Experts drawing different token counts (one of them none, one more than a span's rows
    share) in one call: each expert's rows against its own matrix of the stack."""
    rng = np.random.default_rng(500 + int(qtype) + len(counts))
    n_expert, n_rows, n_cols = 6, cpu.EXPERT_SPAN_ROWS + 5, 512
    stack = np.stack([weights(rng, qtype, n_rows, n_cols) for _ in range(n_expert)])
    used = rng.permutation(n_expert)[: len(counts)]
    keep = np.array(counts) > 0
    used, counts = used[keep], np.array(counts)[keep]
    first = np.concatenate([[0], np.cumsum(counts)])
    x = rng.standard_normal((first[-1], n_cols)).astype(np.float32)
    out = np.full((first[-1], n_rows), np.nan, np.float32)
    cpu.q8_experts(stack, cpu.quantize_activations(x), used, first, qtype, (n_rows, n_cols), out)
    want = np.empty_like(out)
    for i, e in enumerate(used):
        rows = slice(first[i], first[i + 1])
        want[rows] = matmul_q(x[rows], stack[e], qtype, (n_rows, n_cols))
        alone = np.empty((counts[i], n_rows), np.float32)
        cpu.q8_matvec(stack[e].reshape(-1), cpu.quantize_activations(x[rows]), qtype,
                      (n_rows, n_cols), alone)  # fmt: skip
        np.testing.assert_allclose(out[rows], alone, rtol=1e-5, atol=1e-5 * np.abs(alone).max())
    assert normwise(out, want) < CPU_TOLERANCE["q8"]


def test_q8_activations_round_trip():
    x = np.random.default_rng(4).standard_normal((2, 512)).astype(np.float32) * 3
    x8, xd, xs = cpu.quantize_activations(x)
    back = x8.astype(np.float32) * np.repeat(xd, 32, axis=1)
    assert np.abs(back - x).max() <= xd.max() / 2 + 1e-6  # rounding, no clipping
    assert np.allclose(xs, back.reshape(2, -1, 32).sum(-1), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(GPU, reason="this machine has a GPU")
def test_without_a_gpu_the_driver_says_so_in_one_line():
    with pytest.raises(UserError, match="no NVIDIA GPU"):
        driver.init()


@pytest.mark.gpu
def test_arena_views_pinned_copies_events_and_graphs():
    driver.init()
    free, total = driver.mem_info()
    assert 0 < free <= total
    arena = driver.DeviceBuffer.alloc(1 << 20)
    host = driver.PinnedHostBuffer(1 << 16)
    host.array[:] = np.arange(1 << 16, dtype=np.uint32).astype(np.uint8)
    back = driver.PinnedHostBuffer(1 << 16)
    copy, compute = driver.Stream(), driver.Stream()
    start, done = driver.Event(), driver.Event()
    start.record(copy)
    view = arena.view(4096, 1 << 16)  # a region carved out of the arena
    driver.copy_htod(view, host, 1 << 16, copy)
    done.record(copy)
    compute.wait(done)
    driver.copy_dtoh(back, view, 1 << 16, compute)
    compute.synchronize()
    assert np.array_equal(back.array, host.array) and done.elapsed_seconds(start) >= 0
    # a Numba kernel on our stream, reading a view, captured into a graph and replayed
    rng = np.random.default_rng(7)
    qtype = TYPES[0]
    raw = weights(rng, qtype, 64, 256)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    w_buf, x_buf, o_buf = (
        arena.view(o, n) for o, n in ((0, raw.nbytes), (1 << 19, x.nbytes), (3 << 18, 256))
    )
    w_dev, x_dev = w_buf.array(raw.shape, np.uint8), x_buf.array(x.shape, np.float32)
    out = o_buf.array((1, 64), np.float32)
    w_dev.copy_to_device(raw)
    x_dev.copy_to_device(x)
    out.copy_to_device(np.full((1, 64), np.nan, np.float32))
    matvec_gpu(w_dev, x_dev, out, qtype, (64, 256), compute.numba_stream())  # compile first
    compute.synchronize()
    compute.begin_capture()
    matvec_gpu(w_dev, x_dev, out, qtype, (64, 256), compute.numba_stream())
    graph = compute.end_capture()
    out.copy_to_device(np.full((1, 64), np.nan, np.float32))
    graph.launch(compute)
    compute.synchronize()
    assert normwise(out.copy_to_host(), matmul_q(x, raw, qtype, (64, 256))) < 1e-3
    for b in (host, back):
        b.free()
    arena.free()


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm(with_weight):
    from numba import cuda

    from cudarun.kernels.elementwise import launch_rows, rms_norm
    from refengine.reference import rms_norm as ref

    rng = np.random.default_rng(11)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    w = rng.standard_normal(96).astype(np.float32)
    out = poisoned(x.shape)
    eps = np.float32(1e-6)  # float32, as the runtime launches it
    launch_rows(rms_norm, 3, cuda.to_device(x), cuda.to_device(w), out, eps, with_weight)
    assert normwise(out.copy_to_host(), ref(x, w if with_weight else None, 1e-6)) < 1e-3


@pytest.mark.parametrize("style", ["norm", "neox"])
def test_rope_with_a_per_layer_base_and_pass_through_dims(style):
    from refengine.reference import rope as ref

    rng = np.random.default_rng(12)
    q, k = (rng.standard_normal((3, h, 48)).astype(np.float32) for h in (2, 1))
    pos = np.array([0, 7, 300], np.int64)
    got_q, got_k = _rope_qk(q, k, pos, 32, 1e4, 1.0, style == "neox")
    assert normwise(got_q, ref(q, pos, 32, 1e4, style)) < 1e-3
    assert normwise(got_k, ref(k, pos, 32, 1e4, style)) < 1e-3


def _rope_qk(q, k, pos, n_rot, base, scale, neox, norms=None, eps=1e-6):
    """rope_qk on copies of q and k (in place on the device): what it leaves in them."""
    from numba import cuda

    from cudarun.kernels.elementwise import THREADS, rope_constants, rope_qk

    dq, dk = cuda.to_device(q), cuda.to_device(k)
    weights = norms if norms is not None else (q[0, 0], q[0, 0])  # unread
    rope_qk[(q.shape[0], q.shape[1] + k.shape[1]), THREADS](
        dq, dk, cuda.to_device(pos), *(cuda.to_device(w) for w in weights), np.float32(eps),
        norms is not None, n_rot, *rope_constants(n_rot, base, scale), neox,
    )  # fmt: skip
    return dq.copy_to_host(), dk.copy_to_host()


def test_q_and_k_norms_then_rope_in_one_launch():
    """Qwen3's and Gemma-3's per-head RMSNorm of Q and K, each by its own weight, then RoPE;
    the dims past n_rot normed and passed through."""
    from refengine.reference import rms_norm, rope

    rng = np.random.default_rng(18)
    q, k = (rng.standard_normal((2, h, 40)).astype(np.float32) * 3 for h in (4, 2))
    wq, wk = (rng.standard_normal(40).astype(np.float32) for _ in range(2))
    pos = np.array([5, 6000], np.int64)
    got_q, got_k = _rope_qk(q, k, pos, 32, 1e6, 1.0, True, (wq, wk))
    assert normwise(got_q, rope(rms_norm(q, wq, 1e-6), pos, 32, 1e6, "neox")) < 1e-4
    assert normwise(got_k, rope(rms_norm(k, wk, 1e-6), pos, 32, 1e6, "neox")) < 1e-4


@pytest.mark.parametrize("base,scale", [(1e4, 1.0), (1e6, 0.25)])
def test_rope_angles_in_fp32_hold_at_long_contexts(base, scale):
    """fp32 angles as ggml computes them (pos * theta_scale^i) are 2-4e-3 rad off at 32K; the
    kernel's split angle holds the reference's to ~1e-6 up to 32K and a linear scale."""
    from refengine.reference import rope as ref

    rng = np.random.default_rng(17)
    pos = np.concatenate([[32767, 32768 - 53, 30011], rng.integers(16384, 32768, 3)])
    x = rng.standard_normal((len(pos), 1, 128)).astype(np.float32)
    got, _ = _rope_qk(x, x[:, :0], pos, 128, base, scale, False)
    assert normwise(got, ref(x, pos, 128, base, "norm", scale)) < 1e-5


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gating_and_residual_add(act):
    from numba import cuda

    from cudarun.kernels.elementwise import add, gated, launch_rows
    from refengine.reference import gated as ref

    rng = np.random.default_rng(13)
    g, u = (rng.standard_normal((2, 80)).astype(np.float32) for _ in range(2))
    out = poisoned(g.shape)
    launch_rows(gated, 2, cuda.to_device(g), cuda.to_device(u), out, act == "gelu")
    assert normwise(out.copy_to_host(), ref(act, g, u)) < 1e-3
    out = poisoned(g.shape)
    launch_rows(add, 2, cuda.to_device(g), cuda.to_device(u), out)
    assert normwise(out.copy_to_host(), g + u) < 1e-6


def test_glue_scale_bias_and_the_kv_store_into_its_cells():
    from numba import cuda

    from cudarun.kernels.elementwise import THREADS
    from cudarun.kernels.glue import add_bias, scale_rows, store_kv

    rng = np.random.default_rng(18)
    x, b = rng.standard_normal((3, 40)).astype(np.float32), rng.standard_normal(40)
    d = cuda.to_device(x)
    scale_rows[3, THREADS](d, np.float32(8.0))
    add_bias[3, THREADS](d, cuda.to_device(b.astype(np.float32)))
    assert normwise(d.copy_to_host(), x * 8 + b.astype(np.float32)) < 1e-6
    k, v = (rng.standard_normal((2, n)).astype(np.float32) for n in (24, 16))
    write = np.array([2, 1], np.int64)  # 4 cells: token 0 into cell 2, token 1 into cell 1
    caches = [cuda.to_device(np.full((4, n), np.nan, np.float16)) for n in (24, 16, 24, 16)]
    store_kv[2, THREADS](cuda.to_device(k), cuda.to_device(v), cuda.to_device(write), *caches)
    k_cache, v_cache, k_stage, v_stage = (c.copy_to_host() for c in caches)
    for cache, stage, want in ((k_cache, k_stage, k), (v_cache, v_stage, v)):
        assert np.array_equal(cache[[2, 1]], want.astype(np.float16))
        assert np.array_equal(stage[:2], want.astype(np.float16))
        assert np.isnan(cache[[0, 3]]).all()  # the other cells untouched


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_from_a_quantized_table(qtype):
    from numba import cuda

    from cudarun.kernels.elementwise import get_rows
    from refengine.reference import get_rows as ref

    rng = np.random.default_rng(14)
    n_cols = cols(qtype, 64)
    raw = weights(rng, qtype, 6, n_cols)
    ids = np.array([5, 0, 5, 2], np.int64)
    out = poisoned((4, n_cols))
    get_rows(cuda.to_device(raw), cuda.to_device(ids), out, qtype)
    assert normwise(out.copy_to_host(), ref(raw, qtype, (6, n_cols), ids)) < 1e-6


def test_softmax_over_a_vocabulary_row():
    from numba import cuda

    from cudarun.kernels.elementwise import launch_rows, softmax
    from refengine.reference import softmax as ref

    x = np.random.default_rng(16).standard_normal((2, 300)).astype(np.float32) * 8
    out = poisoned(x.shape)
    launch_rows(softmax, 2, cuda.to_device(x), out)
    assert normwise(out.copy_to_host(), ref(x)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0], ids=lambda t: t.name)
def test_prefill_matmul_on_the_tensor_cores(qtype):
    from numba import cuda

    from cudarun.cublas import Blas
    from cudarun.kernels.prefill import matmul_prefill

    rng = np.random.default_rng(18)
    n_rows, n_cols, tokens = 1000, 1024, 512  # 1000 rows: 3 panels of 384, the last partial
    raw = weights(rng, qtype, n_rows, n_cols)
    x = rng.standard_normal((tokens, n_cols)).astype(np.float32)
    out = poisoned((tokens, n_rows))
    panel = cuda.device_array((384, n_cols), np.float16)
    x16 = cuda.device_array((tokens, n_cols), np.float16)
    blas = Blas(0).own_workspace(tokens)
    matmul_prefill(cuda.to_device(raw), cuda.to_device(x), out, qtype, (n_rows, n_cols), panel, x16,
                   0, blas)  # fmt: skip
    cuda.synchronize()
    blas.close()
    assert normwise(out.copy_to_host(), matmul_q(x, raw, qtype, (n_rows, n_cols))) < 1e-2


# -- the same checks at real shapes, on a GPU ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_matvec_at_real_shapes(qtype, tokens):
    from numba import cuda

    rng = np.random.default_rng(40 + int(qtype))
    shape = (4096, 14336)
    raw = weights(rng, qtype, *shape)
    x = rng.standard_normal((tokens, shape[1])).astype(np.float32)
    out = poisoned((tokens, shape[0]))
    matvec_gpu(cuda.to_device(raw), cuda.to_device(x), out, qtype, shape)
    assert normwise(out.copy_to_host(), matmul_q(x, raw, qtype, shape)) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1024])
def test_gpu_decode_attention_at_a_long_context(window):
    from numba import cuda

    from cudarun.kernels.attention import attention_decode, decode_splits
    from refengine.reference import attention as ref

    rng = np.random.default_rng(41)
    keys, heads, kv_heads, dim = 8192, 32, 8, 128
    q = rng.standard_normal((1, heads, dim)).astype(np.float32)
    k = rng.standard_normal((keys, kv_heads, dim)).astype(np.float16)
    v = rng.standard_normal((keys, kv_heads, dim)).astype(np.float16)
    k_pos = np.arange(keys, dtype=np.int64)
    q_pos = np.array([keys - 1], np.int64)
    splits = decode_splits(keys, kv_heads, 1)
    out = poisoned((1, heads, dim))
    partial = poisoned((1, splits, heads, dim + 2))
    dev = [cuda.to_device(a) for a in (q, k, v, q_pos, k_pos)]
    attention_decode(*dev, out, dim**-0.5, window, splits, partial)
    want = ref(q, k, v, q_pos, k_pos, dim**-0.5, window)
    assert normwise(out.copy_to_host(), want) < 1e-3


@pytest.mark.parametrize("flags", ("simd.AVX2 = simd.VNNI = False", "simd.VNNI = False"))
def test_cpu_q8_rows_without_avx2_or_vnni(flags):
    """Hosts without AVX2 (or not x86) get the generic IR for pmaddubsw/pmaddwd, hosts without
    VNNI pmaddubsw + pmaddwd where vpdpbusd would do: the same results (the in-process tests run
    the host's own path)."""
    import subprocess
    import sys

    script = f"""
import numpy as np
from gguf import GGMLQuantizationType as Q
from cudarun.kernels import simd
{flags}  # before any row kernel compiles
from cudarun.kernels import cpu
from refengine.reference import matmul_q
from tests.kernels_common import normwise, weights
rng = np.random.default_rng(5)
for qtype in (Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q5_1, Q.Q4_0):
    raw = weights(rng, qtype, 8, 512)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    err = normwise(cpu.matmul(raw, x, qtype, (8, 512)), matmul_q(x, raw, qtype, (8, 512)))
    assert err < 1e-2, (qtype.name, err)
print("generic ok")
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert r.returncode == 0 and "generic ok" in r.stdout, r.stdout + r.stderr


def test_bench_kernels_prints_rates_beside_the_ceiling_and_the_peer(tmp_path):
    import json

    from .conftest import refengine

    peer = tmp_path / "peer.json"
    peer.write_text(json.dumps({"types": {"Q4_K": {"weight_gbps": 10.0}}}))
    out = tmp_path / "kernels.txt"
    r = refengine("bench-kernels", "--quick", "--types", "Q4_K", "--peer", peer, "--no-gpu",
                  "-o", out)  # fmt: skip
    assert r.returncode == 0, r.stderr
    # each row as it was measured (stderr and the file, which a time limit would keep), then
    # the table (stdout, and the file's end)
    streamed = [line for line in r.stderr.splitlines() if line.startswith("Q4_K | q8 | 1024x4096")]
    assert len(streamed) == 1 and out.read_text().startswith("CPU kernels, all threads: type |")
    assert streamed[0] in out.read_text() and out.read_text().endswith(r.stdout)
    read = next(line for line in r.stdout.splitlines() if "numba parallel" in line)
    q4k = next(line for line in r.stdout.splitlines() if "Q4_K" in line)
    ceiling = float(read.split("│")[6])
    cells = [c.strip() for c in q4k.split("│")]
    gbps, of_read, theirs, ratio = (float(c) for c in cells[6:10])
    assert cells[2] == "q8" and theirs == 10.0
    # the cells are printed rounded (GB/s to 0.1, ratios to 0.01): the ratio of two rounded rates
    # may sit anywhere between the ratios of their rounding intervals' ends
    low, high = (gbps - 0.05) / (ceiling + 0.05), (gbps + 0.05) / (ceiling - 0.05)
    assert low - 0.005 - 1e-9 <= of_read <= high + 0.005 + 1e-9
    assert abs(ratio - gbps / 10.0) <= 0.05 / 10.0 + 0.005 + 1e-9


@pytest.mark.skipif(GPU, reason="this machine has a GPU")
def test_bench_kernels_asked_for_a_gpu_without_one_says_so(tmp_path):
    from .conftest import refengine

    r = refengine("bench-kernels", "--gpu", "--no-cpu")
    assert r.returncode == 2 and "no NVIDIA GPU" in r.stderr and r.stderr.count("\n") == 1
