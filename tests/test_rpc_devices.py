"""llama.cpp RPC servers as devices, as a user drives them: `refengine profile --rpc` measures the
session's servers on localhost (`rpc_servers`) into a profile, `solve --target llamacpp --rpc`
plans over them, `export` names them as llama.cpp does, and `verify` runs the plan in real
llama.cpp without being told the servers again."""

import json
import shlex
import socket

import pytest

from cudarun.rpc_client import RpcClient
from refengine.models import load_model, resolve_model
from solver.profile import HardwareProfile
from solver.solve import load_profile

from .conftest import refengine

MODEL = "smollm2-135m"
# budgets that hold part of SmolLM2-135M on the first server and the rest on the second; `fit`
# fills the devices in order, so both hold layers whatever the measured rates say
PLAN = ("--target", "llamacpp", "--ctx", "2048", "--tiers", "1,512", "--strategy", "fit")
BUDGETS = "60MiB,200MiB"


def one_line_error(r) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def rpc_profile(rpc_servers, tmp_path_factory):
    """A profile whose devices are the first two servers, measured (the CPU side kept from a
    shipped profile: only the servers are measured), and what the command printed."""
    out = tmp_path_factory.mktemp("rpc") / "p.json"
    r = refengine("profile", "--rpc", ",".join(rpc_servers[:2]), "--cpu-from", "h100",
                  "--quick", "-o", out)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return out, r.stdout


def _solve(profile, tmp_path, rpc, budgets=BUDGETS, name="plan.json"):
    plan = tmp_path / name
    r = refengine("solve", MODEL, "--profile", profile, "--rpc", rpc, "--budget", budgets,
                  *PLAN, "-o", plan)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return plan


def _flags(command: str) -> dict[str, str]:
    words = shlex.split(command)
    return {w: words[i + 1] for i, w in enumerate(words[:-1]) if w.startswith("-")} | {
        "order": [w for w in words if w in ("--rpc", "-dev")]
    }


def test_profile_records_each_server_as_a_device_with_its_link_and_memory(rpc_profile,
                                                                          rpc_servers):  # fmt: skip
    path, printed = rpc_profile
    prof = HardwareProfile.load(path)
    assert [(g.backend, g.endpoint) for g in prof.gpus] == [("rpc", e) for e in rpc_servers[:2]]
    for d, (g, endpoint) in enumerate(zip(prof.gpus, rpc_servers)):
        with RpcClient(endpoint) as rpc:
            _, total = rpc.device_memory(0)
        assert g.name == f"RPC {endpoint}" and g.memory_bytes.value == total
        assert f"device {d} RPC {endpoint} (llama.cpp RPC{d})" in printed
        # the link: GB/s both ways and one small round trip, measured against this server
        for fig in (g.h2d_gbps, g.d2h_gbps, g.copy_latency_seconds):
            assert fig.source.startswith("measured: refengine profile --rpc")
            assert endpoint in fig.source
        assert 0.01 < g.h2d_gbps.value < 500 and 0.01 < g.d2h_gbps.value < 500
        assert 1e-6 < g.copy_latency_seconds.value < 0.05
        # what the server computes on its own threads, not its host's CPU figures
        q4k = g.matvec_gbps.rows["Q4_K"][1]
        assert "the server's own device and threads" in q4k.source and 0.1 < q4k.value < 500
        assert g.matmul_tflops.at("Q4_K", 512) > 1e-3 and g.launch_seconds.value > 0
    # the CPU side came from the shipped profile, untouched
    assert prof.cpu == load_profile("h100").cpu


def test_solve_rpc_exports_rpc_before_dev_in_the_order_given(rpc_profile, rpc_servers,
                                                             llama_bin, tmp_path):  # fmt: skip
    e0, e1 = rpc_servers[:2]
    plan = _solve(rpc_profile[0], tmp_path, f"{e1},{e0}")  # the second server first
    d = json.loads(plan.read_text())
    assert d["fingerprint"]["rpc"] == [e1, e0]
    for fmt, sep in (("llamacpp", ","), ("llama-bench", "/")):
        r = refengine("export", plan, "--format", fmt)
        assert r.returncode == 0, r.stderr
        f = _flags(r.stdout)
        assert f["order"] == ["--rpc", "-dev"] and f["--rpc"] == f"{e1},{e0}"
        assert f["-dev"] == f"RPC0{sep}RPC1"
        assert all(int(n) > 0 for n in f["-ts"].split(sep))  # both servers hold layers
    # verify knows the servers from the plan: no --rpc
    r = refengine("verify", plan, "--llama-bin", llama_bin)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(load_model(str(resolve_model(MODEL))).tensors)
    assert f"tensors placed as planned: {n}/{n}" in r.stdout
    assert f"llama.cpp flags: --rpc {e1},{e0} " in r.stdout


