"""The `cpu` engine against the NumPy engine: every architecture, prompts through the int8 tiles
and decode through the fused layer kernel, several ubatches per prompt; the fused layer against
the part-by-part host path it replaces; its fp16 conversion and BLAS attention against NumPy and
the reference."""

import numpy as np
import pytest

from cudarun.cpu_engine import CpuEngine
from cudarun.hostmath import attention_blas
from cudarun.kernels import cpu_layer
from refengine import reference as ref
from refengine.agreement import agreement_along, normwise, reference_run
from refengine.engine import NumpyEngine
from refengine.spec import load_spec
from tests.conftest import refengine

ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_agrees_with_numpy(small_models, int8_gemma3, arch):
    spec = load_spec(str(int8_gemma3 if arch == "gemma3" else small_models[arch]))
    engine = CpuEngine(spec, n_ctx=64, tiers=[1, 8])
    # 11 tokens: an int8-tile ubatch of 8 and one of 3 (the q8 rows), then greedy decode steps
    prompt = np.random.default_rng(1).integers(0, spec.hparams.n_vocab, 11)
    rows = reference_run(NumpyEngine(spec, n_ctx=64), prompt, 12)
    agreement = agreement_along(engine, prompt, rows, engine.tolerance)
    assert agreement.ok, agreement.summary()
    # every architecture decodes through the fused kernels (MoE: the attention half, then the experts)
    assert (engine.layers is None) == (arch == "qwen3")  # qwen3 here is F16


@pytest.mark.parametrize("arch", ("llama", "qwen2", "gemma3", "qwen3moe"))
def test_the_fused_layer_equals_the_parts_it_replaces(small_models, arch):
    """Same int8 arithmetic, one call instead of a dozen: the activations of every block agree to
    fp32 rounding (only the attention's order of summation differs)."""
    spec = load_spec(str(small_models[arch]))
    prompt = np.random.default_rng(2).integers(0, spec.hparams.n_vocab, 5)
    record = {f"blk.{il}.out" for il in range(spec.hparams.n_layer)} | {"logits"}
    fused, parts = (CpuEngine(spec, n_ctx=32, tiers=[8]) for _ in range(2))
    parts.layers = None
    assert fused.layers is not None
    for engine in (fused, parts):
        engine.prefill(prompt[:3])
    for token in prompt[3:]:
        (_, a), (_, b) = (e.decode(int(token), record=record) for e in (fused, parts))
        for name in record:
            assert normwise(a[name], b[name]) < 1e-4, name
    for il in range(spec.hparams.n_layer):  # the same fp16 cache, written by the fused kernel
        for a, b in ((fused.mirror.k[il], parts.mirror.k[il]),
                     (fused.mirror.v[il], parts.mirror.v[il])):  # fmt: skip
            assert normwise(a[: prompt.size].astype(np.float32), b[: prompt.size]) < 1e-3


def test_half_of_rounds_as_numpy_does():
    rng = np.random.default_rng(3)
    values = np.concatenate([
        rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 20000),
        np.float32([0.0, -0.0, 65504.0, 65520.0, 1e6, -1e6, 6e-8, 3e-8, 2.9802322e-08, np.inf,
                    -np.inf, 1.0009765625, 1.00048828125, 1.00146484375]),
    ]).astype(np.float32)  # fmt: skip

    from numba import njit

    @njit
    def convert(x, out):
        for i in range(x.size):
            out[i] = cpu_layer.half_of(x[i])

    got = np.empty(values.size, np.uint16)
    convert(values, got)
    with np.errstate(over="ignore"):  # the overflow to inf is what is compared
        want = values.astype(np.float16).view(np.uint16)
    assert np.array_equal(got, want)
    nan = np.empty(1, np.uint16)
    convert(np.float32([np.nan]), nan)
    assert np.isnan(nan.view(np.float16)[0])


@pytest.mark.parametrize("window", [0, 5])
def test_the_blas_attention_of_a_prompt_matches_the_reference(window):
    rng = np.random.default_rng(4)
    q = rng.standard_normal((9, 6, 16)).astype(np.float32)
    k = rng.standard_normal((20, 2, 16)).astype(np.float16)
    v = rng.standard_normal((20, 2, 16)).astype(np.float16)
    q_pos, k_pos = np.arange(11, 20), np.arange(20)
    want = ref.attention(q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos, 0.25, window)
    got = attention_blas(q, k, v, q_pos, k_pos, 0.25, window, max_scores=2 * 20 * 3)  # chunked
    assert normwise(got, want) < 1e-5


def test_cli_runs_and_benches_the_cpu_engine(small_models):
    model = str(small_models["llama"])
    out = refengine("run", model, "--tokens", "5,6,7", "-n", "4", "--engine", "cpu", "-c", "64")
    assert out.returncode == 0, out.stderr
    assert "[cpu]" in out.stderr
    out = refengine("bench", model, "--engine", "cpu", "-p", "16", "-n", "4", "-r", "2",
                    "-o", "json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    import json

    records = json.loads(out.stdout)
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(16, 0), (0, 4)]
    assert all(r["avg_ts"] > 0 and len(r["samples_ts"]) == 2 and "stddev_ts" in r
               for r in records)  # fmt: skip
    out = refengine("bench", model, "--engine", "cpu", "--budget", "1GiB")
    assert out.returncode == 2 and "--budget and --split-mode do not apply" in out.stderr


