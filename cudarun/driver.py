"""A thin, checked layer over the CUDA driver API (cuda-python's `cuda.bindings.driver`).

Every call goes through `check`, which turns a CUresult other than success into a `CudaError`
naming the call and the error. Without the NVIDIA driver, cuda-python raises
`DynamicLibNotFoundError` (a RuntimeError) at the first call (docs/toolchain.md); `init` turns that,
and a machine whose driver sees no device, into one `UserError` line. The objects here own driver
handles: streams (non-blocking), events, device buffers and views into them at byte offsets (the
runtime carves weights, ring and KV out of one arena), pinned host buffers (allocated or
registered), async copies, free/total memory, and stream capture into a graph and its launch. Numba
kernels run on these streams and read these buffers (`numba_stream`, `DeviceBuffer.array`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from refengine.errors import UserError

from . import compat  # noqa: F401  (before numba.cuda)

NO_GPU = (
    "no NVIDIA GPU: the CUDA driver or a device is missing here; use --engine standin (the same "
    "runtime on the host) or --engine numpy"
)


class CudaError(RuntimeError):
    """A CUDA driver call that did not succeed."""


def _driver():
    from cuda.bindings import driver

    return driver


def check(result, call: str = "CUDA call"):
    """The values of a cuda-python call `(CUresult, *values)`, or CudaError."""
    drv = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, text = drv.cuGetErrorString(err)
        detail = text.decode() if isinstance(text, bytes) else str(text)
        raise CudaError(f"{call}: {err.name}: {detail}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


_context = None


def init(device: int = 0):
    """Make device `device`'s primary context (the one Numba uses too) current; UserError when
    there is no driver or no device."""
    global _context
    if _context is not None:
        return _context
    try:
        drv = _driver()
        check(drv.cuInit(0), "cuInit")
        if check(drv.cuDeviceGetCount(), "cuDeviceGetCount") <= device:
            raise UserError(NO_GPU)
        dev = check(drv.cuDeviceGet(device), "cuDeviceGet")
        _context = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        check(drv.cuCtxSetCurrent(_context), "cuCtxSetCurrent")
    except (RuntimeError, OSError, ImportError) as e:
        if isinstance(e, CudaError) and "NO_DEVICE" not in str(e):
            raise
        why = (str(e).splitlines() or [""])[0]  # a driver too old for these bindings, say
        raise UserError(f"{NO_GPU} ({type(e).__name__}: {why})") from None
    return _context


def gpu_present() -> bool:
    try:
        init()
        return True
    except UserError:
        return False


def mem_info() -> tuple[int, int]:
    """(free, total) bytes of the current device."""
    return check(_driver().cuMemGetInfo(), "cuMemGetInfo")


class Stream:
    def __init__(self):
        drv = _driver()
        flags = drv.CUstream_flags.CU_STREAM_NON_BLOCKING
        self.handle = check(drv.cuStreamCreate(flags), "cuStreamCreate")

    @property
    def ptr(self) -> int:
        return int(self.handle)

    def synchronize(self) -> None:
        check(_driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")

    def wait(self, event: "Event") -> None:
        check(_driver().cuStreamWaitEvent(self.handle, event.handle, 0), "cuStreamWaitEvent")

    def numba_stream(self):
        """This stream as Numba sees it, to launch kernels on: `kernel[grid, block, s](...)`."""
        from numba import cuda

        return cuda.external_stream(self.ptr)

    def begin_capture(self) -> None:
        drv = _driver()
        mode = drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(drv.cuStreamBeginCapture(self.handle, mode), "cuStreamBeginCapture")

    def end_capture(self) -> "Graph":
        return Graph(check(_driver().cuStreamEndCapture(self.handle), "cuStreamEndCapture"))

    def close(self) -> None:
        if self.handle is not None:
            check(_driver().cuStreamDestroy(self.handle), "cuStreamDestroy")
            self.handle = None


class Event:
    def __init__(self, timing: bool = True):
        drv = _driver()
        flags = 0 if timing else drv.CUevent_flags.CU_EVENT_DISABLE_TIMING
        self.handle = check(drv.cuEventCreate(flags), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(_driver().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(_driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_seconds(self, since: "Event") -> float:
        ms = check(_driver().cuEventElapsedTime(since.handle, self.handle), "cuEventElapsedTime")
        return ms / 1e3


class Graph:
    """A captured graph, instantiated once and launched many times."""

    def __init__(self, graph):
        drv = _driver()
        self.graph = graph
        self.exec = check(drv.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch(self, stream: Stream) -> None:
        check(_driver().cuGraphLaunch(self.exec, stream.handle), "cuGraphLaunch")

    def close(self) -> None:
        if self.exec is not None:
            check(_driver().cuGraphExecDestroy(self.exec), "cuGraphExecDestroy")
            check(_driver().cuGraphDestroy(self.graph), "cuGraphDestroy")
            self.exec = None

    def node_count(self) -> int:
        """The kernels and copies the graph replays (the launches one replay replaces)."""
        _, count = check(_driver().cuGraphGetNodes(self.graph, 0), "cuGraphGetNodes")
        return int(count)


@dataclass
class DeviceBuffer:
    """`nbytes` of device memory at `ptr`; `owner` is None for a view into another buffer."""

    ptr: int
    nbytes: int
    owner: object = None

    @classmethod
    def alloc(cls, nbytes: int) -> "DeviceBuffer":
        ptr = check(_driver().cuMemAlloc(nbytes), "cuMemAlloc")
        return cls(int(ptr), nbytes, "self")

    def view(self, offset_bytes: int, nbytes: int) -> "DeviceBuffer":
        if offset_bytes < 0 or offset_bytes + nbytes > self.nbytes:
            raise ValueError(f"view [{offset_bytes}, +{nbytes}) outside {self.nbytes} bytes")
        return DeviceBuffer(self.ptr + offset_bytes, nbytes, None)

    def array(self, shape, dtype):
        """A Numba device array over this memory (no copy)."""
        from numba import cuda

        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        assert count * dtype.itemsize <= self.nbytes
        iface = {
            "shape": tuple(shape),
            "typestr": dtype.str,
            "data": (self.ptr, False),
            "version": 3,
            "strides": None,
        }
        holder = type("Holder", (), {"__cuda_array_interface__": iface})()
        return cuda.as_cuda_array(holder)

    def free(self) -> None:
        if self.owner == "self" and self.ptr:
            check(_driver().cuMemFree(self.ptr), "cuMemFree")
            self.ptr = 0


class PinnedHostBuffer:
    """Page-locked host memory (cuMemHostAlloc), or an existing numpy array registered as such."""

    def __init__(self, nbytes: int = 0, array: np.ndarray | None = None):
        drv = _driver()
        if array is not None:
            self.array, self.registered = array, True
            flags = drv.CU_MEMHOSTREGISTER_PORTABLE
            check(
                drv.cuMemHostRegister(array.ctypes.data, array.nbytes, flags), "cuMemHostRegister"
            )
            self.ptr, self.nbytes = array.ctypes.data, array.nbytes
        else:
            self.registered = False
            self.ptr = int(check(drv.cuMemHostAlloc(nbytes, 0), "cuMemHostAlloc"))
            self.nbytes = nbytes
            raw = (ctypes.c_uint8 * nbytes).from_address(self.ptr)
            self.array = np.frombuffer(raw, dtype=np.uint8)

    def free(self) -> None:
        drv = _driver()
        if self.registered:
            check(drv.cuMemHostUnregister(self.ptr), "cuMemHostUnregister")
        elif self.ptr:
            check(drv.cuMemFreeHost(self.ptr), "cuMemFreeHost")
        self.ptr = 0


def copy_htod(dst: DeviceBuffer, src: PinnedHostBuffer, nbytes: int, stream: Stream,
              src_offset: int = 0) -> None:  # fmt: skip
    call = _driver().cuMemcpyHtoDAsync(dst.ptr, src.ptr + src_offset, nbytes, stream.handle)
    check(call, "cuMemcpyHtoDAsync")


def copy_dtoh(dst: PinnedHostBuffer, src: DeviceBuffer, nbytes: int, stream: Stream,
              dst_offset: int = 0) -> None:  # fmt: skip
    call = _driver().cuMemcpyDtoHAsync(dst.ptr + dst_offset, src.ptr, nbytes, stream.handle)
    check(call, "cuMemcpyDtoHAsync")


def copy_dtod(dst: DeviceBuffer, src: DeviceBuffer, nbytes: int, stream: Stream) -> None:
    check(_driver().cuMemcpyDtoDAsync(dst.ptr, src.ptr, nbytes, stream.handle), "cuMemcpyDtoDAsync")
