"""A llama.cpp RPC server (`ggml-rpc-server`) measured from here: the link's bandwidth both ways
for large copies, the round trip of a small one, and the memory the server reports. llama.cpp
treats such a server as a device (`--rpc HOST:PORT`), so `refengine profile --rpc` records it as
one (`solver.profile.rpc_device`). No GPU is needed: this is a client of ggml's RPC protocol
written with `socket` and `struct`, after the protocol of the llama.cpp vendored in
llama-cpp-python 0.3.36 (ggml/src/ggml-rpc/ggml-rpc.cpp, protocol 7.0.0).

The protocol, as far as it is used here (all integers little-endian, structs packed):

    request:  cmd u8 | payload size u64 | payload
    reply:    payload size u64 | payload            (only commands that answer)

The first command on a connection must be HELLO; the server serves one client at a time and
frees whatever a client left allocated when it disconnects. A tensor travels as `rpc_tensor`
(`TENSOR` below, 296 bytes); the server checks that it lies inside a buffer it allocated and
drops the connection on any request it refuses.

It leaves out graph computation, the hash cache (SET_TENSOR_HASH), RDMA (we offer no transport
capabilities, so the link stays TCP) and writing the profile.
"""

from __future__ import annotations

import socket
import statistics
import struct
import time
from dataclasses import dataclass
from datetime import date
from enum import IntEnum

from refengine.errors import UserError
from solver.profile import Figure

MIB = 1 << 20
# ggml-rpc.h: RPC_PROTO_MAJOR_VERSION.MINOR; a server answers with its own, and a client accepts
# the same major and a minor no newer than its own (as llama.cpp's client does)
PROTOCOL = (7, 0)
# What llama.cpp sends an RPC device while it runs is activations between graph splits, up to
# 16 MiB (512 tokens x 8192 wide x fp32). Larger copies are slower and say little about that:
# the server receives each command into a fresh buffer, and from 32 MiB on glibc maps it anew
# per command (its mmap threshold), so every page faults (localhost on the 2-core development
# machine: 2.1 GB/s at 16 MiB, 0.95 at 256 MiB, and 0.4-0.9 from 32 MiB up when it is busy).
DEFAULT_COPY_BYTES = 16 * MIB
DEFAULT_REPEATS = 5  # medians of 5, as the CPU and GPU figures
LATENCY_BYTES = 4096  # the small copy whose round trip is the per-copy latency (as bench_gpu)
LATENCY_ROUNDS = 50
DEFAULT_TIMEOUT_SECONDS = 10.0  # connecting, and each wait for bytes once connected


