"""cuBLAS through ctypes, for the prefill path's fp16 GEMM: one handle per stream, bound to that
stream once, its workspace a region of our own memory (`cublasSetWorkspace`). cuBLAS then
allocates no workspace pool of its own, so the budget holds it (docs/contracts.md, Budget): the
memory map reserves `solver.workspace.cublas_nbytes` in each prefill tier's workspace.

The library is the CUDA toolkit's or the nvidia-cublas wheel's, found by cuda.pathfinder (which
numba-cuda depends on). CuPy is not needed: its wrappers rebind the handle's stream on every call,
and cublasSetStream puts cuBLAS back on its own workspace pool each time.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

from refengine.errors import UserError

NEEDS_CUBLAS = ("the GPU prefill GEMM needs cuBLAS: pip install nvidia-cublas (CUDA 13) or "
                "nvidia-cublas-cu12, or install the CUDA toolkit")  # fmt: skip
# cublas_api.h and library_types.h (CUDA 12 and 13 alike)
OP_N, OP_T = 0, 1
R_32F, R_16F = 0, 2
COMPUTE_32F = 68
GEMM_DEFAULT = -1
STATUS = {1: "NOT_INITIALIZED", 3: "ALLOC_FAILED", 7: "INVALID_VALUE", 8: "ARCH_MISMATCH",
          11: "MAPPING_ERROR", 13: "EXECUTION_FAILED", 14: "INTERNAL_ERROR",
          15: "NOT_SUPPORTED"}  # fmt: skip

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "cublasCreate_v2": [ctypes.POINTER(_P)],
    "cublasDestroy_v2": [_P],
    "cublasSetStream_v2": [_P, _P],
    "cublasSetWorkspace_v2": [_P, _P, ctypes.c_size_t],
    # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
    # compute type, algorithm
    "cublasGemmEx": [_P, _I, _I, _I, _I, _I, _P, _P, _I, _I, _P, _I, _I, _P, _P, _I, _I, _I, _I],
}


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        lib = ctypes.CDLL(load_nvidia_dynamic_lib("cublas").abs_path)
    except Exception:  # noqa: BLE001 - not found, or not loadable: the same advice
        raise UserError(NEEDS_CUBLAS) from None
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, _I
    return lib


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed: CUBLAS_STATUS_{STATUS.get(status, status)}")


def pointer(array) -> int:
    return int(array.__cuda_array_interface__["data"][0])


class Blas:
    """A cuBLAS handle bound to one stream, made at its first product (a launch-counting test's
    stand-in product never needs the library); `use_workspace` names its workspace."""

    def __init__(self, stream_ptr: int):
        self.stream_ptr = stream_ptr
        self.handle = None
        self.region = None  # the workspace asked for, and the (pointer, nbytes) cuBLAS has
        self.bound = None
        self.one, self.zero = _F(1.0), _F(0.0)

    def use_workspace(self, region) -> None:
        """Work in `region` (a device uint8 array) from the next product on; the stream orders
        it against the kernels that share that memory."""
        self.region = region

    def own_workspace(self, tokens: int) -> "Blas":
        """A workspace of its own, as large as the runtime's for ubatches of `tokens` (a
        benchmark or test outside an engine's arena)."""
        from numba import cuda

        from solver.workspace import cublas_nbytes

        self.use_workspace(cuda.device_array(cublas_nbytes(tokens), np.uint8))
        return self

    def _ready(self):
        lib = library()
        if self.handle is None:
            handle = _P()
            check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
            self.handle = handle
            check(lib.cublasSetStream_v2(handle, _P(self.stream_ptr)), "cublasSetStream")
        want = (pointer(self.region), self.region.nbytes)
        if want != self.bound:
            check(lib.cublasSetWorkspace_v2(self.handle, _P(want[0]), want[1]),
                  "cublasSetWorkspace")  # fmt: skip
            self.bound = want
        return lib

    def gemm_fp16(self, x16, w16, out, out_columns: tuple[int, int] | None = None) -> None:
        """out [T, N] fp32 = x16 [T, K] fp16 times w16 [N, K] fp16 transposed, fp32 accumulation,
        or into out's columns first..first + N of a wider out when out_columns = (first, N).
        Row-major out is column-major out^T = w16 x16^T; out's row stride is cuBLAS's ldc."""
        n_tokens, k = x16.shape
        n = w16.shape[0]
        first, count = out_columns or (0, out.shape[1])
        assert w16.shape[1] == k and out.shape[0] == n_tokens and count == n
        assert 0 <= first and first + n <= out.shape[1]
        ldc = out.strides[0] // out.dtype.itemsize
        c = pointer(out) + first * out.strides[1]
        check(self._ready().cublasGemmEx(
            self.handle, OP_T, OP_N, n, n_tokens, k, ctypes.byref(self.one),
            _P(pointer(w16)), R_16F, k, _P(pointer(x16)), R_16F, k, ctypes.byref(self.zero),
            _P(c), R_32F, ldc, COMPUTE_32F, GEMM_DEFAULT,
        ), "cublasGemmEx")  # fmt: skip

    def close(self) -> None:
        if self.handle is not None:
            check(library().cublasDestroy_v2(self.handle), "cublasDestroy")
            self.handle = self.bound = None
