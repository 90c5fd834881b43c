"""refengine: the user's entry point (CLI), the GGUF model layer, the tokenizer, synthetic models
and the NumPy reference engine that every faster path is checked against."""

import os

# OpenBLAS's threads spin 2^28 cycles (~0.1 s) after each product before they sleep; the CPU
# kernels' Numba threads share the same cores, so a decode right after a BLAS prompt ran 2-4x
# slow for its first ~20 tokens. 2^4 cycles: they sleep at once (before NumPy loads OpenBLAS).
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


__version__ = "0.1.0"
