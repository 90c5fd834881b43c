"""Numba kernels: CUDA ones for the GPU, njit(parallel) ones for tensors a plan computes on the
CPU; both read GGUF blocks through `cudarun.blocks`."""