class Cmd(IntEnum):
    """enum rpc_cmd (HELLO is fixed at 14 across protocol versions)."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    SET_TENSOR = 6
    GET_TENSOR = 8
    GET_DEVICE_MEMORY = 11
    HELLO = 14
    DEVICE_COUNT = 15


NO_REPLY = {Cmd.SET_TENSOR, Cmd.FREE_BUFFER}  # of the commands above, those that do not answer
CONN_CAPS = 24  # RPC_CONN_CAPS_SIZE: transport capabilities, all zero = TCP only
HELLO_REPLY = struct.Struct(f"<BBBx{CONN_CAPS}s")  # major, minor, patch, pad, caps
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
U64X2 = struct.Struct("<QQ")
HEADER = struct.Struct("<BQ")  # cmd, payload size
# rpc_tensor: id u64, type u32, buffer u64, ne u32[4], nb u32[4], op u32, op_params i32[16],
# flags i32, src u64[10], view_src u64, view_offs u64, data u64, name char[64], use_count i32
TENSOR = struct.Struct("<QIQ4I4II16ii10QQQQ64si")
assert TENSOR.size == 296
SET_TENSOR_HEAD = struct.Struct(f"<{TENSOR.size}sBQ")  # tensor, cache flag, offset; then data
GET_TENSOR_REQ = struct.Struct(f"<{TENSOR.size}sQQ")  # tensor, offset, size
GGML_TYPE_I8 = 24  # one byte per element: a tensor of n elements is n bytes


@dataclass(frozen=True)
class RpcLink:
    """One device of an RPC server as seen over the link from here."""

    endpoint: str  # host:port
    device: int  # index among the server's devices
    device_count: int
    device_name: str  # the name solver.profile.rpc_device gives it
    protocol: str  # the server's protocol version, major.minor.patch
    free_bytes: int  # the device's memory as the server reports it, before our buffer
    total_bytes: int
    alignment_bytes: int  # of the device's buffers
    max_buffer_bytes: int  # the largest buffer the device allocates
    copy_bytes: int  # the size of each timed copy
    repeats: int
    h2d_gbps: float  # SET_TENSOR of copy_bytes, fenced by a small round trip; 1e9 bytes/s
    d2h_gbps: float  # GET_TENSOR of copy_bytes
    latency_seconds: float  # one GET_TENSOR of LATENCY_BYTES, request to last byte

    def figures(self) -> dict[str, Figure]:
        """The link's figures as `solver.profile.rpc_device` takes them (h2d_gbps, d2h_gbps,
        latency_seconds), each with where it came from."""
        src = f"measured: refengine profile --rpc {date.today().isoformat()}, {self.endpoint}"
        copies = f"{self.copy_bytes >> 20} MiB, median of {self.repeats}"
        return {
            "h2d_gbps": Figure(self.h2d_gbps, f"{src}; SET_TENSOR {copies}, fenced"),
            "d2h_gbps": Figure(self.d2h_gbps, f"{src}; GET_TENSOR {copies}"),
            "latency_seconds": Figure(
                self.latency_seconds,
                f"{src}; GET_TENSOR {LATENCY_BYTES} B round trip, median of {LATENCY_ROUNDS}",
            ),
        }


@dataclass(frozen=True)
class RemoteBuffer:
    handle: int  # the server's buffer pointer, which names the buffer in later commands
    base: int  # the address of its first byte on the server
    nbytes: int


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"RPC endpoint {endpoint!r} is not HOST:PORT (e.g. 127.0.0.1:50052)")
    return host, int(port)


class RpcClient:
    """One connection to a ggml RPC server, past HELLO. Use as a context manager; every buffer
    allocated through it is freed on close, before the connection is dropped."""

    def __init__(self, endpoint: str, timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS):
        self.endpoint = endpoint
        self._buffers: dict[int, RemoteBuffer] = {}
        self._in_sync = True  # no reply is owed: the next bytes either way start a message
        host, port = parse_endpoint(endpoint)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_seconds)
        except OSError as e:
            raise UserError(f"cannot reach the RPC server at {endpoint}: {_reason(e)}") from None
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as llama.cpp
        try:
            self.protocol = self._hello()
        except BaseException:
            self._abort()
            raise

    def __enter__(self) -> "RpcClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Frees our buffers and closes; a connection out of step is reset instead (the server
        frees a client's buffers when it goes)."""
        try:
            if self._in_sync and self._buffers:
                for buf in list(self._buffers.values()):
                    self.free(buf)
                self.alignment(0)  # a round trip: the server has done the frees
        except UserError:
            pass  # the connection is gone, and the server frees a client's buffers then
        finally:
            if self._in_sync:
                self._sock.close()
            else:
                self._abort()

    def _abort(self) -> None:
        """Closes with a reset, not a FIN: ggml-rpc-server dies of SIGPIPE when it answers a
        request (a HELLO waiting behind another client, a copy cut short) into a socket the
        client has closed, but gives up quietly on a reset one."""
        if self._sock.fileno() >= 0:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self._sock.close()

    # -- framing ----------------------------------------------------------------------------

    def _send(self, cmd: Cmd, *parts: bytes | memoryview) -> None:
        """One request; only the last part may be large (a copy's data), and it is sent as it
        is, the rest joined to the header."""
        head = HEADER.pack(cmd, sum(len(p) for p in parts))
        *small, last = parts
        self._in_sync = False
        try:
            if len(last) <= 64 * 1024:
                self._sock.sendall(b"".join([head, *small, last]))
            else:
                self._sock.sendall(b"".join([head, *small]))
                self._sock.sendall(last)
        except OSError as e:
            raise self._lost(cmd, e) from None
        self._in_sync = cmd in NO_REPLY

    def _recv_into(self, view: memoryview, cmd: Cmd) -> None:
        got = 0
        try:
            while got < len(view):
                n = self._sock.recv_into(view[got:])
                if n == 0:
                    raise self._lost(cmd, None)
                got += n
        except OSError as e:
            raise self._lost(cmd, e) from None

    def _reply(self, cmd: Cmd, into: memoryview) -> None:
        """Reads a reply whose payload must be exactly len(into) bytes."""
        head = bytearray(U64.size)
        self._recv_into(memoryview(head), cmd)
        (size,) = U64.unpack(head)
        if size != len(into):
            raise UserError(
                f"the RPC server at {self.endpoint} answered {cmd.name} with {size} bytes where "
                f"protocol {PROTOCOL[0]}.{PROTOCOL[1]} has {len(into)}: a different llama.cpp"
            )
        self._recv_into(into, cmd)
        self._in_sync = True

    def call(self, cmd: Cmd, payload: bytes, reply_nbytes: int) -> bytes:
        self._send(cmd, payload)
        out = bytearray(reply_nbytes)
        self._reply(cmd, memoryview(out))
        return bytes(out)

    def _lost(self, cmd: Cmd, e: OSError | None) -> UserError:
        why = "closed the connection" if e is None else _reason(e)
        return UserError(
            f"the RPC server at {self.endpoint} {why} during {cmd.name} "
            "(a refused request, or a server busy with another client)"
        )

    # -- commands ---------------------------------------------------------------------------

    def _hello(self) -> str:
        self._send(Cmd.HELLO, bytes(CONN_CAPS))
        out = bytearray(HELLO_REPLY.size)
        try:
            self._reply(Cmd.HELLO, memoryview(out))
        except UserError:
            raise UserError(
                f"{self.endpoint} did not complete an RPC handshake: not a ggml-rpc-server of "
                f"protocol {PROTOCOL[0]}.x (llama.cpp of llama-cpp-python 0.3.36), or busy "
                "with another client"
            ) from None
        major, minor, patch, _caps = HELLO_REPLY.unpack(out)
        version = f"{major}.{minor}.{patch}"
        check_protocol(self.endpoint, major, minor, patch)
        return version

    def device_count(self) -> int:
        return U32.unpack(self.call(Cmd.DEVICE_COUNT, b"", U32.size))[0]

    def device_memory(self, device: int) -> tuple[int, int]:
        """(free, total) bytes as the server's device reports them."""
        return U64X2.unpack(self.call(Cmd.GET_DEVICE_MEMORY, U32.pack(device), U64X2.size))

    def alignment(self, device: int) -> int:
        return U64.unpack(self.call(Cmd.GET_ALIGNMENT, U32.pack(device), U64.size))[0]

    def max_size(self, device: int) -> int:
        return U64.unpack(self.call(Cmd.GET_MAX_SIZE, U32.pack(device), U64.size))[0]

    def alloc(self, device: int, nbytes: int) -> RemoteBuffer:
        req = struct.pack("<IQ", device, nbytes)
        handle, size = U64X2.unpack(self.call(Cmd.ALLOC_BUFFER, req, U64X2.size))
        if handle == 0:
            raise UserError(
                f"the RPC server at {self.endpoint} could not allocate {nbytes / MIB:.1f} MiB "
                f"on its device {device}"
            )
        base = U64.unpack(self.call(Cmd.BUFFER_GET_BASE, U64.pack(handle), U64.size))[0]
        buf = RemoteBuffer(handle, base, size)
        self._buffers[handle] = buf
        return buf

    def free(self, buf: RemoteBuffer) -> None:
        self._send(Cmd.FREE_BUFFER, U64.pack(buf.handle))  # no reply
        self._buffers.pop(buf.handle, None)

    def set(self, buf: RemoteBuffer, offset: int, data: bytes | memoryview) -> None:
        """Writes `data` at `offset` in `buf` (no reply: the next command that answers fences
        it)."""
        head = SET_TENSOR_HEAD.pack(byte_tensor(buf), 0, offset)
        self._send(Cmd.SET_TENSOR, head, data)

    def get(self, buf: RemoteBuffer, offset: int, into: memoryview) -> None:
        """Reads len(into) bytes at `offset` in `buf` into `into`."""
        self._send(Cmd.GET_TENSOR, GET_TENSOR_REQ.pack(byte_tensor(buf), offset, len(into)))
        self._reply(Cmd.GET_TENSOR, into)


