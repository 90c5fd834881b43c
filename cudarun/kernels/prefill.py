"""Matrix x activations for large token counts (prefill): the path named "fp16 tensor-core"
(docs/contracts.md tolerance 1e-2).

A Numba kernel dequantizes the weight's GGUF blocks into an fp16 panel, the activations are
rounded to fp16, and cuBLAS multiplies them on the tensor cores with fp32 accumulation and an fp32
output (`cublasGemmEx` through `cudarun.cublas`, on the caller's stream). Numba has no tensor-core
instructions; at 512 tokens the product is compute-bound, and a library GEMM is the only way to
the hardware's rate. The weight stays quantized in VRAM and on the bus; the panel is scratch that
the runtime's memory map reserves.

The dequantization is a streaming copy, and its writes are 3.6 times its reads (Q4_K: 2 bytes out
per 0.56 in): each thread decodes four consecutive values (`dequant.QUADS`) and stores them as one
64-bit word of fp16, so a warp writes 256 contiguous bytes per store and reads its 128 values' quant
bytes in one contiguous sweep (a warp per four 32-value blocks, or per half a 256-value block).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import cuda  # noqa: E402

from . import THREADS  # noqa: E402
from .bits import pack_halves  # noqa: E402
from .dequant import quad_layout  # noqa: E402

BLOCK_THREADS = 8 * THREADS  # 256 on a GPU: eight warps, 1024 values per block


@lru_cache(maxsize=None)
def dequantize_kernel(qtype):
    quad, per_block, block_nbytes = quad_layout(qtype)

    @cuda.jit
    def dequantize(raw, out, first_value):
        """out [n // 4] int64 = four fp16 values a word, values first_value.. of the tensor whose
        bytes `raw` holds (viewed as uint16); one thread per word."""
        i = cuda.grid(1)
        if i >= out.shape[0]:
            return
        v = first_value + 4 * i
        block = v // per_block  # a power of two: a shift
        a, b, c, d = quad(raw, block * block_nbytes, v - block * per_block)
        out[i] = pack_halves(a, b, c, d)

    return dequantize


@cuda.jit
def to_half(x, out):
    """out [T, n] fp16 = x [T, n] rounded; one thread per element."""
    i = cuda.grid(1)
    if i < x.size:
        out[i // x.shape[1], i % x.shape[1]] = x[i // x.shape[1], i % x.shape[1]]


def dequantize(raw, out, qtype, first_row: int = 0, stream=0) -> None:
    """Rows first_row.. of the weight in `raw` (device bytes) into `out` [rows, n_cols] fp16
    (C-contiguous; n_cols a multiple of 4)."""
    rows, n_cols = out.shape
    if n_cols % 4:
        raise ValueError(f"dequantize writes four fp16 at a time; rows of {n_cols} values")
    words = out.reshape(rows * n_cols).view(np.int64)
    grid = -(-words.shape[0] // BLOCK_THREADS)
    dequantize_kernel(qtype)[grid, BLOCK_THREADS, stream](
        raw.view(np.uint16), words, np.int64(first_row * n_cols)
    )


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
