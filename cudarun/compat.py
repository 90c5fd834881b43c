"""The one numpy/numba compatibility shim (docs/toolchain.md). numba-cuda 0.30.4 calls
`numpy.row_stack`, which numpy 2.5 removed, at the first kernel compile; the alias restores it.
Every module that imports numba.cuda imports this first, so it is also where numba's launch-time
settings live and where the CUDA simulator gets what it lacks (warp shuffles, a fused fma, race-free
shared arrays).

It leaves the kernels alone: the simulator runs the same kernel code as the GPU."""

import os
import sys
import threading

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack

# Numba warns at every launch of a grid under 128 blocks ("low occupancy"). Most of our launches are
# that small by design (a row kernel over a few decode tokens, a graph-captured layer), so the
# warnings flood every run's output and say nothing. Through the environment, and without importing
# numba here (tests choose the simulator in the environment after importing this): numba reads its
# config at import and re-reads it at every compile when a NUMBA_* variable changed, so this holds
# for every launch. An explicit NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=1 still turns them back on.
os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
if "numba.core.config" in sys.modules:  # already read: set it there too
    sys.modules["numba.core.config"].CUDA_LOW_OCCUPANCY_WARNINGS = int(
        os.environ["NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS"]
    )

WARP = 32
FULL_MASK = 0xFFFFFFFF


def simulator_intrinsics() -> None:
    """numba-cuda 0.30's simulator has no warp shuffles, and its `cuda.fma` rounds the product
    before the add; kernels that reduce across a warp or compute an exact product error (RoPE's
    angle) would fail there or pass by luck. Under the simulator this gives it both, behaving as
    the GPU's: a shuffle waits for the lanes of its warp (all of them: the full mask), and fma
    rounds once; and a block's threads share one array per `cuda.shared.array` line, which it
    made racily. A kernel module that shuffles calls it at import (elementwise does; its
    `warp_sum` is the shared reduction); on a GPU it does nothing."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        return
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    if getattr(FakeCUDAModule, "shfl_xor_sync", None) is not None:
        return

    lock = threading.Lock()

    def exchange(module, value, source_lane):
        me = threading.current_thread()
        warp, lane = divmod(me.thread_id, WARP)
        with lock:
            if "_warps" not in module.__dict__:
                module._warps, module._lanes = {}, {}
            barrier = module._warps.get(warp)
            if barrier is None:
                size = module.blockDim.x * module.blockDim.y * module.blockDim.z
                barrier = module._warps[warp] = threading.Barrier(min(WARP, size - warp * WARP))
        module._lanes[me.thread_id] = value
        barrier.wait(timeout=60)
        src = source_lane(lane)
        got = module._lanes.get(warp * WARP + src, value) if 0 <= src < WARP else value
        barrier.wait(timeout=60)  # nobody overwrites a lane before every lane has read it
        return got

    def fma(self, a, b, c):
        if all(isinstance(v, np.float32) for v in (a, b, c)):
            # the product of two float32 is exact in float64; one rounding after the add
            return np.float32(np.float64(a) * np.float64(b) + np.float64(c))
        return a * b + c

    FakeCUDAModule.shfl_xor_sync = lambda m, mask, v, lane_mask: exchange(
        m, v, lambda lane: lane ^ lane_mask
    )
    FakeCUDAModule.shfl_down_sync = lambda m, mask, v, delta: exchange(
        m, v, lambda lane: lane + delta
    )
    FakeCUDAModule.shfl_up_sync = lambda m, mask, v, delta: exchange(
        m, v, lambda lane: lane - delta
    )
    FakeCUDAModule.shfl_sync = lambda m, mask, v, src: exchange(m, v, lambda lane: src)
    # a barrier of the warp's lanes (the shuffles' barrier: a block's first 32 threads)
    FakeCUDAModule.syncwarp = lambda m, mask=FULL_MASK: exchange(m, None, lambda lane: lane)
    FakeCUDAModule.fma = fma
    _shared_arrays_made_once()


def _shared_arrays_made_once() -> None:
    """The simulator makes a block's shared array when the first thread reaches its line: it
    looks the line up, and if nothing is there makes an array and stores it, unlocked. Two
    threads between the lookup and the store each keep an array of their own, so a kernel whose
    threads read each other's cells reads garbage, at random (CI's qwen3moe decode: normwise 1.29).
    Made under a lock, every thread gets the one array, as on the GPU."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support

    made = FakeCUDAShared.array
    lock = threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory or refused: no lookup
            return made(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = sys._getframe(1)
        line = (caller.f_code.co_filename, caller.f_lineno)  # the simulator's key, as it is
        with lock:
            held = self._allocations.get(line)
            if held is None:
                held = self._allocations[line] = np.empty(shape, dtype)
        return held

    FakeCUDAShared.array = array
