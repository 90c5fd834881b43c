"""cudarun.measure_rpc and its rpc_client against real llama.cpp RPC servers (the session's `rpc_servers`): bytes
set and got back equal prove the framing and the tensor layout, the memory agrees with what
llama.cpp itself lists for the device, and what a user can get wrong is one line."""

import re
import socket
import subprocess
import threading
import time

import numpy as np
import pytest

from cudarun.measure_rpc import measure_rpc
from cudarun.rpc_client import HELLO_REPLY, MIB, U64, Cmd, RpcClient, check_protocol
from refengine.errors import UserError


def one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert msg and "\n" not in msg
    return msg


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_random_bytes_set_at_offsets_come_back_equal(rpc_servers):
    rng = np.random.default_rng(7)
    nbytes = MIB + 37  # not a multiple of anything the server might round to
    with RpcClient(rpc_servers[0]) as rpc:
        assert rpc.protocol == "7.0.0"
        buf = rpc.alloc(0, nbytes)
        assert buf.nbytes >= nbytes and buf.base % rpc.alignment(0) == 0
        data = rng.bytes(nbytes)
        rpc.set(buf, 0, data)
        patch = rng.bytes(4099)
        rpc.set(buf, 12345, patch)  # a second write, inside the first
        want = data[:12345] + patch + data[12345 + len(patch):]
        back = bytearray(nbytes)
        rpc.get(buf, 0, memoryview(back))
        assert back == want
        middle = bytearray(1000)
        rpc.get(buf, 12000, memoryview(middle))  # a read at an offset
        assert middle == want[12000:13000]
        rpc.free(buf)


def test_a_freed_buffer_is_gone_from_the_server(rpc_servers):
    with RpcClient(rpc_servers[0]) as rpc:
        buf = rpc.alloc(0, MIB)
        rpc.free(buf)
        # the server drops a client that names a buffer it does not hold
        with pytest.raises(UserError) as e:
            rpc.call(Cmd.BUFFER_GET_BASE, U64.pack(buf.handle), U64.size)
        assert "closed the connection during BUFFER_GET_BASE" in one_line(e)
    with RpcClient(rpc_servers[0]) as rpc:  # and serves the next one
        assert rpc.device_count() == 1


