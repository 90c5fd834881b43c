"""A llama.cpp RPC server (`ggml-rpc-server`) measured from here: the link's bandwidth both ways
for large copies, the round trip of a small one, the memory the server reports, and what its
device computes (`measure_rpc_compute`: matrix products of each weight type and the cost of one
graph node, run by the server on its own device and threads). llama.cpp treats such a server as a
device (`--rpc HOST:PORT`), so `refengine profile --rpc` records it as one
(`solver.profile.rpc_device`). No GPU is needed: the server is reached through `rpc_client`, a
client of ggml's RPC protocol.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from datetime import date

from refengine.errors import UserError
from refengine.quants import HOST, measured_on, qtype as as_qtype
from solver.profile import ANY_TYPE, Figure, RateTable

from .rpc_client import (DEFAULT_TIMEOUT_SECONDS, GGML_OP_ADD, GGML_OP_MUL_MAT, MIB,
                         RemoteBuffer, RpcClient, ggml_tensor)

# What llama.cpp sends an RPC device while it runs is activations between graph splits, up to
# 16 MiB (512 tokens x 8192 wide x fp32). Larger copies are slower and say little about that:
# the server receives each command into a fresh buffer, and from 32 MiB on glibc maps it anew
# per command (its mmap threshold), so every page faults (localhost on the 2-core development
# machine: 2.1 GB/s at 16 MiB, 0.95 at 256 MiB, and 0.4-0.9 from 32 MiB up when it is busy).
DEFAULT_COPY_BYTES = 16 * MIB
DEFAULT_REPEATS = 5  # medians of 5, as the CPU and GPU figures
LATENCY_BYTES = 4096  # the small copy whose round trip is the per-copy latency (as bench_gpu)
LATENCY_ROUNDS = 50
# The weight types whose products a server is timed on: those the CPU profile measures, the first
# also standing for any type not measured, as in the CPU profile.
COMPUTE_TYPES = measured_on(HOST)
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


def weight_bytes(ggml_type: str, noise) -> bytes:
    """`noise` (a numpy array of random bytes) as valid weights of `ggml_type`: the quants left
    random, each block's fp16 scales spread as a real model's are (over 2.5 binades; a minimum
    negative), F16 values likewise. What the weights hold changes the rate: on the development
    machine the server read Q4_1 at 12 GB/s from zeros, 10-11 with one scale for every block,
    5-6.5 with the scales of gguf-quantized normals, and 4.7 with scales over 7 binades (ggml
    turns each fp16 scale into fp32 through a 256 KiB table, so the wider the scales spread,
    the more of it a matvec reads)."""
    import numpy as np

    # every fp16 value of 2.5 binades, of either sign (2560 each), drawn by the noise's own bits:
    # SmolLM2-135M's Q4_1 scales span 2.5 binades (3470 distinct), its minimums 2.7 (903), its
    # Q8_0 scales 2.5 (537), between their 1st and 99th percentiles
    pool = np.exp2(np.linspace(-6, -3.5, 2560, endpoint=False)).astype(np.float16)
    pool = np.concatenate([pool, -pool])
    if ggml_type in ("F16", "F32"):
        dtype = np.float16 if ggml_type == "F16" else np.float32
        n = noise.nbytes // np.dtype(dtype).itemsize
        return pool[noise[: 2 * n].view(np.uint16) % len(pool)].astype(dtype).tobytes()
    q = as_qtype(ggml_type)
    blocks = noise[: noise.nbytes // q.block_nbytes * q.block_nbytes]
    blocks = blocks.reshape(-1, q.block_nbytes).copy()
    half = len(pool) // 2
    # the block's fp16 scales (the other bytes are quants, any value of which is valid); the
    # second scale is a minimum: negative
    for k, at in enumerate(q.scale_offsets):
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
        row_nbytes = as_qtype(qtype).row_nbytes(MATVEC_K)
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
