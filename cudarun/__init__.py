"""The GPU runtime: a cuda-python layer, Numba CUDA kernels, the memory map, schedules and the
executor. Built by the kernels and runtime issues; checked against `refengine.engine.NumpyEngine`."""

# OpenBLAS's thread timeout, set by `refengine` before NumPy loads OpenBLAS
import refengine  # noqa: F401