def byte_tensor(buf: RemoteBuffer) -> bytes:
    """The whole buffer as one 1-D int8 tensor, which is what SET/GET_TENSOR address."""
    n = buf.nbytes
    if n >= 1 << 32:  # ne and nb are u32 in rpc_tensor
        raise UserError(f"an RPC copy of {n / MIB:.0f} MiB is above the protocol's 4 GiB")
    return TENSOR.pack(
        1, GGML_TYPE_I8, buf.handle, n, 1, 1, 1, 1, n, n, n, 0, *([0] * 16), 0,
        *([0] * 10), 0, 0, buf.base, b"refengine.measure_rpc", 0,
    )  # fmt: skip


def check_protocol(endpoint: str, major: int, minor: int, patch: int) -> None:
    """Refuses a server whose protocol this client does not speak (llama.cpp's own rule)."""
    if major != PROTOCOL[0] or minor > PROTOCOL[1]:
        raise UserError(
            f"the RPC server at {endpoint} speaks protocol {major}.{minor}.{patch}; refengine "
            f"speaks {PROTOCOL[0]}.{PROTOCOL[1]} (llama.cpp of llama-cpp-python 0.3.36): run "
            "that build's ggml-rpc-server"
        )


def _reason(e: OSError) -> str:
    if isinstance(e, socket.timeout):
        return "no answer (timed out)"
    return e.strerror or str(e) or type(e).__name__


