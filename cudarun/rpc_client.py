"""A client of llama.cpp's RPC protocol (`ggml-rpc-server`), written with `socket` and `struct`
after the protocol of the llama.cpp vendored in llama-cpp-python 0.3.36
(ggml/src/ggml-rpc/ggml-rpc.cpp, protocol 7.0.0): what `measure_rpc` times a server with.

The protocol, as far as it is used here (all integers little-endian, structs packed):

    request:  cmd u8 | payload size u64 | payload
    reply:    payload size u64 | payload            (only commands that answer)

The first command on a connection must be HELLO; the server serves one client at a time and
frees whatever a client left allocated when it disconnects. A tensor travels as `rpc_tensor`
(`TENSOR` below, 296 bytes); the server checks that it lies inside a buffer it allocated and
drops the connection on any request it refuses.

A graph travels as GRAPH_COMPUTE: device u32 | n_nodes u32 | node ids u64[] | n_tensors u32 |
`TENSOR`s (every tensor the nodes reach, sources first); the server builds it, computes it with
its backend, keeps it, and GRAPH_RECOMPUTE (device u32) runs the kept graph again. Neither answers:
the next command that does answers after the computation (as a copy's fence).

It leaves out the hash cache (SET_TENSOR_HASH), RDMA (we offer no transport capabilities, so the
link stays TCP) and writing the profile.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass
from enum import IntEnum

from refengine.errors import UserError
from refengine.quants import qtype

MIB = 1 << 20
# ggml-rpc.h: RPC_PROTO_MAJOR_VERSION.MINOR; a server answers with its own, and a client accepts
# the same major and a minor no newer than its own (as llama.cpp's client does)
PROTOCOL = (7, 0)
DEFAULT_TIMEOUT_SECONDS = 10.0  # connecting, and each wait for bytes once connected


class Cmd(IntEnum):
    """enum rpc_cmd (HELLO is fixed at 14 across protocol versions)."""

    ALLOC_BUFFER = 0
    GET_ALIGNMENT = 1
    GET_MAX_SIZE = 2
    BUFFER_GET_BASE = 3
    FREE_BUFFER = 4
    BUFFER_CLEAR = 5
    SET_TENSOR = 6
    GET_TENSOR = 8
    GRAPH_COMPUTE = 10
    GET_DEVICE_MEMORY = 11
    HELLO = 14
    DEVICE_COUNT = 15
    GRAPH_RECOMPUTE = 16


# of the commands above, those that do not answer
NO_REPLY = {Cmd.SET_TENSOR, Cmd.FREE_BUFFER, Cmd.BUFFER_CLEAR, Cmd.GRAPH_COMPUTE,
            Cmd.GRAPH_RECOMPUTE}  # fmt: skip
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
GGML_MAX_SRC = 10
# enum ggml_op of this protocol's ggml (ggml-rpc.h asserts GGML_OP_COUNT == 101 for 7.0.0)
GGML_OP_NONE, GGML_OP_ADD, GGML_OP_MUL_MAT = 0, 2, 29
# ggml's CPU backend skips a node without this flag (ggml_graph_compute_thread); llama.cpp's
# scheduler sets it on every node it sends
GGML_TENSOR_FLAG_COMPUTE = 16


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

    def clear(self, buf: RemoteBuffer, value: int = 0) -> None:
        """Sets every byte of `buf` (no reply): the server's memset, which also makes it touch
        every page before anything is timed on them."""
        self._send(Cmd.BUFFER_CLEAR, struct.pack("<QB", buf.handle, value))

    def graph_compute(self, device: int, nodes: list[int], tensors: list[bytes]) -> None:
        """Has the server build and compute a graph of `nodes` (ids) over `tensors` (`TENSOR`s,
        sources before the nodes that read them), and keep it (no reply)."""
        payload = b"".join([U32.pack(device), U32.pack(len(nodes)),
                            struct.pack(f"<{len(nodes)}Q", *nodes), U32.pack(len(tensors)),
                            *tensors])  # fmt: skip
        self._send(Cmd.GRAPH_COMPUTE, payload)

    def graph_recompute(self, device: int) -> None:
        """Runs the graph the server kept for `device` again (no reply), as llama.cpp does for a
        decode step whose graph did not change."""
        self._send(Cmd.GRAPH_RECOMPUTE, U32.pack(device))


def byte_tensor(buf: RemoteBuffer) -> bytes:
    """The whole buffer as one 1-D int8 tensor, which is what SET/GET_TENSOR address."""
    n = buf.nbytes
    if n >= 1 << 32:  # ne and nb are u32 in rpc_tensor
        raise UserError(f"an RPC copy of {n / MIB:.0f} MiB is above the protocol's 4 GiB")
    return TENSOR.pack(
        1, GGML_TYPE_I8, buf.handle, n, 1, 1, 1, 1, n, n, n, 0, *([0] * 16), 0,
        *([0] * 10), 0, 0, buf.base, b"refengine.measure_rpc", 0,
    )  # fmt: skip


def ggml_tensor(tensor_id: int, ggml_type: str, buf: RemoteBuffer, offset: int,
                ne: tuple[int, ...], op: int = GGML_OP_NONE, src: tuple[int, ...] = (),
                name: str = "") -> bytes:  # fmt: skip
    """A contiguous tensor of `ggml_type` (a ggml type name) with shape `ne` (innermost first) at
    `offset` in `buf`, as `TENSOR`; `op` and `src` (ids) for a node."""
    q = qtype(ggml_type)
    block, block_nbytes = q.block_elems, q.block_nbytes
    ne4 = (tuple(ne) + (1, 1, 1))[:4]
    if ne4[0] % block:
        raise ValueError(f"a row of {ggml_type} holds whole blocks of {block}")
    nb = [block_nbytes, block_nbytes * ne4[0] // block]
    nb += [nb[1] * ne4[1], nb[1] * ne4[1] * ne4[2]]
    if offset + nb[3] * ne4[3] > buf.nbytes or max(nb) >= 1 << 32:
        raise ValueError("the tensor does not fit its buffer (or rpc_tensor's u32 strides)")
    srcs = (tuple(src) + (0,) * GGML_MAX_SRC)[:GGML_MAX_SRC]
    flags = GGML_TENSOR_FLAG_COMPUTE if op != GGML_OP_NONE else 0
    return TENSOR.pack(
        tensor_id, q.ggml.value, buf.handle, *ne4, *nb, op, *([0] * 16), flags, *srcs, 0, 0,
        buf.base + offset, name.encode()[:63], 1,
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


def parse_endpoints(text: str) -> list[str]:
    """`HOST:PORT,...` as a list, each endpoint checked, none twice."""
    endpoints = [e.strip() for e in text.split(",") if e.strip()]
    if not endpoints:
        raise UserError(f"--rpc {text!r} names no server; write HOST:PORT,... (e.g. 127.0.0.1:50052)")
    for e in endpoints:
        parse_endpoint(e)
    if len(set(endpoints)) < len(endpoints):
        raise UserError(f"--rpc {text!r} names a server twice; llama.cpp takes each server once")
    return endpoints