def test_the_heads_second_int8_plane_recovers_what_the_first_rounds_away():
    """The head's activations to about 15 bits: two int8 planes, or int16 for Q8_0 weights."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    from cudarun.kernels import cpu

    rng = np.random.default_rng(5)
    w = rng.standard_normal((96, 256)).astype(np.float32)
    raw = quants.quantize(w, Q.Q8_0)
    x = rng.standard_normal((3, 256)).astype(np.float32) * np.linspace(0.1, 4.0, 256, dtype=np.float32)
    want = x @ quants.dequantize(raw, Q.Q8_0).T
    one, two = np.empty((3, 96), np.float32), np.empty((6, 96), np.float32)
    cpu.q8_matvec(raw.reshape(-1), cpu.quantize_activations(x), Q.Q8_0, (96, 256), one)
    cpu.q8_matvec(raw.reshape(-1), cpu.quantize_two_planes(x), Q.Q8_0, (96, 256), two)
    single, double = normwise(one, want), normwise(two[:3] + two[3:], want)
    assert single > 1e-3 and double < single / 50
    for tokens in (3, 10):  # one row intrinsic; chunks of four and a remainder
        xt = np.resize(x, (tokens, 256))
        wide = np.empty((tokens, 96), np.float32)
        cpu.q16_matvec(raw.reshape(-1), *cpu.quantize_activations16(xt), Q.Q8_0, (96, 256), wide)
        assert normwise(wide, xt @ quants.dequantize(raw, Q.Q8_0).T) < single / 50


def test_a_recorded_block_output_survives_the_next_fused_layer(small_models):
    """Layer 0 part by part, layer 1 fused: the fused kernel updates the residual in place, and
    must not do so in the array layer 0 recorded as its output."""
    spec = load_spec(str(small_models["llama"]))
    engine, reference = CpuEngine(spec, n_ctx=16, tiers=[8]), NumpyEngine(spec, n_ctx=16)
    engine.layers[0] = None
    record = {"blk.0.out", "blk.1.out"}
    (_, got), (_, want) = engine.prefill([3, 4], record=record), reference.prefill([3, 4], record=record)
    for name in record:
        assert normwise(got[name], want[name]) < 5e-2, name


@pytest.mark.parametrize("window", [0, 40])
@pytest.mark.parametrize("twin", ["_attention_parallel", "_attention_serial"])
def test_decode_attention_over_chunks_equals_a_dense_softmax(window, twin):
    """The fused layer's attention splits each token's cells into chunks of KEYS_PER_CHUNK and
    merges their softmax partials: against one dense softmax per (token, head) over fresh random
    caches, across chunk boundaries, with grouped heads, cells of another sequence, later
    positions, a sliding window, and NaN in every masked cell; both twins (a small step runs the
    serial one)."""
    rng = np.random.default_rng(7)
    n_head, n_kv, hd, cells = 6, 2, 16, 300
    kc = rng.standard_normal((cells, n_kv, hd)).astype(np.float16)
    vc = rng.standard_normal((cells, n_kv, hd)).astype(np.float16)
    cell_seq = rng.integers(0, 3, cells).astype(np.int64)  # sequence 2's cells: nobody's
    cell_pos = np.arange(cells, dtype=np.int64)
    seq = np.array([0, 1, 0, 1], np.int64)
    pos = np.array([5, 63, 130, 250], np.int64)
    cell_seq[pos] = seq  # each token's own key is in the cache
    lo = np.zeros(4, np.int64)
    hi = np.array([70, 64, 200, 300], np.int64)  # one chunk, one exactly full, four, five
    masked = np.zeros((4, cells), bool)
    for t in range(4):
        masked[t] = (cell_seq != seq[t]) | (cell_pos > pos[t]) | (np.arange(cells) >= hi[t])
        if window:
            masked[t] |= pos[t] - cell_pos >= window
    poisoned_k, poisoned_v = kc.copy(), vc.copy()
    poisoned_k[cell_seq == 2], poisoned_v[cell_seq == 2] = np.nan, np.nan  # may hold anything
    q = rng.standard_normal((4, n_head * hd)).astype(np.float32)
    out = np.full((4, n_head * hd), np.nan, np.float32)
    getattr(cpu_layer, twin)(q, poisoned_k.view(np.uint16), poisoned_v.view(np.uint16), pos, lo, hi,
                             seq, cell_pos, cell_seq, n_head, n_kv, window, np.float32(0.25), out)  # fmt: skip
    assert np.isfinite(out).all()
    for t in range(4):
        keep = ~masked[t]
        for h in range(n_head):
            g = h // (n_head // n_kv)
            k = kc[keep, g].astype(np.float64)
            s = k @ q[t, h * hd : (h + 1) * hd].astype(np.float64) * 0.25
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vc[keep, g].astype(np.float64)
            got = out[t, h * hd : (h + 1) * hd]
            assert np.allclose(got, want, atol=1e-5), (t, h)


@pytest.mark.slow
@pytest.mark.xdist_group("cpu-real")  # one worker: the kernels compile once for both models
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_diff_of_the_real_models_meets_the_int8_path(name):
    """`refengine diff MODEL --engine cpu` on the real files, as a user runs it: every position
    within llama.cpp's own bounds for its CPU arithmetic (top-1 >= 98%, mean KL < 5e-3)."""
    from click.testing import CliRunner

    from refengine.commands import cli

    prompt = "The engine streams the weights that do not fit into a ring of slots on the GPU."
    r = CliRunner().invoke(cli, ["diff", name, "--engine", "cpu", "-p", prompt, "-n", "8", "-c",
                                 "128"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "verdict: meets its path's bounds" in r.output and "int8 path" in r.output
