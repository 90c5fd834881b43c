"""GPU kernel and transfer rates, each beside a ceiling measured in the same run (issue 9):

- the device-to-device copy of at least 1 GiB, counting bytes read plus written (docs/toolchain.md);
- the library's fp16 GEMM (cuBLAS, `cudarun.cublas`) at the prefill shape;
- the kernels: matvec per type and token count, prefill (and its dequantization alone), decode
  and prefill attention;
- PCIe: pinned H2D/D2H bandwidth, per-copy latency, H2D while the CPU computes;
- the cost of a synchronization, of a Numba launch from Python, of a kernel inside a CUDA graph.

Timing: after a warm-up, `LAUNCHES` back-to-back launches between one event pair, over inputs
rotated across more than twice the 50 MB L2 (so weights come from HBM); the median of `RUNS`.
"""

from __future__ import annotations

import statistics
import threading
import time
import traceback
from dataclasses import dataclass
from math import nan

import numpy as np

from . import driver
from .bench_cpu import random_weights

L2_NBYTES = 50 * 10**6
LAUNCHES = 100
RUNS = 5
GIB = 1 << 30


@dataclass(frozen=True)
class Rate:
    what: str
    seconds: float  # one launch (or copy), median
    value: float  # in `unit`
    unit: str  # GB/s, TFLOP/s or us
    ceiling: float = 0.0  # the same unit's ceiling measured in this run (0: none)

    @property
    def fraction(self) -> float:
        return self.value / self.ceiling if self.ceiling > 0 else 0.0


class Timer:
    """Median seconds per launch of `launch(i)` over LAUNCHES launches between two events."""

    def __init__(self, stream: driver.Stream):
        self.stream = stream
        self.start, self.stop = driver.Event(), driver.Event()

    def per_launch(self, launch, launches: int = LAUNCHES, runs: int = RUNS) -> float:
        launch(0)  # warm-up: compiles, touches
        self.stream.synchronize()
        times = []
        for _ in range(runs):
            self.start.record(self.stream)
            for i in range(launches):
                launch(i)
            self.stop.record(self.stream)
            self.stop.synchronize()
            times.append(self.stop.elapsed_seconds(self.start) / launches)
        return statistics.median(times)


