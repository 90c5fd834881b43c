"""One GPU of the CUDA engine, real or virtual (several budgets of one GPU are each a device):
its arena, one device allocation of its budget laid out by the plan's memory map; a compute
stream and a copy stream; its kernels over the shapes it holds (`DeviceMath`; under a tensor
split, its shares'); and its workspace arrays per tier, carved out of the arena.

It runs on numba.cuda's streams and arrays, so the same code runs under the CUDA simulator in CI;
on a GPU the streams are raw non-blocking driver streams (graph capture needs their handles).
"""

from __future__ import annotations

import os

import numpy as np

from refengine.spec import ModelSpec

from .devicemath import DeviceMath
from .schedule import Lane


def simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def new_event(cuda):
    # untimed events are cheaper; the simulator's take no arguments
    return cuda.event() if simulated() else cuda.event(False)


class CudaDevice:
    def __init__(self, cuda, index: int, budget_nbytes: int, spec: ModelSpec):
        from . import driver

        self.index = index
        self.arena = cuda.device_array(budget_nbytes, np.uint8)
        if simulated():
            self.streams = None
            self.compute, self.copy = cuda.stream(), cuda.stream()
        else:
            self.streams = driver.Stream(), driver.Stream()
            self.compute, self.copy = (st.numba_stream() for st in self.streams)
        self.math = DeviceMath(spec, self.streams[0].ptr if self.streams else 0)
        self.workspaces: dict[int, dict] = {}  # tier -> its workspace arrays

    def stream(self, lane: Lane):
        return self.copy if lane is Lane.COPY else self.compute

    def synchronize(self) -> None:
        self.compute.synchronize()
        self.copy.synchronize()

    def close(self) -> None:
        self.synchronize()
        if self.math.blas is not None:
            self.math.blas.close()
        self.arena = self.workspaces = None
