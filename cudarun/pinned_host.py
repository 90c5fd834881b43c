"""The CUDA engine's pinned host memory. Every copy between the host and a device goes from or to
it, so that each is asynchronous (a copy from pageable memory waits, or is staged by the driver):
the weights and the KV mirror the devices stream from (`alloc`), the staging arrays of a tier's
hand-offs, inputs and logits (`laid_out`), and the buffers of one kind of copy each (`array`).
"""

from __future__ import annotations

import numpy as np

from .cuda_device import simulated

ALIGN_BYTES = 256  # each staging array's start: what a device copy reads fastest


class PinnedHost:
    def __init__(self, cuda):
        self.cuda = cuda
        self.owners: list = []  # the driver's buffers, which have no finalizer
        self.arrays: dict = {}  # key -> its array, or its staging arrays by name

    def alloc(self, nbytes: int) -> np.ndarray:
        if simulated():
            return np.empty(nbytes, np.uint8)
        return self.cuda.pinned_array(nbytes, np.uint8)

    def laid_out(self, key, slices_of) -> dict[str, np.ndarray]:
        """Arrays of the shapes and types of the workspace slices (`solver.workspace`) that
        `slices_of()` names, in one pinned buffer, once per key."""
        if key in self.arrays:
            return self.arrays[key]
        slices = slices_of()
        sizes = {n: int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for n, s in slices.items()}
        total = sum(_aligned(b) for b in sizes.values())
        if simulated():
            buf = np.empty(max(total, 1), np.uint8)
        else:
            from . import driver

            owner = driver.PinnedHostBuffer(max(total, 1))
            self.owners.append(owner)
            buf = owner.array
        out, offset = {}, 0
        for n, sl in slices.items():
            out[n] = buf[offset : offset + sizes[n]].view(sl.dtype).reshape(sl.shape)
            offset += _aligned(sizes[n])
        self.arrays[key] = out
        return out

    def array(self, key, shape_of) -> np.ndarray:
        """A pinned array of the shape and type `shape_of()` gives, once per key: each kind of
        copy its own, so that no later copy overwrites one an earlier copy still reads."""
        if key not in self.arrays:
            shape, dtype = shape_of()
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.arrays[key] = self.alloc(max(nbytes, 1))[:nbytes].view(dtype).reshape(shape)
        return self.arrays[key]

    def close(self) -> None:
        for owner in self.owners:
            owner.free()
        self.owners, self.arrays = [], {}


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
