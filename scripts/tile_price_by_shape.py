"""Our prompt's products on int8 tiles as a ubatch runs them (the input quantized, then the
product), timed per shape on Q8_0 at 512 tokens and 2 threads, beside two prices: the old one (one
rate per type, measured at 4096 x 4096 with the quantization inside) and the cost model's (the
products' rate without it, from `bench_cpu.matmul_rate`, plus the quantization per input value).

    python scripts/tile_price_by_shape.py
"""

import statistics
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cudarun import bench_cpu  # noqa: E402
from cudarun.kernels import cpu, q8_gemm, q8_panel  # noqa: E402
from cudarun.measure_cpu import quantize_seconds  # noqa: E402

T = 512


def run(shape):
    rng = np.random.default_rng(0)
    ws = [q8_panel.repack(bench_cpu.random_weights("Q8_0", *shape, rng), Q.Q8_0, shape)
          for _ in range(2)]
    xs = [rng.standard_normal((T, shape[1])).astype(np.float32) for _ in range(2)]
    out = np.empty((T, shape[0]), np.float32)
    q8_gemm.product(ws[0], cpu.quantize_activations(xs[0]), out)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for w, x in zip(ws, xs):
            q8_gemm.product(w, cpu.quantize_activations(x), out)
        times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


with cpu.threads_set(2):
    pure = bench_cpu.matmul_rate("Q8_0", (4096, 4096), T, threads=2, runs=5, rotate_nbytes=1)
    q = quantize_seconds(quick=False, runs=5)
    print(f"pure tiles 4096x4096 {pure.gflops:.0f} GFLOP/s, quantize {q*1e9:.2f} ns a value")
    print("shape        measured ms  old price ms (ratio)  new price ms (ratio)")
    old_rate = None
    for shape in [(4096, 4096), (1024, 640), (2048, 640), (640, 2048), (1536, 576), (576, 1536),
                  (1536, 1536), (8960, 1536), (1536, 8960)]:
        m = run(shape)
        flops = 2 * shape[0] * shape[1] * T
        if old_rate is None:
            old_rate = flops / m  # the old profile's rate: 4096x4096 with the quantization in
        old = flops / old_rate
        new = flops / (pure.gflops * 1e9) + T * shape[1] * q
        print(f"{str(shape):12s} {m * 1e3:8.3f}   {old * 1e3:8.3f} ({m / old:.2f})   "
              f"{new * 1e3:8.3f} ({m / new:.2f})", flush=True)
