"""The CPU side of a hardware profile, measured on this machine.

Until the kernels issue lands its Numba CPU kernels, the CPU "kernel" is the reference's: dequantize
the GGUF blocks with gguf-py, then a BLAS product. Every figure says so (`provisional`). What makes
the figures honest is the working set: each measurement rotates through enough distinct weight
tensors that their quantized bytes exceed twice the last-level cache, and through fresh inputs, so
no rate is inflated by cache hits (PSHARD.md, reason 2).
"""

from __future__ import annotations

import os
import time
from datetime import date
from pathlib import Path
from typing import Callable

import numpy as np

from refengine.quants import Q, qtype, quantize
from refengine.synthetic import random_kquant_blocks

from .profile import ANY_TYPE, CPUProfile, Figure, RateTable

KERNEL = "NumPy reference kernels (gguf-py dequantize + BLAS), provisional"
MATVEC_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
MATMUL_TOKENS = (64, 512)


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


def _weights(t, rows: int, cols: int, count: int, rng) -> list[np.ndarray]:
    """`count` distinct random tensors of type t, as raw GGUF bytes."""
    out = []
    for _ in range(count):
        if qtype(t).ggml in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
            out.append(random_kquant_blocks(rng, (rows, cols), qtype(t).ggml, 0.02))
        else:
            out.append(
                quantize(rng.normal(0, 0.02, size=(rows, cols)).astype(np.float32), qtype(t).ggml)
            )
    return out


def _rate(run: Callable[[int], None], n_items: int, min_seconds: float) -> float:
    """Items per second: call run(i) over rotating items until min_seconds pass (after one warm-up)."""
    run(0)
    calls, start = 0, time.perf_counter()
    while True:
        run(calls % n_items)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds and calls >= n_items:
            return calls / elapsed


def measure_cpu(
    threads: int | None = None,
    shape: tuple[int, int] = (4096, 4096),
    min_seconds: float = 1.0,
    progress: Callable[[str], None] = lambda s: None,
    types: tuple[str, ...] = MATVEC_TYPES,
) -> CPUProfile:
    from refengine.quants import dequantize

    threads = threads or os.cpu_count() or 1
    rng = np.random.default_rng(0)
    llc = last_level_cache_nbytes()
    today = date.today().isoformat()
    src = f"measured: refengine profile {today}, {KERNEL}"
    rows, cols = shape

    progress("host memory bandwidth")
    memory_gbps = _memory_gbps(llc, min_seconds, src)

    matvec, matmul = {}, {}
    for name in types:
        progress(f"matvec {name}")
        t = qtype(name).ggml
        one = qtype(t).row_nbytes(cols) * rows
        n = max(2, -(-2 * llc // one))  # quantized bytes of the rotation > 2x LLC
        ws = _weights(t, rows, cols, n, rng)
        xs = rng.normal(size=(n, 1, cols)).astype(np.float32)
        per = _rate(lambda i: xs[i] @ dequantize(ws[i], t, shape).T, n, min_seconds)
        matvec[name] = {threads: Figure(per * one / 1e9, f"{src}; {n} x {rows}x{cols} rotated")}
        progress(f"matmul {name}")
        dense = [dequantize(w, t, shape) for w in ws[:2]]
        row = {}
        for tokens in MATMUL_TOKENS:
            xt = rng.normal(size=(2, tokens, cols)).astype(np.float32)
            per = _rate(lambda i: xt[i] @ dense[i].T, 2, min_seconds / 2)
            row[tokens] = Figure(
                per * 2 * rows * cols * tokens / 1e9, f"{src}; BLAS after dequantize"
            )
        matmul[name] = row
    matvec[ANY_TYPE] = matvec[types[0]]
    matmul[ANY_TYPE] = matmul[types[0]]
    return CPUProfile(
        name=_cpu_name(),
        threads=threads,
        memory_gbps=memory_gbps,
        matvec_gbps=RateTable("GB/s", matvec),
        matmul_gflops=RateTable("GFLOP/s", matmul),
        sync_seconds=Figure(
            20e-6,
            "derived: typical CUDA event wait + launch of a copy, "
            "not measurable without a GPU; the kernels issue measures it",
        ),
    )


def _memory_gbps(llc: int, min_seconds: float, src: str) -> Figure:
    big = np.ones(max(2 * llc, 1 << 30) // 4, np.float32)
    per_sum = _rate(lambda i: float(big.sum()), 1, min_seconds)
    return Figure(
        per_sum * big.nbytes / 1e9, f"{src}; numpy sum of {big.nbytes >> 20} MiB, 1 thread"
    )


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
