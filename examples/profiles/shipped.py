"""The shipped hardware profiles, each figure with its source beside it.

    .venv/bin/python examples/profiles/shipped.py     # rewrites the three JSON files here

Two client machines from the seeds, built from datasheets and public measurements only, and the lent
H100 machine from docs/toolchain.md. These were committed before any comparison against the
seeds' measurements was run, and are not to be tuned to fit them (issue 8). Figures marked
`derived` are estimates with their formula; `refengine profile` on the machine replaces them.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from solver.profile import ANY_TYPE, CPUProfile, Figure, GPUProfile, HardwareProfile, RateTable

GIB = 1024**3
HERE = Path(__file__).parent

# Public references, named once.
NVB_5090 = "public: nvbandwidth on an RTX 5090, PCIe 5.0 x16 (tinygrad/open-gpu-kernel-modules#29)"
NVB_4090 = "public: nvbandwidth on an RTX 4090, PCIe 4.0 x16, 23.9-26.4 H2D (NVIDIA/nvbandwidth#15)"
COPY_LAT = (
    "public: 5-7 us per cudaMemcpyAsync of small chunks (DualPath, arXiv 2602.21548 sec. 5.2)"
)
LAUNCH = (
    "public: ~3 us per queued launch (facebookincubator/velox#6096), 8.4 us launch + sync "
    "on an RTX 4090 (beehive-lab/TornadoVM#1023); 5 us taken"
)
GRAPH = "derived: a kernel replayed in a CUDA graph costs about a third of a host launch (1.5 us)"
HOP = (
    "derived: docs/pshard.md trace, 2.1 ms of copy-engine transitions over 57 D2H + 35 H2D "
    "copies per token = 23 us per hop"
)


def _const(unit: str, value: float, source: str, key: int = 1) -> RateTable:
    return RateTable(unit, {ANY_TYPE: {key: Figure(value, source)}})


def rtx5080_xeon() -> HardwareProfile:
    bw = 960.0
    gpu = GPUProfile(
        name="NVIDIA GeForce RTX 5080 16 GB",
        memory_bytes=Figure(16 * GIB, "datasheet: 16 GB GDDR7 (notebookcheck RTX 5080)"),
        hbm_gbps=Figure(bw, "datasheet: 960 GB/s, 256-bit GDDR7 at 30 Gbps"),
        matvec_gbps=_const(
            "GB/s",
            0.75 * bw,
            "derived: 75% of 960 GB/s, the fraction llama.cpp's "
            "decode reaches on an RTX 4090 (llama.cpp #19378: 8B Q4_0 tg128 175.4 t/s)",
        ),
        matmul_tflops=_const(
            "TFLOP/s",
            73.6,
            "derived: RTX 4090's llama.cpp pp512 rate "
            "(108 TFLOP/s) x INT8 dense TOPS ratio 450.2 / 660.6",
            key=512,
        ),
        h2d_gbps=Figure(56.3, NVB_5090),
        d2h_gbps=Figure(57.3, NVB_5090),
        copy_latency_seconds=Figure(6e-6, COPY_LAT),
        h2d_gbps_while_cpu_computes=Figure(
            27.7,
            "public: pshard authors measured 27.5-27.9 GB/s "
            "with the CPU computing (docs/pshard.md, Profiler)",
        ),
        launch_seconds=Figure(5e-6, LAUNCH),
        graph_kernel_seconds=Figure(1.5e-6, GRAPH),
    )
    host = 90.0
    cpu = CPUProfile(
        name="Intel Xeon w5-3425 (12 cores)",
        threads=12,
        memory_gbps=Figure(host, "public: llama.cpp #22692, '512 GB system RAM (peak ~90 GB/s)'"),
        matvec_gbps=RateTable(
            "GB/s",
            {
                ANY_TYPE: {
                    12: Figure(
                        0.5 * host,
                        "derived: half the host "
                        "bandwidth, as llama.cpp's CPU MUL_MAT_ID reaches on EPYC 7742 "
                        "(43-52 GB/s, docs/pshard.md)",
                    )
                }
            },
        ),
        matmul_gflops=_const(
            "GFLOP/s",
            700.0,
            "derived: 30% of fp32 peak, 12 cores x 2 AVX-512 "
            "FMA x 16 lanes x 2 x 3.1 GHz = 2.4 TFLOP/s",
            key=512,
        ),
        sync_seconds=Figure(23e-6, HOP),
    )
    return HardwareProfile(
        "rtx5080-xeon-w5-3425",
        (gpu,),
        cpu,
        "client machine of seeds 000/001; datasheets and public measurements",
    )


def rtx4090_epyc() -> HardwareProfile:
    bw = 1008.0
    gpu = GPUProfile(
        name="NVIDIA GeForce RTX 4090 24 GB",
        memory_bytes=Figure(24 * GIB, "datasheet: 24 GB GDDR6X"),
        hbm_gbps=Figure(bw, "datasheet: 1008 GB/s, 384-bit GDDR6X at 21 Gbps"),
        matvec_gbps=_const(
            "GB/s",
            0.75 * bw,
            "derived: llama.cpp #19378, llama 8B Q4_0 tg128 175.4 t/s x 4.3 GB = 0.75 of 1008 GB/s",
        ),
        matmul_tflops=_const(
            "TFLOP/s",
            108.0,
            "public: llama.cpp pp512 7980 t/s on llama 7B Q4_0 "
            "(ggml-org/llama.cpp#4766) x 2 x 6.74e9 FLOP",
            key=512,
        ),
        h2d_gbps=Figure(25.0, NVB_4090),
        d2h_gbps=Figure(26.7, "public: nvbandwidth RTX 4090 D2H 26.3-27.1 (NVIDIA/nvbandwidth#15)"),
        copy_latency_seconds=Figure(6e-6, COPY_LAT),
        h2d_gbps_while_cpu_computes=Figure(
            20.0,
            "derived (not measured): 0.8 x 25 GB/s; an 8-channel"
            " DDR4 host has about twice machine A's bandwidth, whose "
            "measured ratio was 0.49",
        ),
        launch_seconds=Figure(5e-6, LAUNCH),
        graph_kernel_seconds=Figure(1.5e-6, GRAPH),
    )
    cpu = CPUProfile(
        name="AMD EPYC 7742 (64 cores)",
        threads=64,
        memory_gbps=Figure(
            140.0,
            "derived: 68% of the 204.8 GB/s of 8-channel DDR4-3200 "
            "(Dell kbdoc 000137696), a typical STREAM fraction for Rome",
        ),
        matvec_gbps=RateTable(
            "GB/s",
            {
                ANY_TYPE: {
                    64: Figure(
                        47.5,
                        "public: llama.cpp CPU "
                        "MUL_MAT_ID 43-52 GB/s once cache hits were removed (docs/pshard.md)",
                    )
                }
            },
        ),
        matmul_gflops=_const(
            "GFLOP/s",
            1400.0,
            "derived: 30% of fp32 peak, 64 cores x 2 AVX2 FMA "
            "x 8 lanes x 2 x 2.25 GHz = 4.6 TFLOP/s",
            key=512,
        ),
        sync_seconds=Figure(23e-6, HOP),
    )
    return HardwareProfile(
        "rtx4090-epyc-7742",
        (gpu,),
        cpu,
        "client machine of llama.cpp #22691; datasheets and public measurements",
    )


def h100() -> HardwareProfile:
    notes = "docs/toolchain.md, measured 2026-11-22 with cuda-python"
    d2d = 2990.0
    gpu = GPUProfile(
        name="NVIDIA H100 80GB HBM3 (PCIe Gen5 x16)",
        memory_bytes=Figure(80 * GIB, "datasheet: 80 GB HBM3"),
        hbm_gbps=Figure(d2d, f"measured: 1 GiB D2D copy, read + write ({notes})"),
        matvec_gbps=_const(
            "GB/s",
            0.7 * d2d,
            "derived: 70% of the measured D2D rate, the kernels "
            "issue's acceptance target, until `refengine profile` measures it",
        ),
        matmul_tflops=_const(
            "TFLOP/s",
            495.0,
            "derived: half the 989 TFLOP/s dense FP16 datasheet "
            "rate, for a dequantize + cuBLAS fp16 path",
            key=512,
        ),
        h2d_gbps=Figure(54.7, f"measured: pinned H2D 54.2-55.2 GB/s ({notes})"),
        d2h_gbps=Figure(54.8, f"measured: pinned D2H 54.5-55.1 GB/s ({notes})"),
        copy_latency_seconds=Figure(6e-6, COPY_LAT),
        h2d_gbps_while_cpu_computes=Figure(
            38.0,
            "derived (not measured): 0.7 x 54.7; 16 threads read"
            " host memory at 82 GB/s, competing with the copy",
        ),
        launch_seconds=Figure(
            20e-6,
            "derived: a Numba kernel launched from Python, about 4x a C++ "
            "launch; the kernels issue measures it",
        ),
        graph_kernel_seconds=Figure(1.5e-6, GRAPH),
    )
    cpu = CPUProfile(
        name="16-core host of the H100 machine",
        threads=16,
        memory_gbps=Figure(82.0, f"measured: Numba parallel sum over 2 GiB, 16 threads ({notes})"),
        matvec_gbps=RateTable(
            "GB/s",
            {
                ANY_TYPE: {
                    1: Figure(
                        0.5 * 9.6,
                        "derived: half the 1-thread host read rate (9.6 GB/s, docs/toolchain.md)",
                    ),
                    16: Figure(0.5 * 82.0, "derived: half the 16-thread host read rate (82 GB/s)"),
                }
            },
        ),
        matmul_gflops=_const(
            "GFLOP/s", 600.0, "derived: 30% of fp32 peak of 16 AVX-512 cores (~2 TFLOP/s)", key=512
        ),
        sync_seconds=Figure(23e-6, HOP),
    )
    return HardwareProfile("h100", (gpu,), cpu, "the lent GPU machine; " + notes)


def rtx4090_rtx3060_epyc() -> HardwareProfile:
    """Two GPUs of different sizes (llama.cpp #14484's case: 24 GB cards beside small ones) on the
    EPYC host: the RTX 4090 above, and an RTX 3060 12 GB. For multi-GPU planning examples; added
    after the seed comparison, which does not use it."""
    big = rtx4090_epyc()
    bw = 360.0
    small = replace(
        big.gpus[0],
        name="NVIDIA GeForce RTX 3060 12 GB",
        memory_bytes=Figure(12 * GIB, "datasheet: 12 GB GDDR6"),
        hbm_gbps=Figure(bw, "datasheet: 360 GB/s, 192-bit GDDR6 at 15 Gbps"),
        matvec_gbps=_const("GB/s", 0.75 * bw, "derived: 75% of 360 GB/s, as for the RTX 4090"),
        matmul_tflops=_const(
            "TFLOP/s",
            16.7,
            "derived: RTX 4090's llama.cpp pp512 rate (108 TFLOP/s) x INT8 dense TOPS ratio "
            "101.9 / 660.6 (NVIDIA Ampere and Ada whitepapers)",
            key=512,
        ),
    )
    return HardwareProfile(
        "rtx4090-rtx3060-epyc-7742",
        (big.gpus[0], small),
        big.cpu,
        "two GPUs of different sizes on the EPYC 7742 host; datasheets, derived rates",
    )


SHIPPED = {
    "rtx5080-xeon-w5-3425": rtx5080_xeon,
    "rtx4090-epyc-7742": rtx4090_epyc,
    "rtx4090-rtx3060-epyc-7742": rtx4090_rtx3060_epyc,
    "h100": h100,
}

if __name__ == "__main__":
    for name, make in SHIPPED.items():
        make().save(HERE / f"{name}.json")
        print(f"wrote {HERE / name}.json")
