"""The runtime's small kernels between the big ones: the embedding scale, a bias added to every
row, and the KV store (fp32 rows into fp16 ring cells, and into a staging strip that goes to the
host mirror). Each is checked against NumPy in tests/test_kernels.py; all fp32 (and fp16 stores),
no f64 and no stack frame (`python -m cudarun.ptx_check --out DIR`)."""

from __future__ import annotations

from .. import compat  # noqa: F401  (before numba.cuda)

from numba import cuda  # noqa: E402

from . import THREADS  # noqa: E402


@cuda.jit
def scale_rows(x, s):
    """x [T, n] *= s (a float32) in place; a warp per row."""
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    for i in range(i0, x.shape[1], THREADS):
        x[t, i] = x[t, i] * s


@cuda.jit
def add_bias(x, b):
    """x [T, n] += b [n] in place; a warp per row."""
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    for i in range(i0, x.shape[1], THREADS):
        x[t, i] = x[t, i] + b[i]


@cuda.jit
def store_kv(k, v, write, k_cache, v_cache, k_stage, v_stage):
    """Token t's K [T, n] and V [T, m] (fp32, heads flattened) into cell write[t] of k_cache
    [cells, n] and v_cache [cells, m] (fp16), and into row t of the staging strips."""
    t, i0 = cuda.blockIdx.x, cuda.threadIdx.x
    cell = write[t]
    for i in range(i0, k.shape[1], THREADS):
        h = k[t, i]
        k_cache[cell, i] = h
        k_stage[t, i] = h
    for i in range(i0, v.shape[1], THREADS):
        h = v[t, i]
        v_cache[cell, i] = h
        v_stage[t, i] = h