def rotation(one_nbytes: int) -> int:
    """How many copies of a tensor make the rotation exceed twice the L2."""
    return max(2, -(-2 * L2_NBYTES // one_nbytes) + 1)


def d2d_ceiling(stream, timer, nbytes: int = GIB) -> Rate:
    src, dst = driver.DeviceBuffer.alloc(nbytes), driver.DeviceBuffer.alloc(nbytes)
    try:
        s = timer.per_launch(lambda i: driver.copy_dtod(dst, src, nbytes, stream), launches=10)
    finally:
        src.free(), dst.free()
    return Rate(f"D2D copy {nbytes >> 20} MiB (read + write)", s, 2 * nbytes / s / 1e9, "GB/s")


def gemm_fp16(stream, timer, m: int = 512, n: int = 14336, k: int = 4096) -> Rate:
    from numba import cuda

    from .cublas import Blas

    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal((m, k)).astype(np.float16))
    w = cuda.to_device(rng.standard_normal((n, k)).astype(np.float16))
    out = cuda.device_array((m, n), np.float32)
    blas = Blas(stream.ptr).own_workspace(m)
    s = timer.per_launch(lambda i: blas.gemm_fp16(x, w, out))
    blas.close()
    return Rate(f"cuBLAS fp16 GEMM {m}x{n}x{k}", s, 2 * m * n * k / s / 1e12, "TFLOP/s")


def matvec(stream, timer, qtype, shape, tokens: int, ceiling: Rate) -> Rate:
    from numba import cuda

    from .kernels.matvec import matvec_gpu

    rng = np.random.default_rng(1)
    one = random_weights(qtype.name, *shape, rng)
    count = rotation(one.nbytes)
    weights = [cuda.to_device(one) for _ in range(count)]
    xs = [
        cuda.to_device(rng.standard_normal((tokens, shape[1])).astype(np.float32))
        for _ in range(count)
    ]
    out = cuda.device_array((tokens, shape[0]), np.float32)
    ns = stream.numba_stream()
    s = timer.per_launch(
        lambda i: matvec_gpu(weights[i % count], xs[i % count], out, qtype, shape, ns)
    )
    what = f"matvec {qtype.name} {shape[0]}x{shape[1]}, {tokens} token{'s' * (tokens > 1)}"
    return Rate(what, s, one.nbytes / s / 1e9, "GB/s", ceiling.value)


def prefill(stream, timer, qtype, shape, tokens: int, gemm_ceiling: Rate) -> Rate:
    from numba import cuda

    from .cublas import Blas
    from .kernels.prefill import matmul_prefill

    rng = np.random.default_rng(2)
    one = random_weights(qtype.name, *shape, rng)
    count = rotation(one.nbytes)
    weights = [cuda.to_device(one) for _ in range(count)]
    x = cuda.to_device(rng.standard_normal((tokens, shape[1])).astype(np.float32))
    out = cuda.device_array((tokens, shape[0]), np.float32)
    panel = cuda.device_array((min(shape[0], 4096), shape[1]), np.float16)
    x16 = cuda.device_array((tokens, shape[1]), np.float16)
    ns = stream.numba_stream()
    blas = Blas(stream.ptr).own_workspace(tokens)

    def launch(i):
        matmul_prefill(weights[i % count], x, out, qtype, shape, panel, x16, ns, blas)

    s = timer.per_launch(launch, launches=20)
    blas.close()
    flops = 2 * tokens * shape[0] * shape[1]
    what = f"prefill {qtype.name} {tokens}x{shape[0]}x{shape[1]} (dequant fp16 + cuBLAS)"
    return Rate(what, s, flops / s / 1e12, "TFLOP/s", gemm_ceiling.value)


def dequantize(stream, timer, qtype, shape, ceiling: Rate) -> Rate:
    """The prefill path's fp16 panel alone: bytes read plus written beside the D2D copy's."""
    from numba import cuda

    from .kernels.prefill import dequantize as run

    rng = np.random.default_rng(4)
    one = random_weights(qtype.name, *shape, rng)
    count = rotation(one.nbytes)
    weights = [cuda.to_device(one) for _ in range(count)]
    panel = cuda.device_array(shape, np.float16)
    ns = stream.numba_stream()
    s = timer.per_launch(lambda i: run(weights[i % count], panel, qtype, 0, ns))
    nbytes = one.nbytes + panel.nbytes
    what = f"dequantize {qtype.name} {shape[0]}x{shape[1]} to fp16 (read + write)"
    return Rate(what, s, nbytes / s / 1e9, "GB/s", ceiling.value)


def attention_prefill(stream, timer, ctx=4096, tokens=512, heads=32, kv_heads=8, dim=128) -> Rate:
    """A ubatch of `tokens` at the end of a `ctx` context, causal: the multiply-adds of the
    visible scores and of their V rows, per second."""
    from numba import cuda

    from .kernels.attention import attention_prefill as run

    rng = np.random.default_rng(5)
    k, v = (
        cuda.to_device(rng.standard_normal((ctx, kv_heads, dim)).astype(np.float16))
        for _ in range(2)
    )
    q = cuda.to_device(rng.standard_normal((tokens, heads, dim)).astype(np.float32))
    k_pos = cuda.to_device(np.arange(ctx, dtype=np.int64))
    q_pos = cuda.to_device(np.arange(ctx - tokens, ctx, dtype=np.int64))
    out = cuda.device_array((tokens, heads, dim), np.float32)
    ns = stream.numba_stream()
    s = timer.per_launch(lambda i: run(q, k, v, q_pos, k_pos, out, dim**-0.5, 0, ns), launches=10)
    visible = tokens * (ctx - tokens) + tokens * (tokens + 1) // 2  # (query, key) pairs
    flops = 2 * 2 * visible * heads * dim
    what = f"prefill attention {tokens} tokens at {ctx} ctx, {heads}/{kv_heads} heads, d {dim}"
    return Rate(what, s, flops / s / 1e12, "TFLOP/s")


def attention_decode(
    stream, timer, ceiling: Rate, ctx=32768, heads=32, kv_heads=8, dim=128
) -> Rate:
    from numba import cuda

    from .kernels.attention import attention_decode as run, decode_splits

    rng = np.random.default_rng(3)
    kv_nbytes = 2 * ctx * kv_heads * dim * 2
    count = rotation(kv_nbytes)
    caches = [
        tuple(
            cuda.to_device(rng.standard_normal((ctx, kv_heads, dim)).astype(np.float16))
            for _ in range(2)
        )
        for _ in range(count)
    ]
    q = cuda.to_device(rng.standard_normal((1, heads, dim)).astype(np.float32))
    k_pos = cuda.to_device(np.arange(ctx, dtype=np.int64))
    q_pos = cuda.to_device(np.array([ctx - 1], np.int64))
    splits = decode_splits(ctx, kv_heads, 1)
    partial = cuda.device_array((1, splits, heads, dim + 2), np.float32)
    out = cuda.device_array((1, heads, dim), np.float32)
    ns = stream.numba_stream()

    def launch(i):
        k, v = caches[i % count]
        run(q, k, v, q_pos, k_pos, out, dim**-0.5, 0, splits, partial, ns)

    s = timer.per_launch(launch)
    what = f"decode attention {ctx} ctx, {heads}/{kv_heads} heads, d {dim}, f16 KV"
    return Rate(what, s, kv_nbytes / s / 1e9, "GB/s", ceiling.value)


def pcie(stream, timer, nbytes: int = 256 << 20) -> list[Rate]:
    host = driver.PinnedHostBuffer(nbytes)
    dev = driver.DeviceBuffer.alloc(nbytes)
    small = 4096
    try:
        h2d = timer.per_launch(lambda i: driver.copy_htod(dev, host, nbytes, stream), launches=10)
        d2h = timer.per_launch(lambda i: driver.copy_dtoh(host, dev, nbytes, stream), launches=10)
        latency = timer.per_launch(lambda i: driver.copy_htod(dev, host, small, stream))
        busy = threading.Event()

        def cpu_work():  # the host's memory busy with a matmul's reads, as a CPU-placed layer
            a = np.ones((2048, 2048), np.float32)
            while not busy.is_set():
                a @ a

        worker = threading.Thread(target=cpu_work)
        worker.start()
        try:
            h2d_busy = timer.per_launch(
                lambda i: driver.copy_htod(dev, host, nbytes, stream), launches=10
            )
        finally:
            busy.set()
            worker.join()
    finally:
        host.free(), dev.free()
    return [
        Rate(f"H2D pinned {nbytes >> 20} MiB", h2d, nbytes / h2d / 1e9, "GB/s"),
        Rate(f"D2H pinned {nbytes >> 20} MiB", d2h, nbytes / d2h / 1e9, "GB/s"),
        Rate(f"H2D {small} B (per-copy latency)", latency, latency * 1e6, "us"),
        Rate(f"H2D pinned {nbytes >> 20} MiB, CPU busy", h2d_busy, nbytes / h2d_busy / 1e9, "GB/s"),
    ]


def overheads(stream) -> list[Rate]:
    """One synchronization, one Numba launch from Python, one kernel inside a CUDA graph."""
    from .kernels.elementwise import add

    from numba import cuda

    a = cuda.to_device(np.ones((1, 32), np.float32))
    ns = stream.numba_stream()
    add[1, 32, ns](a, a, a)
    stream.synchronize()
    n = 1000
    start = time.perf_counter()
    for _ in range(n):
        stream.synchronize()
    sync = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        add[1, 32, ns](a, a, a)
    launch = (time.perf_counter() - start) / n
    stream.synchronize()
    stream.begin_capture()
    for _ in range(LAUNCHES):
        add[1, 32, ns](a, a, a)
    graph = stream.end_capture()
    timer = Timer(stream)
    per_graph = timer.per_launch(lambda i: graph.launch(stream), launches=10)
    return [
        Rate("stream synchronize (idle)", sync, sync * 1e6, "us"),
        Rate("Numba kernel launch from Python", launch, launch * 1e6, "us"),
        Rate("kernel inside a CUDA graph", per_graph / LAUNCHES, per_graph / LAUNCHES * 1e6, "us"),
    ]


MATVEC_SHAPES = ((4096, 14336), (14336, 4096))


def run_all(types, tokens=(1, 16), shapes=MATVEC_SHAPES, failed=None):
    """Every GPU figure of the benchmark, the most wanted first, each yielded as soon as it is
    measured (a time-limited run keeps what it got). A measurement that raises is a row that says
    so, its traceback passed to `failed(what, text)`, and the table goes on."""
    from refengine.quants import qtype as as_qtype

    driver.init()
    stream = driver.Stream()
    timer = Timer(stream)

    def measured(what: str, measure) -> list[Rate]:
        try:
            got = measure()
        except Exception as e:  # noqa: BLE001 - one failed row must not lose the later ones
            if failed is not None:
                failed(what, traceback.format_exc())
            return [Rate(f"{what}: failed ({type(e).__name__}: {e})"[:200], nan, nan, "")]
        return got if isinstance(got, list) else [got]

    (ceiling,) = measured("D2D copy", lambda: d2d_ceiling(stream, timer))
    yield ceiling
    for name in types:
        for shape in shapes:
            for n in tokens:
                yield from measured(f"matvec {name} {shape} {n}", lambda: matvec(
                    stream, timer, as_qtype(name).ggml, shape, n, ceiling))  # fmt: skip
    for ctx in (8192, 32768):
        yield from measured(f"decode attention {ctx}",
                            lambda: attention_decode(stream, timer, ceiling, ctx))  # fmt: skip
    (gemm,) = measured("cuBLAS fp16 GEMM", lambda: gemm_fp16(stream, timer))
    yield gemm
    q4k = as_qtype("Q4_K").ggml
    yield from measured("prefill Q4_K",
                        lambda: prefill(stream, timer, q4k, (4096, 14336), 512, gemm))  # fmt: skip
    yield from measured("dequantize Q4_K",
                        lambda: dequantize(stream, timer, q4k, (4096, 14336), ceiling))  # fmt: skip
    yield from measured("prefill attention", lambda: attention_prefill(stream, timer))
    yield from measured("PCIe", lambda: pcie(stream, timer))
    yield from measured("overheads", lambda: overheads(stream))