def measure_rpc(
    endpoint: str,
    nbytes: int = DEFAULT_COPY_BYTES,
    repeats: int = DEFAULT_REPEATS,
    device: int = 0,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
) -> RpcLink:
    """The link to device `device` of the server at `endpoint`: `repeats` timed copies of
    `nbytes` each way (medians), after one untimed pass that lets the server touch its pages,
    and the median round trip of a small read. Every copy is checked byte for byte; the buffer
    is freed on the server whatever happens."""
    if not LATENCY_BYTES <= nbytes < 1 << 32 or repeats < 1:
        raise UserError(
            f"an RPC measurement needs copies of {LATENCY_BYTES} bytes up to 4 GiB "
            "(rpc_tensor's sizes are u32) and at least 1 repeat"
        )
    with RpcClient(endpoint, timeout_seconds) as rpc:
        count = rpc.device_count()
        if not 0 <= device < count:
            raise UserError(f"the RPC server at {endpoint} has {count} device(s); no device {device}")
        free, total = rpc.device_memory(device)
        alignment, max_size = rpc.alignment(device), rpc.max_size(device)
        if nbytes > min(free, max_size):
            raise UserError(
                f"an RPC copy of {nbytes / MIB:.0f} MiB is above what the server at {endpoint} "
                f"can hold ({free / MIB:.0f} MiB free, buffers up to {max_size / MIB:.0f} MiB)"
            )
        buf = rpc.alloc(device, nbytes)
        data = random_bytes(nbytes)
        back = bytearray(nbytes)
        h2d, d2h = [], []
        for i in range(repeats + 1):  # pass 0 is the warm-up
            t0 = time.perf_counter()
            rpc.set(buf, 0, data)
            rpc.alignment(device)  # fence: answered after the server has stored the bytes
            t1 = time.perf_counter()
            rpc.get(buf, 0, memoryview(back))
            t2 = time.perf_counter()
            if back != data:
                raise RuntimeError(f"the RPC server at {endpoint} returned other bytes than sent")
            if i:
                h2d.append(t1 - t0)
                d2h.append(t2 - t1)
            back[:1] = bytes([back[0] ^ 0xFF])  # so an unread reply cannot pass as equal
        small = memoryview(bytearray(LATENCY_BYTES))
        rounds = []
        for _ in range(LATENCY_ROUNDS):
            t0 = time.perf_counter()
            rpc.get(buf, 0, small)
            rounds.append(time.perf_counter() - t0)
        rpc.free(buf)
        rpc.alignment(device)  # the free is done before we leave
    return RpcLink(
        endpoint=endpoint,
        device=device,
        device_count=count,
        device_name=f"RPC {endpoint}" if device == 0 else f"RPC {endpoint} device {device}",
        protocol=rpc.protocol,
        free_bytes=free,
        total_bytes=total,
        alignment_bytes=alignment,
        max_buffer_bytes=max_size,
        copy_bytes=nbytes,
        repeats=repeats,
        h2d_gbps=nbytes / statistics.median(h2d) / 1e9,
        d2h_gbps=nbytes / statistics.median(d2h) / 1e9,
        latency_seconds=statistics.median(rounds),
    )


def random_bytes(nbytes: int, seed: int = 0) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).bytes(nbytes)
