"""Numba kernels: CUDA ones for the GPU, njit(parallel) ones for tensors a plan computes on the
CPU; both read GGUF blocks through `cudarun.blocks`."""

from numba import config

# Threads per block of the row kernels (a power of two: they reduce through shared memory). The
# simulator runs each thread as a Python thread, so there the same kernels run with 4: the code is
# identical, and the tests finish in seconds rather than minutes.
THREADS = 4 if config.ENABLE_CUDASIM else 32
