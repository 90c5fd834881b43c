"""The attention kernels (split-KV decode, tiled prefill) and the prefill path's dequantization
against the reference operations: fresh random inputs, outputs poisoned with NaN, the KV as the
runtime keeps it (an fp16 ring of cells, positions per cell, never-written cells holding NaN).
Under the CUDA simulator at tiny shapes (4 lanes a warp, tiles of 4 keys); on a GPU at real ones."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from cudarun.kvstore import EMPTY
from refengine.reference import attention as reference_attention

from .kernels_common import TYPES, normwise, poisoned, weights


def ring_positions(cells: int, end: int) -> np.ndarray:
    """The position each of `cells` cells holds once positions [0, end) were written into cell
    p % cells (EMPTY for a cell never written)."""
    c = np.arange(cells, dtype=np.int64)
    return np.where(c < end, c + cells * ((end - 1 - c) // cells), EMPTY)


def ring(rng, cells, end, kv_heads, dim):
    """A KV ring of `cells` cells after positions [0, end) were written (position p in cell
    p % cells): random fp16 K and V where written, NaN in the cells never written."""
    k_pos = ring_positions(cells, end)
    k = rng.standard_normal((cells, kv_heads, dim)).astype(np.float16)
    v = rng.standard_normal((cells, kv_heads, dim)).astype(np.float16)
    k[k_pos == EMPTY] = np.nan
    v[k_pos == EMPTY] = np.nan
    return k, v, k_pos


def expected(q, k, v, q_pos, k_pos, scale, window):
    """The reference over the written cells (it knows nothing of rings)."""
    held = k_pos != EMPTY
    return reference_attention(q, k[held], v[held], q_pos, k_pos[held], scale, window)


def attend(tokens, heads, kv_heads, dim, cells, end, window, splits=None, seed=0):
    """Queries at positions [end - tokens, end) against the ring; decode (split over the keys)
    when `splits` is given, else prefill. Returns (got, want)."""
    from numba import cuda

    from cudarun.kernels.attention import attention_decode, attention_prefill

    rng = np.random.default_rng(seed)
    q = rng.standard_normal((tokens, heads, dim)).astype(np.float32)
    k, v, k_pos = ring(rng, cells, end, kv_heads, dim)
    q_pos = np.arange(end - tokens, end, dtype=np.int64)
    scale = np.float32(dim**-0.5)
    out = poisoned((tokens, heads, dim))
    dev = [cuda.to_device(a) for a in (q, k, v, q_pos, k_pos)]
    if splits is None:
        attention_prefill(*dev, out, scale, window)
    else:
        partial = poisoned((tokens, splits, heads, dim + 2))
        attention_decode(*dev, out, scale, window, splits, partial)
    return out.copy_to_host(), expected(q, k, v, q_pos, k_pos, scale, window)


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,dim,cells,end,window,splits",
    [
        (1, 4, 2, 16, 37, 32, 0, 3),  # one token, 5 cells never written (NaN), a tile half so
        (1, 4, 1, 16, 37, 37, 0, 20),  # 20 splits of 2 keys: the last sees no key at all
        (2, 4, 2, 16, 20, 20, 0, 1),  # one split: every key in one block
        (3, 6, 2, 18, 16, 40, 9, 4),  # a wrapped sliding-window ring, group 3, fp16 pairs
        (16, 4, 2, 16, 37, 34, 0, 2),  # the most decode tokens: several row tiles a KV head
        (16, 4, 2, 16, 28, 50, 12, 3),  # the same through a wrapped window
        (2, 2, 1, 34, 21, 21, 0, 2),  # a lane's share past its registers: the tiled kernel
    ],
    ids=[
        "1-token",
        "1-token-many-splits",
        "2-tokens-one-split",
        "3-tokens-window-ring",
        "16-tokens",
        "16-tokens-window",
        "tiled-fallback",
    ],
)
def test_decode_attention_split_over_the_kv_length(
    tokens, heads, kv_heads, dim, cells, end, window, splits
):
    """The vec kernel (queries and outputs in registers) but where a lane's share of the head
    dim would not fit, which the tiled kernel attends."""
    from cudarun.kernels.attention_vec import kernel_shape

    shape = kernel_shape(np.zeros((tokens, heads, dim), np.float32),
                         *[np.zeros((cells, kv_heads, dim), np.float16)] * 2)  # fmt: skip
    assert (shape is None) == (dim == 34)
    got, want = attend(tokens, heads, kv_heads, dim, cells, end, window, splits, seed=tokens)
    assert normwise(got, want) < 1e-3


def test_vec_kernel_shapes():
    """llama.cpp's layout where the head dim allows it: 8 lanes a key, 16-byte loads; rows of a
    KV head's group in one block within the registers' budget; pairs of 32-bit words, or fewer
    lanes, where the dims do not split."""
    from cudarun.kernels.attention_vec import key_lanes, load_width, row_tile

    assert key_lanes(32, 32, 8) == 8 and load_width(32, 8, True) == 2  # D = 128 in uint64
    assert key_lanes(20, 20, 8) == 4 and load_width(20, 4, True) == 1  # D = 80
    assert load_width(32, 8, False) == 1  # a cache not on a 16-byte boundary
    assert key_lanes(9, 9, 8) == 1  # D = 18 in uint32 pairs: a lane per key
    rows = [row_tile(n, d, d, 512) for n, d in ((4, 128), (3, 128), (64, 256), (1, 64), (64, 64))]
    assert rows == [4, 4, 2, 1, 8]


@pytest.mark.parametrize(
    "tokens,heads,kv_heads,dim,cells,end,window",
    [
        (23, 4, 2, 16, 30, 27, 0),  # 8 tiles of 4 keys, the last ragged, 3 cells never written
        (9, 6, 2, 18, 14, 20, 5),  # a wrapped sliding-window ring, group 3, fp16 pairs
        (21, 2, 2, 16, 25, 21, 4),  # one head per KV head, a window inside the prompt
    ],
    ids=["causal", "window-ring", "window-in-prompt"],
)
def test_prefill_attention_tiled(tokens, heads, kv_heads, dim, cells, end, window):
    got, want = attend(tokens, heads, kv_heads, dim, cells, end, window, seed=tokens)
    assert normwise(got, want) < 1e-3


def test_rows_per_block_fit_the_shared_tiles():
    from cudarun.kernels.attention import MAX_ROWS, ROW_FLOATS, rows_per_block

    assert rows_per_block(1, 4, 128, 128) == 4  # a decode token of a 4-head group: one block
    assert rows_per_block(16, 4, 128, 128) == ROW_FLOATS // 128
    assert rows_per_block(512, 8, 64, 64) == MAX_ROWS
    assert rows_per_block(512, 2, 256, 256) * 256 <= ROW_FLOATS


def test_odd_head_dims_are_refused():
    from numba import cuda

    from cudarun.kernels.attention import attention_prefill

    q = cuda.to_device(np.zeros((1, 1, 7), np.float32))
    kv = cuda.to_device(np.zeros((4, 1, 7), np.float16))
    pos = cuda.to_device(np.zeros(4, np.int64))
    with pytest.raises(ValueError, match="even head dims"):
        attention_prefill(q, kv, kv, pos[:1], pos, poisoned((1, 1, 7)), np.float32(1.0), 0)


# -- the prefill path's fp16 panel -----------------------------------------------------------------


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prefill_dequantizes_a_panel_to_fp16(qtype):
    """Rows 2..4 of a 6-row tensor (two blocks a row), each value the reference's rounded to
    fp16: within half an fp16 ulp."""
    from numba import cuda

    from cudarun.blocks import layout
    from cudarun.kernels.prefill import dequantize
    from refengine.quants import dequantize as ref

    rng = np.random.default_rng(17 + int(qtype))
    n_cols = max(64, 2 * layout(qtype)[1])
    raw = weights(rng, qtype, 6, n_cols)
    out = cuda.to_device(np.full((3, n_cols), np.nan, np.float16))
    dequantize(cuda.to_device(raw), out, qtype, first_row=2)
    got = out.copy_to_host().astype(np.float32)
    want = ref(raw, qtype, (6, n_cols))[2:5]
    assert np.all(np.abs(got - want) <= np.abs(want) * 2.0**-11 * 1.01 + 2.0**-25)
    assert normwise(got, want) < 1e-3


def test_prefill_dequantize_refuses_rows_it_cannot_write_in_eights():
    from numba import cuda

    from cudarun.kernels.prefill import dequantize

    raw = cuda.to_device(np.zeros(12, np.uint8))
    with pytest.raises(ValueError, match="eight fp16 at a time"):
        dequantize(raw, cuda.to_device(np.zeros((1, 6), np.float16)), Q.F16)


def test_activations_rounded_to_fp16():
    from numba import cuda

    from cudarun.kernels.prefill import to_half

    x = np.random.default_rng(18).standard_normal((3, 10)).astype(np.float32)
    out = cuda.to_device(np.full(x.shape, np.nan, np.float16))
    to_half.forall(x.size)(cuda.to_device(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), x.astype(np.float16))


# -- at real shapes, on a GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 1024])
def test_gpu_prefill_attention_at_real_shapes(window):
    """A 512-token ubatch after 3000 positions, 32 heads over 8 KV heads of 128 dims, in a ring
    of 4096 cells (some never written)."""
    got, want = attend(512, 32, 8, 128, 4096, 3512, window, seed=window)
    assert normwise(got, want) < 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_decode_attention_gemma_shapes(tokens):
    """Head dim 256, 4 heads over 1 KV head, a sliding window ring that has wrapped."""
    from cudarun.kernels.attention import decode_splits

    splits = decode_splits(1536, 1, tokens)
    got, want = attend(tokens, 4, 1, 256, 1536, 5000, 1024, splits, seed=tokens)
    assert normwise(got, want) < 1e-3


# -- the prefill path through the CUDA engine -----------------------------------------------------


def test_cuda_engine_prefill_path_under_the_simulator(tmp_path, monkeypatch):
    """A 20-token prompt past the matvec tokens on a tiny gemma3 (sliding-window layers), every
    part on the device: the weights dequantized to fp16 panels, the activations rounded, the
    tiled prefill attention over the fp16 ring, then a decode token. cuBLAS needs a GPU, so the
    product itself is NumPy's here (fp16 inputs, fp32 accumulation, as GemmEx); cuBLAS's
    workspace is the tier's region of the arena, inside the budget."""
    from cudarun.cuda_engine import CudaEngine
    from cudarun.kernels import prefill
    from refengine.engine import NumpyEngine
    from refengine.spec import load_spec
    from refengine.synthetic import SyntheticConfig, write_synthetic
    from solver.cost import PINNED, Loc, TierPlacement, Workload, evaluate
    from solver.groups import tensor_groups
    from solver.plan import plan_json
    from solver.solve import load_profile

    from solver import workspace
    from solver.workspace import cublas_nbytes

    def pointer(a):  # the simulator's device arrays wrap NumPy arrays
        return a._ary.__array_interface__["data"][0]

    workspaces = []

    def gemm(x16, w16, out, blas, out_columns):
        x, w = (a.copy_to_host().astype(np.float32) for a in (x16, w16))
        first, count = out_columns
        out[:, first : first + count] = x @ w.T
        workspaces.append((pointer(blas.region), blas.region.nbytes))

    monkeypatch.setattr(prefill, "gemm_fp16", gemm)
    # panels of 16 rows: each product of 64 or more rows runs as several, each into its columns
    monkeypatch.setattr(workspace, "PANEL_ROW_STEP", 16)
    monkeypatch.setattr(workspace, "PANEL_NBYTES", 16 * 2 * 64)
    config = SyntheticConfig("gemma3", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                             head_dim=16, n_vocab=260, qtype="Q4_K", n_swa=6)  # fmt: skip
    spec = load_spec(str(write_synthetic(tmp_path / "m.gguf", config)))
    resident = TierPlacement({g.name: Loc(PINNED) for g in tensor_groups(spec)}, {0: Loc(PINNED)})
    tiers = {1: resident, 32: resident}
    w = Workload(n_ctx=64, prompt_tokens=20, gen_tokens=1, threads=2)
    prof = load_profile("h100")
    plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (16 << 20)], tiers,
                     evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip
    engine, reference = CudaEngine(spec, plan), NumpyEngine(spec, n_ctx=64)
    ids = list(np.random.default_rng(3).integers(0, spec.hparams.n_vocab, 20))
    for call in (lambda e: e.prefill(ids), lambda e: e.decode(5)):
        ours, want = call(engine), call(reference)
        assert normwise(ours, want) <= 5e-2
    arena = pointer(engine.arena)
    assert workspaces and set(workspaces) == {(workspaces[0][0], cublas_nbytes(32))}
    assert arena <= workspaces[0][0] < workspaces[0][0] + cublas_nbytes(32) <= arena + engine.arena.nbytes