def test_memory_is_what_llama_cpp_lists_for_the_device(rpc_servers, llama_bin):
    ep = rpc_servers[1]
    with RpcClient(ep) as rpc:
        free, total = rpc.device_memory(0)
    assert 0 < free <= total
    out = subprocess.run(
        [str(llama_bin / "llama-completion"), "--rpc", ep, "--list-devices"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    m = re.search(rf"RPC0: {re.escape(ep)} \((\d+) MiB, (\d+) MiB free\)", out.stdout + out.stderr)
    assert m, out.stdout + out.stderr
    assert total // MIB == int(m[1])
    # a CPU server reports its host's memory as free; allow for a device whose use moves
    assert abs(free // MIB - int(m[2])) <= max(64, int(m[1]) // 100)


def test_the_link_measured_in_gb_per_second_and_seconds(rpc_servers):
    from solver.profile import rpc_device
    from solver.solve import load_profile

    link = measure_rpc(rpc_servers[2], nbytes=4 * MIB, repeats=2)
    assert link.endpoint == rpc_servers[2] and link.device_name == f"RPC {rpc_servers[2]}"
    assert link.copy_bytes == 4 * MIB and link.device_count == 1 and link.protocol == "7.0.0"
    # GB/s: localhost moves MB/s at the least and not TB/s; bytes/s or GiB-ms would fall outside
    assert 0.01 < link.h2d_gbps < 500 and 0.01 < link.d2h_gbps < 500
    # one small round trip on localhost: microseconds to milliseconds, not a whole copy
    assert 1e-6 < link.latency_seconds < 0.05
    assert link.latency_seconds < link.copy_bytes / (link.d2h_gbps * 1e9)
    assert 0 < link.free_bytes <= link.total_bytes and link.alignment_bytes > 0
    # the figures are what the profile's RPC device takes
    cpu = load_profile("rtx4090-epyc-7742").cpu
    dev = rpc_device(cpu, link.endpoint, link.total_bytes, 2, **link.figures())
    assert dev.h2d_gbps.value == link.h2d_gbps and dev.d2h_gbps.value == link.d2h_gbps
    assert dev.copy_latency_seconds.value == link.latency_seconds
    assert dev.h2d_gbps.source.startswith("measured: refengine profile --rpc")


def test_an_unreachable_endpoint_is_one_line():
    ep = f"127.0.0.1:{free_port()}"  # nothing listens there now
    with pytest.raises(UserError) as e:
        measure_rpc(ep)
    assert one_line(e).startswith(f"cannot reach the RPC server at {ep}:")
    for bad in ("localhost", "127.0.0.1:", "127.0.0.1:http", "127.0.0.1:70000"):
        with pytest.raises(UserError) as e:
            measure_rpc(bad)
        assert "is not HOST:PORT" in one_line(e)
    for kw in ({"nbytes": 4 << 30}, {"nbytes": 100}, {"repeats": 0}):  # refused before connecting
        with pytest.raises(UserError) as e:
            measure_rpc(ep, **kw)
        assert "up to 4 GiB" in one_line(e)


def test_a_device_the_server_lacks_is_one_line(rpc_servers):
    with pytest.raises(UserError) as e:
        measure_rpc(rpc_servers[0], nbytes=MIB, repeats=1, device=3)
    assert "has 1 device(s); no device 3" in one_line(e)


def test_a_server_busy_with_another_client_is_one_line(rpc_servers):
    with RpcClient(rpc_servers[0]):  # ggml-rpc-server serves one client at a time
        with pytest.raises(UserError) as e:
            RpcClient(rpc_servers[0], timeout_seconds=0.5)
    assert "did not complete an RPC handshake" in one_line(e)
    # the server lives on: it later reads the abandoned HELLO, and answering it into a closed
    # (not reset) socket would have killed it with SIGPIPE
    time.sleep(0.2)
    with RpcClient(rpc_servers[0]) as rpc:
        assert rpc.device_count() == 1


def peer(reply: bytes | None) -> tuple[str, threading.Thread]:
    """A TCP peer on localhost that reads one HELLO (cmd, size, 24 caps bytes) and answers
    `reply` (None: closes without answering): another version of the protocol, or none."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve():
        with srv:
            conn, _ = srv.accept()
            with conn:
                got = b""
                while len(got) < 1 + 8 + 24:
                    chunk = conn.recv(64)
                    if not chunk:
                        break
                    got += chunk
                assert got[0] == Cmd.HELLO and U64.unpack(got[1:9])[0] == 24
                if reply is not None:
                    conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"127.0.0.1:{srv.getsockname()[1]}", t


def test_another_protocol_version_is_refused_in_one_line():
    ep, t = peer(U64.pack(HELLO_REPLY.size) + HELLO_REPLY.pack(8, 0, 0, bytes(24)))
    with pytest.raises(UserError) as e:
        RpcClient(ep)
    t.join(5)
    assert "speaks protocol 8.0.0; refengine speaks 7.0" in one_line(e)
    # llama.cpp's rule: the same major, a minor no newer than ours
    check_protocol("h:1", 7, 0, 9)
    with pytest.raises(UserError):
        check_protocol("h:1", 7, 1, 0)
    with pytest.raises(UserError):
        check_protocol("h:1", 6, 0, 0)


def test_a_peer_that_is_not_an_rpc_server_is_one_line():
    ep, t = peer(None)  # an older server closes on a HELLO with capabilities, as does this
    with pytest.raises(UserError) as e:
        RpcClient(ep)
    t.join(5)
    assert f"{ep} did not complete an RPC handshake" in one_line(e)


def test_a_graph_the_server_computes_is_numpys_product(rpc_servers):
    """GRAPH_COMPUTE of one MUL_MAT over the weights `weight_bytes` makes, as the compute
    measurement sends it: the server's product is the one numpy takes of the same blocks
    dequantized by gguf (up to ggml quantizing the activations to 8 bits)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    from cudarun.measure_rpc import weight_bytes
    from cudarun.rpc_client import GGML_OP_MUL_MAT, ggml_tensor

    rng = np.random.default_rng(3)
    k, n, m = 512, 48, 3  # rows of two K-quant blocks; three tokens
    x = rng.normal(0.0, 1.0, (m, k)).astype(np.float32)
    with RpcClient(rpc_servers[1]) as rpc:
        for qtype in ("F16", "Q8_0", "Q4_1", "Q4_K", "Q6_K"):
            t = GGMLQuantizationType[qtype]
            block, block_nbytes = GGML_QUANT_SIZES[t]
            nbytes = n * k // block * block_nbytes
            raw = weight_bytes(qtype, rng.integers(0, 256, nbytes, dtype=np.uint8))
            blocks = np.frombuffer(raw, np.uint8)
            w = quants.dequantize(blocks.view(np.float16) if qtype == "F16"
                                  else blocks.reshape(-1, block_nbytes), t).reshape(n, k)  # fmt: skip
            buf = rpc.alloc(0, 4 * MIB)
            rpc.set(buf, 0, raw)
            rpc.set(buf, MIB, x.tobytes())
            tensors = [ggml_tensor(1, qtype, buf, 0, (k, n)), ggml_tensor(2, "F32", buf, MIB, (k, m)),
                       ggml_tensor(3, "F32", buf, 2 * MIB, (n, m), GGML_OP_MUL_MAT, (1, 2))]  # fmt: skip
            rpc.graph_compute(0, [3], tensors)
            out = bytearray(4 * n * m)
            rpc.get(buf, 2 * MIB, memoryview(out))  # answered after the graph ran
            got = np.frombuffer(out, np.float32).reshape(m, n)
            want = x @ w.T
            assert np.isfinite(want).all() and np.abs(want).max() > 0
            assert np.linalg.norm(got - want) < 0.02 * np.linalg.norm(want), qtype
            rpc.free(buf)


def test_weights_are_timed_on_scales_spread_like_a_models():
    """The server reads weights faster the fewer distinct fp16 scales they hold (ggml converts
    each through a table): the timed weights are valid blocks whose scales spread over 2.5
    binades as SmolLM2-135M's do, a minimum below zero."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    from cudarun.measure_rpc import COMPUTE_TYPES, weight_bytes
    from refengine.quants import QTYPES

    noise = np.random.default_rng(0).integers(0, 256, 4 * MIB, dtype=np.uint8)
    for qtype in COMPUTE_TYPES:
        t = GGMLQuantizationType[qtype]
        raw = np.frombuffer(weight_bytes(qtype, noise), np.uint8)
        if qtype == "F16":
            assert np.isfinite(raw.view(np.float16)).all()
            assert len(np.unique(raw.view(np.uint16))) > 4000
            continue
        blocks = raw.reshape(-1, GGML_QUANT_SIZES[t][1])
        assert np.isfinite(quants.dequantize(blocks[:4096], t)).all(), qtype
        for i, at in enumerate(QTYPES[t].scale_offsets):
            scales = blocks[:, at : at + 2].copy().view(np.float16).ravel().astype(np.float64)
            spread = np.log2(np.abs(scales))
            assert len(np.unique(scales)) > 2000 and 2 < spread.max() - spread.min() < 3, qtype
            assert (scales < 0).all() if i else (scales > 0).all(), qtype


def test_the_servers_compute_is_measured_on_its_own_threads(rpc_servers):
    from cudarun.measure_rpc import measure_rpc_compute
    from solver.profile import rpc_device

    with RpcClient(rpc_servers[2]) as rpc:
        c = measure_rpc_compute(rpc, quick=True, types=("Q4_1", "Q8_0"))
    # GB/s of weights and GFLOP/s: a one-thread server reads GB/s, not bytes or TB/s
    assert all(0.1 < v < 500 for v in c.matvec_gbps.values())
    assert all(1 < v < 1e5 for row in c.matmul_gflops.values() for v in row.values())
    assert 1e-8 < c.node_seconds < 1e-3  # a node costs nanoseconds to microseconds
    link = measure_rpc(rpc_servers[2], nbytes=4 * MIB, repeats=1)
    dev = rpc_device(None, link.endpoint, link.total_bytes, 0, **link.figures(), **c.tables())
    assert dev.matvec_gbps.at("Q4_1", 1) == c.matvec_gbps["Q4_1"]
    assert dev.matvec_gbps.at("Q6_K", 1) == c.matvec_gbps["Q4_1"]  # the first type stands in
    assert dev.matmul_tflops.at("Q8_0", 512) == pytest.approx(c.matmul_gflops["Q8_0"][512] / 1e3)
    assert dev.graph_kernel_seconds.value == c.node_seconds and dev.is_rpc
    assert rpc_servers[2] in dev.matvec_gbps.rows["Q4_1"][1].source
