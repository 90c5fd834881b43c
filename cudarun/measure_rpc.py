"""A llama.cpp RPC server (`ggml-rpc-server`) measured from here: the link's bandwidth both ways
for large copies, the round trip of a small one, the memory the server reports, and what its
device computes (`measure_rpc_compute`: matrix products of each weight type and the cost of one
graph node, run by the server on its own device and threads). llama.cpp treats such a server as a
device (`--rpc HOST:PORT`), so `refengine profile --rpc` records it as one
(`solver.profile.rpc_device`). No GPU is needed: this is a client of ggml's RPC protocol
written with `socket` and `struct`, after the protocol of the llama.cpp vendored in
llama-cpp-python 0.3.36 (ggml/src/ggml-rpc/ggml-rpc.cpp, protocol 7.0.0).

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
import statistics
import struct
import time
from dataclasses import dataclass
from datetime import date
from enum import IntEnum

from refengine.errors import UserError
from solver.profile import ANY_TYPE, Figure, RateTable

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
# The weight types whose products a server is timed on: those the CPU profile measures
# (cudarun.measure_cpu.MATVEC_TYPES, not imported: that module loads Numba), the first also
# standing for any type not measured, as in the CPU profile.
COMPUTE_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K")
MATMUL_TOKENS = (64, 512)  # as the CPU profile's matmul rows


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
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qtype = GGMLQuantizationType[ggml_type]
    block, block_nbytes = GGML_QUANT_SIZES[qtype]
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
        tensor_id, qtype.value, buf.handle, *ne4, *nb, op, *([0] * 16), flags, *srcs, 0, 0,
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
        return _measure_link(rpc, nbytes, repeats, device)


def _measure_link(rpc: RpcClient, nbytes: int, repeats: int, device: int) -> RpcLink:
    """`measure_rpc` on a connection the caller holds."""
    endpoint = rpc.endpoint
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


def measure_rpc_device(
    endpoint: str,
    quick: bool = False,
    progress=lambda what: None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
):
    """The server at `endpoint` (its device 0) as a device of a hardware profile
    (`solver.profile.rpc_device`), measured over one connection: the link, the memory it
    reports, and what it computes. Returns (GPUProfile, RpcLink, RpcCompute)."""
    from solver.profile import rpc_device

    with RpcClient(endpoint, timeout_seconds) as rpc:
        progress(f"{endpoint}: link")
        link = _measure_link(rpc, DEFAULT_COPY_BYTES, 2 if quick else DEFAULT_REPEATS, 0)
        compute = measure_rpc_compute(rpc, 0, quick, progress=progress)
    # the rates are the server's own, measured: neither its host's CPU nor its threads needed
    device = rpc_device(None, endpoint, link.total_bytes, 0, **link.figures(), **compute.tables())
    return device, link, compute


def random_bytes(nbytes: int, seed: int = 0) -> bytes:
    import numpy as np

    return np.random.default_rng(seed).bytes(nbytes)


# What the server's device is timed on. A matvec graph reads weights of WEIGHT_NBYTES each, as
# many as fill the region: twice a 32 MiB last-level cache when quick, so that the rate is the
# memory's and not the cache's (a server's cache is not known from here); a matmul multiplies one
# weight of MATMUL_SIDE x MATMUL_SIDE by MATMUL_TOKENS columns; a node chain is NODE_CHAIN
# additions of NODE_WIDTH floats, whose time is the server's cost per graph node (its threads
# meet once a node).
WEIGHT_NBYTES = 8 * MIB
MATVEC_K = 4096
REGION_NBYTES = {True: 64 * MIB, False: 256 * MIB}
MATMUL_SIDE = {True: 1024, False: 2048}
NODE_CHAIN, NODE_WIDTH = 64, 1024
GRAPH_REPEATS = {True: 3, False: 5}
# Where each block keeps its fp16 scales (ggml-common.h: block_q8_0 {d, qs}, block_q4_1 {d, m,
# qs}, block_q4_K {d, dmin, scales, qs}, block_q6_K {ql, qh, scales, d}, ...); the other bytes are
# quants, any value of which is valid.
SCALE_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2),
                 "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def weight_bytes(ggml_type: str, noise) -> bytes:
    """`noise` (a numpy array of random bytes) as valid weights of `ggml_type`: the quants left
    random, each block's fp16 scales spread as a real model's are (over 2.5 binades; a minimum
    negative), F16 values likewise. What the weights hold changes the rate: on the development
    machine the server read Q4_1 at 12 GB/s from zeros, 10-11 with one scale for every block,
    5-6.5 with the scales of gguf-quantized normals, and 4.7 with scales over 7 binades (ggml
    turns each fp16 scale into fp32 through a 256 KiB table, so the wider the scales spread,
    the more of it a matvec reads)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    # every fp16 value of 2.5 binades, of either sign (2560 each), drawn by the noise's own bits:
    # SmolLM2-135M's Q4_1 scales span 2.5 binades (3470 distinct), its minimums 2.7 (903), its
    # Q8_0 scales 2.5 (537), between their 1st and 99th percentiles
    pool = np.exp2(np.linspace(-6, -3.5, 2560, endpoint=False)).astype(np.float16)
    pool = np.concatenate([pool, -pool])
    if ggml_type in ("F16", "F32"):
        dtype = np.float16 if ggml_type == "F16" else np.float32
        n = noise.nbytes // np.dtype(dtype).itemsize
        return pool[noise[: 2 * n].view(np.uint16) % len(pool)].astype(dtype).tobytes()
    _, block_nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    blocks = noise[: noise.nbytes // block_nbytes * block_nbytes].reshape(-1, block_nbytes).copy()
    half = len(pool) // 2
    for k, at in enumerate(SCALE_OFFSETS[ggml_type]):  # the second scale is a minimum: negative
        pick = blocks[:, at : at + 2].copy().view(np.uint16)[:, 0] % half + (half if k else 0)
        blocks[:, at : at + 2] = pool[pick].view(np.uint8).reshape(-1, 2)
    return blocks.tobytes()


@dataclass(frozen=True)
class RpcCompute:
    """What device `device` of an RPC server computes, timed from here and less the round trip
    that fences each run."""

    endpoint: str
    device: int
    matvec_gbps: dict[str, float]  # weight bytes read per second by one-token products, by type
    matmul_gflops: dict[str, dict[int, float]]  # by type and token count
    node_seconds: float  # one graph node whose work is nothing (its dispatch and the threads' join)
    region_nbytes: int  # the weights a matvec graph reads
    matmul_side: int
    repeats: int

    def tables(self) -> dict:
        """`solver.profile.rpc_device`'s compute figures (matvec_gbps, matmul_tflops,
        node_seconds), each with where it came from; the first type also stands for the rest."""
        src = (f"measured: refengine profile --rpc {date.today().isoformat()}, {self.endpoint}: "
               "the server's own device and threads")  # fmt: skip
        mv = f"{src}; MUL_MAT of 1 token over {self.region_nbytes >> 20} MiB of weights"
        mm = f"{src}; MUL_MAT {self.matmul_side}x{self.matmul_side}"
        matvec = {t: {1: Figure(v, f"{mv}, median of {self.repeats}")}
                  for t, v in self.matvec_gbps.items()}  # fmt: skip
        matmul = {t: {n: Figure(v / 1000, f"{mm} x {n} tokens, median of {self.repeats}")
                      for n, v in row.items()} for t, row in self.matmul_gflops.items()}  # fmt: skip
        first = next(iter(self.matvec_gbps))
        matvec[ANY_TYPE], matmul[ANY_TYPE] = matvec[first], matmul[first]
        return {
            "matvec_gbps": RateTable("GB/s", matvec),
            "matmul_tflops": RateTable("TFLOP/s", matmul),
            "node_seconds": Figure(
                self.node_seconds,
                f"{src}; a chain of {NODE_CHAIN} ADD nodes of {NODE_WIDTH} floats, per node",
            ),
        }


def _fence_seconds(rpc: RpcClient, device: int, rounds: int = 20) -> float:
    """The round trip of a command that answers at once: what fencing a graph adds to it."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        rpc.alignment(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _graph_seconds(rpc: RpcClient, device: int, nodes: list[int], tensors: list[bytes],
                   repeats: int, fence_seconds: float) -> float:  # fmt: skip
    """The median time the server takes to run a graph: built and run once untimed, then rerun
    `repeats` times (GRAPH_RECOMPUTE, as llama.cpp reruns an unchanged graph), each fenced."""
    rpc.graph_compute(device, nodes, tensors)
    rpc.alignment(device)
    times, fences = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        rpc.graph_recompute(device)
        rpc.alignment(device)
        times.append(time.perf_counter() - t0)
        # the fence's round trip, timed beside each run: on a loaded host the round trip drifts,
        # and a fence measured once before can exceed a short graph's whole time
        fences.append(_fence_seconds(rpc, device, 1))
    fence = min(fence_seconds, statistics.median(fences))
    # a graph faster than the fence's own jitter is still a positive time
    return max(statistics.median(times) - fence, 1e-9)


def measure_rpc_compute(
    rpc: RpcClient,
    device: int = 0,
    quick: bool = False,
    types: tuple[str, ...] = COMPUTE_TYPES,
    progress=lambda what: None,
) -> RpcCompute:
    """Times the server's device at what llama.cpp sends it: products of each weight type with
    one token (bytes read per second) and with MATMUL_TOKENS tokens (FLOP/s), over valid weights
    (`weight_bytes`) and random activations, and a chain of trivial nodes (the cost of one
    node)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    region = REGION_NBYTES[quick]
    side = MATMUL_SIDE[quick]
    repeats = GRAPH_REPEATS[quick]
    free, _ = rpc.device_memory(device)
    act_nbytes = 4 * (MATVEC_K * max(MATMUL_TOKENS) + side * max(MATMUL_TOKENS)
                      + (region // WEIGHT_NBYTES + 1) * MATVEC_K + (NODE_CHAIN + 2) * NODE_WIDTH)
    if region + act_nbytes > min(free, rpc.max_size(device)):
        raise UserError(
            f"the RPC server at {rpc.endpoint} cannot hold the {(region + act_nbytes) >> 20} MiB "
            "its compute is timed on"
        )
    weights, act = rpc.alloc(device, region), rpc.alloc(device, act_nbytes)
    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, region, dtype=np.uint8)
    rpc.clear(act)  # the outputs' pages touched; the inputs are set below
    x_nbytes = 4 * max(MATVEC_K, side) * max(MATMUL_TOKENS)
    rpc.set(act, 0, rng.normal(0.0, 1.0, x_nbytes // 4).astype(np.float32).tobytes())
    fence = _fence_seconds(rpc, device)
    ids = iter(range(1, 1 << 62))

    def leaf(ggml_type: str, buf: RemoteBuffer, offset: int, ne: tuple[int, ...]):
        tid = next(ids)
        return tid, ggml_tensor(tid, ggml_type, buf, offset, ne)

    matvec, matmul = {}, {}
    for qtype in types:
        progress(f"{rpc.endpoint}: weights of {qtype}")
        rpc.set(weights, 0, weight_bytes(qtype, noise))
        block, block_nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
        row_nbytes = MATVEC_K // block * block_nbytes
        rows = WEIGHT_NBYTES // row_nbytes
        progress(f"{rpc.endpoint}: matvec {qtype}")
        x_id, x = leaf("F32", act, 0, (MATVEC_K, 1))
        tensors, nodes, out_at = [x], [], x_nbytes
        for k in range(region // (rows * row_nbytes)):
            w_id, w = leaf(qtype, weights, k * rows * row_nbytes, (MATVEC_K, rows))
            out_id = next(ids)
            tensors += [w, ggml_tensor(out_id, "F32", act, out_at, (rows, 1), GGML_OP_MUL_MAT,
                                       (w_id, x_id))]  # fmt: skip
            nodes.append(out_id)
            out_at += 4 * rows
        seconds = _graph_seconds(rpc, device, nodes, tensors, repeats, fence)
        matvec[qtype] = len(nodes) * rows * row_nbytes / seconds / 1e9
        matmul[qtype] = {}
        for tokens in MATMUL_TOKENS:
            progress(f"{rpc.endpoint}: matmul {qtype}, {tokens} tokens")
            w_id, w = leaf(qtype, weights, 0, (side, side))
            x_id, x = leaf("F32", act, 0, (side, tokens))
            out_id = next(ids)
            out = ggml_tensor(out_id, "F32", act, x_nbytes, (side, tokens), GGML_OP_MUL_MAT,
                              (w_id, x_id))  # fmt: skip
            seconds = _graph_seconds(rpc, device, [out_id], [w, x, out], repeats, fence)
            matmul[qtype][tokens] = 2.0 * side * side * tokens / seconds / 1e9
    progress(f"{rpc.endpoint}: graph nodes")
    b_id, b = leaf("F32", act, 0, (NODE_WIDTH,))
    prev_id, prev = leaf("F32", act, x_nbytes, (NODE_WIDTH,))
    tensors, nodes = [b, prev], []
    for k in range(NODE_CHAIN):
        node_id = next(ids)
        tensors.append(ggml_tensor(node_id, "F32", act, x_nbytes + 4 * NODE_WIDTH * (k + 1),
                                   (NODE_WIDTH,), GGML_OP_ADD, (prev_id, b_id)))  # fmt: skip
        nodes.append(node_id)
        prev_id = node_id
    node_seconds = _graph_seconds(rpc, device, nodes, tensors, repeats, fence) / NODE_CHAIN
    rpc.free(weights)
    rpc.free(act)
    rpc.alignment(device)
    return RpcCompute(rpc.endpoint, device, matvec, matmul, node_seconds, region, side, repeats)