def test_a_plan_over_a_local_gpu_and_a_server(rpc_profile, rpc_servers, llama_bin, tmp_path):
    """The profile's local GPU first (CUDA0), then the server (RPC0); verify's --rpc stands in
    for the local GPU, the plan's own server after it."""
    e0, e1, e2 = rpc_servers
    mixed = tmp_path / "mixed.json"
    r = refengine("profile", "--gpu-from", "h100", "--cpu-from", "h100", "--rpc", e2,
                  "--quick", "-o", mixed)  # fmt: skip
    assert r.returncode == 0, r.stderr
    prof = HardwareProfile.load(mixed)
    assert [(g.backend, g.endpoint) for g in prof.gpus] == [("cuda", ""), ("rpc", e2)]
    plan = _solve(mixed, tmp_path, e2)
    r = refengine("export", plan)
    f = _flags(r.stdout)
    assert f["order"] == ["--rpc", "-dev"] and f["--rpc"] == e2 and f["-dev"] == "CUDA0,RPC0"
    r = refengine("verify", plan, "--llama-bin", llama_bin, "--rpc", e0)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"llama.cpp flags: --rpc {e0},{e2} " in r.stdout and "-dev RPC0,RPC1" in r.stdout
    n = len(load_model(str(resolve_model(MODEL))).tensors)
    assert f"tensors placed as planned: {n}/{n}" in r.stdout


def test_a_users_mistakes_are_one_line(rpc_profile, rpc_servers, tmp_path):
    e0, e1, e2 = rpc_servers
    path = rpc_profile[0]
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        silent = f"127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "p.json"
    r = refengine("profile", "--rpc", f"{e0},{silent}", "--cpu-from", "h100", "-o", out)
    assert f"cannot reach the RPC server at {silent}" in one_line_error(r)
    assert not out.exists()  # no profile half written
    for rpc, budgets, says in [
        ("127.0.0.1", "60MiB", "is not HOST:PORT"),
        (f"{e0},{e1}", "60MiB,60MiB,60MiB", "3 budget(s) for 2 device(s)"),
        (e2, "60MiB", f"has no RPC device at {e2}"),
        (f"{e0},{e0}", "60MiB,60MiB", "names a server twice"),
    ]:
        r = refengine("solve", MODEL, "--profile", path, "--rpc", rpc, "--budget", budgets,
                      *PLAN)  # fmt: skip
        assert says in one_line_error(r), (rpc, r.stderr)
    plan = _solve(path, tmp_path, f"{e0},{e1}")
    r = refengine("verify", plan, "--rpc", e2)
    assert "leave --rpc out" in one_line_error(r)


def test_flags_name_the_plans_servers_after_its_local_gpus():
    from solver.export import on_rpc_servers
    from solver.llamacpp_check import on_rpc

    args = ["-ngl", "9", "-dev", "CUDA0,CUDA1,CUDA2", "-ot", "^a$=CUDA2,^b$=CUDA0,^c$=CPU"]
    ours = on_rpc_servers(args, ["h:1", "h:2"], first=1)  # devices 1 and 2 are servers
    assert ours == ["--rpc", "h:1,h:2", "-ngl", "9", "-dev", "CUDA0,RPC0,RPC1",
                    "-ot", "^a$=RPC0[h:2],^b$=CUDA0,^c$=CPU"]  # fmt: skip
    # verify's stand-in for the local GPU comes first, the plan's own servers after it
    assert on_rpc(ours, ["s:1"]) == ["--rpc", "s:1,h:1,h:2", "-ngl", "9", "-dev", "RPC0,RPC1,RPC2",
                                     "-ot", "^a$=RPC0[h:2],^b$=RPC0[s:1],^c$=CPU"]  # fmt: skip
