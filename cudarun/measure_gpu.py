"""The GPU side of a hardware profile (`solver.profile.GPUProfile`), measured on this machine by
the runtime with its own kernels and copies (`cudarun.bench_gpu`): the D2D copy ceiling, matvec
rates by type and token count, the prefill path's rate, PCIe both ways, per-copy latency, H2D
while the CPU computes, and the launch, graph-kernel and synchronization costs.
"""

from __future__ import annotations

from datetime import date
from typing import Callable

from refengine.quants import GPU, measured_on
from solver.profile import ANY_TYPE, Figure, GPUProfile, RateTable

TYPES = measured_on(GPU)
MATVEC_TOKENS = (1, 16)
PREFILL_TOKENS = (64, 512)


def device_name() -> str:
    from .driver import _driver, check, init

    init()
    drv = _driver()
    dev = check(drv.cuDeviceGet(0), "cuDeviceGet")
    raw = check(drv.cuDeviceGetName(256, dev), "cuDeviceGetName")
    return raw.split(b"\0", 1)[0].decode()


def measure_gpu(quick: bool = False, progress: Callable[[str], None] = lambda s: None):
    """(GPUProfile, seconds of one CPU<->GPU synchronization)."""
    from . import bench_gpu, driver
    from refengine.quants import qtype

    src = f"measured: refengine profile {date.today().isoformat()}, cudarun kernels"
    driver.init()
    stream = driver.Stream()
    timer = bench_gpu.Timer(stream)
    shape = (4096, 4096) if quick else (4096, 14336)
    types = ("Q4_K", "Q8_0") if quick else TYPES
    progress("GPU: D2D copy")
    ceiling = bench_gpu.d2d_ceiling(stream, timer, (256 << 20) if quick else bench_gpu.GIB)
    progress("GPU: fp16 GEMM")
    gemm = bench_gpu.gemm_fp16(stream, timer)

    def rates(bench, name, counts, against):
        row = {}
        for n in counts:
            progress(f"GPU: {bench.__name__} {name} x{n}")
            r = bench(stream, timer, qtype(name).ggml, shape, n, against)
            row[n] = Figure(r.value, f"{src}; {r.what}")
        return row

    matvec = {name: rates(bench_gpu.matvec, name, MATVEC_TOKENS, ceiling) for name in types}
    matmul = {name: rates(bench_gpu.prefill, name, PREFILL_TOKENS, gemm) for name in types}
    matvec[ANY_TYPE], matmul[ANY_TYPE] = matvec["Q4_K"], matmul["Q4_K"]
    progress("GPU: PCIe")
    h2d, d2h, latency, h2d_busy = bench_gpu.pcie(stream, timer)
    progress("GPU: overheads")
    sync, launch, graph_kernel = bench_gpu.overheads(stream)
    free_total = driver.mem_info()
    gpu = GPUProfile(
        name=device_name(),
        memory_bytes=Figure(float(free_total[1]), f"{src}; cuMemGetInfo total"),
        hbm_gbps=Figure(ceiling.value, f"{src}; {ceiling.what}"),
        matvec_gbps=RateTable("GB/s", matvec),
        matmul_tflops=RateTable("TFLOP/s", matmul),
        h2d_gbps=Figure(h2d.value, f"{src}; {h2d.what}"),
        d2h_gbps=Figure(d2h.value, f"{src}; {d2h.what}"),
        copy_latency_seconds=Figure(latency.seconds, f"{src}; {latency.what}"),
        h2d_gbps_while_cpu_computes=Figure(h2d_busy.value, f"{src}; {h2d_busy.what}"),
        launch_seconds=Figure(launch.seconds, f"{src}; {launch.what}"),
        graph_kernel_seconds=Figure(graph_kernel.seconds, f"{src}; {graph_kernel.what}"),
    )
    return gpu, Figure(sync.seconds, f"{src}; {sync.what}")
