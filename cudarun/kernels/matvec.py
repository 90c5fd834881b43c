"""Matrix x activations for 1..MAX_TOKENS tokens (decode and small batches), reading the weight's
GGUF blocks directly: the weight is read once for all tokens.

GPU: one thread block per output row; its threads stride over the row's quantization blocks,
decoding each once (`blocks.LAYOUTS`: scales read once per block) and keeping MAX_TOKENS partial
sums, then reduce them through shared memory (no warp shuffles, so the same kernel runs on the
simulator). It computes out[t, r] = sum_c x[t, c] * W[r, c] in fp32. (CPU: `kernels.cpu`.)
"""

from __future__ import annotations

from functools import lru_cache


from .. import compat  # noqa: F401  (before numba.cuda)
from ..blocks import LAYOUTS

# module level, not inside the factories: the simulator swaps this global for its fake module
from numba import cuda, float32  # noqa: E402

MAX_TOKENS = 16
from . import THREADS  # noqa: E402


@lru_cache(maxsize=None)
def gpu_kernel(qtype):
    decode, per_block, block_nbytes = LAYOUTS[qtype]

    @cuda.jit
    def matvec(raw, x, out, n_cols, n_tokens):
        row = cuda.blockIdx.x
        tid = cuda.threadIdx.x
        partial = cuda.shared.array((THREADS, MAX_TOKENS), float32)
        acc = cuda.local.array(MAX_TOKENS, float32)
        vals = cuda.local.array(per_block, float32)
        for t in range(MAX_TOKENS):
            acc[t] = 0.0
        blocks = n_cols // per_block
        row_base = row * blocks * block_nbytes
        for b in range(tid, blocks, THREADS):
            decode(raw, row_base + b * block_nbytes, vals)
            col = b * per_block
            for t in range(n_tokens):
                s = float32(0.0)
                for j in range(per_block):
                    s += vals[j] * x[t, col + j]
                acc[t] += s
        for t in range(MAX_TOKENS):
            partial[tid, t] = acc[t]
        cuda.syncthreads()
        step = THREADS // 2
        while step > 0:
            if tid < step:
                for t in range(n_tokens):
                    partial[tid, t] += partial[tid + step, t]
            cuda.syncthreads()
            step //= 2
        for t in range(tid, n_tokens, THREADS):  # THREADS may be fewer than the tokens (simulator)
            out[t, row] = partial[0, t]

    return matvec


def matvec_gpu(raw, x, out, qtype, shape: tuple[int, int], stream=0) -> None:
    """out [T, n_rows] (device) = x [T, n_cols] (device) times the weight in `raw` (device)."""
    n_rows, n_cols = shape
    n_tokens = x.shape[0]
    assert n_tokens <= MAX_TOKENS and n_cols % LAYOUTS[qtype][1] == 0
    gpu_kernel(qtype)[n_rows, THREADS, stream](raw, x, out, n_cols, n_tokens)
