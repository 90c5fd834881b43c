"""What the CUDA simulator is given by `cudarun.compat` to behave as a GPU does."""

import sys
import threading

import pytest
from numba import config, float32

from cudarun import compat

pytestmark = pytest.mark.skipif(
    not config.ENABLE_CUDASIM, reason="the kernels run on the GPU here, not the simulator"
)


def test_every_thread_of_a_block_gets_the_one_shared_array():
    """A block's 64 threads reach the same `cuda.shared.array` line at once, many times over, with
    the interpreter switching threads as often as it can: one array each time (the simulator's own
    lookup-then-store gave two or more in about one launch in five)."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    compat.simulator_intrinsics()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(50):
            module = FakeCUDAModule((1, 1, 1), (64, 1, 1), 0)
            start, got = threading.Barrier(64), [None] * 64

            def thread(i):
                start.wait()
                got[i] = module.shared.array(8, float32)

            threads = [threading.Thread(target=thread, args=(i,)) for i in range(64)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len({id(a) for a in got}) == 1
            assert got[0].dtype == "float32" and got[0].shape == (8,)
    finally:
        sys.setswitchinterval(interval)


def test_two_lines_get_two_shared_arrays():
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    compat.simulator_intrinsics()
    module = FakeCUDAModule((1, 1, 1), (1, 1, 1), 0)
    a = module.shared.array(4, float32)
    b = module.shared.array(4, float32)
    assert a is not b
