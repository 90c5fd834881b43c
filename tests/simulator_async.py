"""The CUDA simulator's copies, made as asynchronous as a GPU's where the host can tell: numba-cuda's
simulator performs a copy when it is issued, so a host that reads a pinned buffer before waiting
for the copy into it, or rewrites one an earlier copy still reads, passes there and is wrong on a
GPU (the layer split's CPU hand-off read fields whose copies had not landed: caught by this).

Here, for copies given a stream:
- a device-to-host copy leaves poison (NaN, or a large integer) in its destination until the host
  waits for it: a synchronize of its stream, of the context, or of an event recorded after it on
  that stream (or on a stream that waited for such an event); a later host-to-device copy on the
  same stream also lands it first, as stream order does;
- a host-to-device copy takes its data when issued, and its source must hold that data until the
  host has waited for the copy: a change before that is a hazard, and the test fails.
Kernels on different streams are not modelled; the schedule validator covers their order.
"""

from __future__ import annotations

import numpy as np

HAZARDS: list[str] = []


class _Copy:
    def __init__(self, kind: str, host: np.ndarray, data: np.ndarray):
        self.kind, self.host, self.data, self.done = kind, host, data, False

    def land(self) -> None:
        if self.done:
            return
        self.done = True
        if self.kind == "down":
            np.copyto(self.host, self.data)
        elif not np.array_equal(self.host.view(np.uint8), self.data.view(np.uint8)):
            HAZARDS.append(f"the source {self.host.shape} {self.host.dtype} of a host-to-device "
                           "copy changed before the host waited for the copy")  # fmt: skip


def _poison(a: np.ndarray) -> None:
    if a.dtype.kind == "f":
        a[...] = np.nan
    else:
        a[...] = np.iinfo(a.dtype).max // 3 if a.dtype.kind in "iu" else 0


def install() -> None:
    from numba import cuda
    from numba.cuda.simulator import api
    from numba.cuda.simulator.cudadrv import devicearray as da

    if getattr(da.FakeCUDAArray.copy_to_host, "asynchronous", False):
        return
    queues: dict[int, list[_Copy]] = {}  # id(stream) -> copies issued on it, not yet waited for

    def queue(stream) -> list[_Copy]:
        return queues.setdefault(id(stream), [])

    def land(copies) -> None:
        for c in list(copies):
            c.land()
        for key in queues:
            queues[key] = [c for c in queues[key] if not c.done]

    def asynchronous(stream) -> bool:
        return bool(stream) and not isinstance(stream, int)

    to_host, to_device = da.FakeCUDAArray.copy_to_host, da.FakeCUDAArray.copy_to_device

    def copy_to_host(self, ary=None, stream=0):
        if ary is None or not asynchronous(stream):
            return to_host(self, ary, stream)
        da.check_array_compatibility(self, ary)
        for c in queue(stream):  # an earlier upload from this memory has read it by now
            if c.kind == "up" and np.shares_memory(c.host, ary):
                c.land()
        copy = _Copy("down", ary, np.array(self._ary, copy=True))
        _poison(ary)
        queue(stream).append(copy)
        return ary

    def copy_to_device(self, ary, stream=0):
        if not asynchronous(stream) or isinstance(ary, da.FakeCUDAArray):
            return to_device(self, ary, stream)
        land([c for c in queue(stream) if c.kind == "down"])  # stream order
        to_device(self, ary, stream)
        queue(stream).append(_Copy("up", ary, np.array(ary, copy=True)))

    copy_to_host.asynchronous = True
    da.FakeCUDAArray.copy_to_host, da.FakeCUDAArray.copy_to_device = copy_to_host, copy_to_device

    def record(self, stream=0):
        self._copies = list(queue(stream)) if asynchronous(stream) else []

    def wait(self, stream=0):
        if asynchronous(stream):
            queue(stream).extend(c for c in getattr(self, "_copies", []) if not c.done)

    api.Event.record, api.Event.wait = record, wait
    api.Event.synchronize = lambda self: land(getattr(self, "_copies", []))
    api.stream.synchronize = lambda self: land(queue(self))

    def synchronize():
        land([c for copies in queues.values() for c in copies])

    api.synchronize = cuda.synchronize = synchronize
