"""Matrix x activations for large token counts (prefill): the path named "fp16 tensor-core"
(docs/contracts.md tolerance 1e-2).

A Numba kernel dequantizes the weight's GGUF blocks into an fp16 panel, the activations are
rounded to fp16, and cuBLAS multiplies them on the tensor cores with fp32 accumulation and an fp32
output (`cublasGemmEx` through `cudarun.cublas`, on the caller's stream). Numba has no tensor-core
instructions; at 512 tokens the product is compute-bound, and a library GEMM is the only way to
the hardware's rate. The weight stays quantized in VRAM and on the bus; the panel is scratch that
the runtime's memory map reserves.

The dequantization is a streaming copy, and its writes are 3.6 times its reads (Q4_K: 2 bytes out
per 0.56 in): each thread decodes a unit of a block (16 or 32 values, `panel.UNITS`) and stores it
as 16-byte runs of eight fp16.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import cuda, uint32  # noqa: E402

from . import THREADS  # noqa: E402
from .panel import UNITS  # noqa: E402

WORDS = {2: np.uint16, 4: np.uint32, 8: np.int64}  # int64: the fp16 copy stores what it loads

BLOCK_THREADS = 8 * THREADS  # 256 on a GPU: eight warps, 1024 values per block


@lru_cache(maxsize=None)
def dequantize_kernel(qtype):
    unit = UNITS[qtype]
    decode, log_units, mask = unit.decode, unit.units.bit_length() - 1, unit.units - 1
    block_words, values = unit.block_words, unit.values

    @cuda.jit
    def dequantize(w, wb, out, first_block, n_units):
        """out = the panel's fp16 as int64 words, from block first_block of the tensor whose
        words w (and bytes wb) are; one thread per unit (`panel.UNITS`)."""
        i = uint32(cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x)
        if i < n_units:
            blk = uint32(i >> log_units)
            decode(w, wb, uint32((first_block + blk) * block_words), uint32(i & mask), out,
                   uint32(blk * values))  # fmt: skip

    return dequantize


@cuda.jit
def to_half(x, out):
    """out [T, n] fp16 = x [T, n] rounded; one thread per element."""
    i = cuda.grid(1)
    if i < x.size:
        out[i // x.shape[1], i % x.shape[1]] = x[i // x.shape[1], i % x.shape[1]]


def dequantize(raw, out, qtype, first_row: int = 0, stream=0) -> None:
    """Rows first_row.. of the weight in `raw` (device bytes) into `out` [rows, n_cols] fp16
    (C-contiguous; n_cols a multiple of 8)."""
    rows, n_cols = out.shape
    if n_cols % 8:
        raise ValueError(f"dequantize writes eight fp16 at a time; rows of {n_cols} values")
    unit = UNITS[qtype]
    first_block, n_blocks = first_row * n_cols // unit.values, rows * n_cols // unit.values
    if (first_block + n_blocks) * unit.block_words >= 1 << 32:
        raise ValueError(f"a {qtype.name} tensor past 2^32 words; the panel indexes in 32 bits")
    n_units = n_blocks * unit.units
    grid = -(-n_units // BLOCK_THREADS)
    dequantize_kernel(qtype)[grid, BLOCK_THREADS, stream](
        raw.view(WORDS[unit.word_bytes]), raw.view(np.int8),
        out.reshape(rows * n_cols).view(np.int64), np.uint32(first_block), np.uint32(n_units))


def gemm_fp16(x16, w16, out, blas, out_columns: tuple[int, int] | None = None) -> None:
    """out [T, N] fp32 = x16 [T, K] fp16 times w16 [N, K] fp16 transposed, by cuBLAS on `blas`'s
    stream (`cudarun.cublas.Blas`), into out's columns (first, count) where given: a module
    function, so the launch count sees each product."""
    blas.gemm_fp16(x16, w16, out, out_columns)


def matmul_prefill(raw, x, out, qtype, shape, panel16, x16, stream, blas,
                   half_ready: bool = False) -> None:  # fmt: skip
    """out [T, n_rows] fp32 = x [T, n_cols] fp32 times the quantized weight, through fp16 panels of
    panel16.shape[0] rows (`panel16`, `x16`: scratch device arrays from the memory map; `blas`:
    cuBLAS on `stream`; half_ready: x16 holds x already, rounded for an earlier product). No
    device array is sliced per panel: Numba's slicing of a strided column block walks its rows
    in Python (2.8 M calls for one 8B-shaped pp512 on an H200)."""
    n_rows, n_cols = shape
    if not half_ready:
        to_half.forall(x.size, stream=stream)(x, x16)
    rows_per_panel = panel16.shape[0]
    panels = {}  # the full panel and the last, shorter one
    for first in range(0, n_rows, rows_per_panel):
        rows = min(rows_per_panel, n_rows - first)
        if rows not in panels:
            panels[rows] = panel16[:rows]
        dequantize(raw, panels[rows], qtype, first, stream)
        gemm_fp16(x16, panels[rows], out, blas, (first, rows))
