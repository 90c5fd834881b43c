"""refengine: the user's entry point (CLI), the GGUF model layer, the tokenizer, synthetic models
and the NumPy reference engine that every faster path is checked against."""

import os

# OpenBLAS's threads spin 2^28 cycles (~0.1 s) after each product before they sleep; the CPU
# kernels' Numba threads share the same cores, so a decode right after a BLAS prompt ran 2-4x
# slow for its first ~20 tokens. 2^4 cycles: they sleep at once (before NumPy loads OpenBLAS).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
# and the other way: Numba's OpenMP (libgomp) threads spin 300,000 times after a parallel region,
# so a prompt's BLAS product right after the routed experts' q8 kernel took 8.4 ms where it took
# 4.3 alone (qwen3moe-2b pp512: 411-424 -> 446-471 t/s); 10,000 spins still bridge the gap
# between a decode's back-to-back regions (its tg128 did not slow)
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


__version__ = "0.1.0"
