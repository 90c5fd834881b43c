"""What the CUDA simulator is given by `cudarun.compat` to behave as a GPU does."""

import threading

import pytest
from numba import config, float32

from cudarun import compat

pytestmark = pytest.mark.skipif(
    not config.ENABLE_CUDASIM, reason="the kernels run on the GPU here, not the simulator"
)


class Rendezvous(dict):
    """The simulator's table of a block's shared arrays, holding each thread that finds a line
    empty until a second one has looked too (or half a second has passed): the interleaving that
    makes two arrays, forced instead of hoped for."""

    def __init__(self):
        super().__init__()
        self.both_looked = threading.Barrier(2, timeout=0.5)

    def get(self, key, default=None):
        found = super().get(key, default)
        if found is None:
            try:
                self.both_looked.wait()
            except threading.BrokenBarrierError:  # the other thread waits for the lock: fixed
                pass
        return found


def test_two_threads_that_both_find_the_line_empty_get_the_one_shared_array():
    """Both of a block's threads look the `cuda.shared.array` line up before either stores its
    array (the simulator's own lookup-then-store gives each an array of its own: CI's qwen3moe
    decode read garbage, normwise 1.29); made under a lock, the second waits and gets the first's."""
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    compat.simulator_intrinsics()
    module = FakeCUDAModule((1, 1, 1), (2, 1, 1), 0)
    module.shared._allocations = Rendezvous()
    got = [None, None]

    def thread(i):
        got[i] = module.shared.array(8, float32)

    threads = [threading.Thread(target=thread, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0] is got[1]
    assert got[0].dtype == "float32" and got[0].shape == (8,)


def test_two_lines_get_two_shared_arrays():
    from numba.cuda.simulator.kernelapi import FakeCUDAModule

    compat.simulator_intrinsics()
    module = FakeCUDAModule((1, 1, 1), (1, 1, 1), 0)
    a = module.shared.array(4, float32)
    b = module.shared.array(4, float32)
    assert a is not b
