"""CPU kernel rates, each beside the ceiling measured in the same run: a Numba `parallel=True` read
of at least 1 GiB on the same threads (what a weight-streaming kernel cannot beat).

Weights rotate over distinct tensors whose bytes exceed twice the last-level cache and the
activations are fresh per call, so no rate is a cache hit (docs/pshard.md, reason 2). Each figure is
the median of `runs` timed passes over the rotation.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import njit, prange

from refengine.quants import qtype as as_qtype, quantize
from refengine.synthetic import random_kquant_blocks

from .kernels import cpu, q8_gemm, q8_panel

GIB = 1 << 30


def last_level_cache_nbytes() -> int:
    """Largest CPU cache from sysfs (32 MiB when it cannot be read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes, default=32 * 1024**2)


@njit(parallel=True, cache=True)
def _read(words):
    total = np.uint64(0)
    for i in prange(words.size):
        total += words[i]
    return total


def host_read_gbps(threads: int = 0, nbytes: int = GIB, runs: int = 5) -> float:
    """Bytes per second of a parallel read of `nbytes` (median of `runs`)."""
    words = np.ones(nbytes // 8, np.uint64)
    with cpu.threads_set(threads):
        _read(words)
        seconds = []
        for _ in range(runs):
            start = time.perf_counter()
            _read(words)
            seconds.append(time.perf_counter() - start)
    return nbytes / statistics.median(seconds) / 1e9


def random_weights(t, rows: int, cols: int, rng) -> np.ndarray:
    """Random GGUF blocks of type t (valid K-quant blocks: gguf-py cannot quantize those)."""
    q = as_qtype(t)
    if not q.quantizable:
        return random_kquant_blocks(rng, (rows, cols), q.ggml, 0.02).reshape(-1)
    return quantize(rng.normal(0, 0.02, size=(rows, cols)).astype(np.float32), q.ggml).reshape(-1)


@dataclass(frozen=True)
class MatmulRate:
    qtype: str
    path: str  # cpu.path: q8, q8gemm, f16, f32 or blas
    shape: tuple[int, int]
    tokens: int
    seconds: float  # one call, median
    weight_nbytes: int

    @property
    def gbps(self) -> float:
        return self.weight_nbytes / self.seconds / 1e9

    @property
    def gflops(self) -> float:
        return 2 * self.shape[0] * self.shape[1] * self.tokens / self.seconds / 1e9


def matmul_rate(
    t: str,
    shape: tuple[int, int],
    tokens: int,
    threads: int = 0,
    runs: int = 5,
    rotate_nbytes: int | None = None,
    seed: int = 0,
    q8: bool = False,
) -> MatmulRate:
    """The median time of `cpu.matmul` on `tokens` tokens, over weights rotated through
    `rotate_nbytes` (default: twice the last-level cache) and fresh inputs. `q8`: the q8 row
    kernels at any token count (what a routed stack's experts run), activations quantized in the
    time. Where the path is int8 tiles, the weights are repacked before the timing, as the engine
    keeps them (`hostmath.HostMath`), and the activations quantized before it too: the products on
    the tiles alone (a profile prices the quantization per value apart)."""
    rng = np.random.default_rng(seed)
    rows, cols = shape
    one = random_weights(t, rows, cols, rng)
    rotate_nbytes = rotate_nbytes or 2 * last_level_cache_nbytes()
    count = max(2, -(-rotate_nbytes // one.nbytes))
    weights = [one] + [one.copy() for _ in range(count - 1)]  # distinct memory is what counts
    xs = rng.standard_normal((count, tokens, cols)).astype(np.float32)
    ggml = as_qtype(t).ggml
    out = np.empty((tokens, rows), np.float32)

    path = "q8" if q8 else cpu.path(ggml, tokens, shape)
    if path == "q8gemm":
        with cpu.threads_set(threads):
            weights = [q8_panel.repack(w, ggml, shape) for w in weights]
        xs = [cpu.quantize_activations(x) for x in xs]

    def product(w, x):
        with cpu.threads_set(threads):
            if path == "q8":
                cpu.q8_matvec(w, cpu.quantize_activations(x), ggml, shape, out)
            elif path == "q8gemm":
                q8_gemm.product(w, x, out)
            else:
                cpu.matmul(w, x, ggml, shape, threads)

    product(weights[0], xs[0])  # compile, warm
    per_pass = []
    for _ in range(runs):
        start = time.perf_counter()
        for w, x in zip(weights, xs):
            product(w, x)
        per_pass.append((time.perf_counter() - start) / count)
    return MatmulRate(t, path, shape, tokens, statistics.median(per_pass), one.nbytes)
