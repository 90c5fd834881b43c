"""`refengine verify` and llama.cpp's memory model, against real llama.cpp (built from the PyPI
sdist; RPC servers on localhost are its devices): every tensor where the plan says, each device's
model, KV and compute buffers within 3% + 4 MiB of the plan."""

import json

import pytest

from refengine.models import load_model, resolve_model
from solver.llamacpp_check import (
    MIB,
    DeviceBuffers,
    LoadLog,
    compare,
    on_rpc,
    parse_load_log,
    run_llamacpp,
)
from solver.memory import llamacpp_compute_nbytes

from .conftest import refengine

LOG = """\
I llama_prepare_model_devices: using device RPC0 (127.0.0.1:50052) (unknown id) - 24105 MiB free
I llama_prepare_model_devices: using device RPC1 (127.0.0.1:50053) (unknown id) - 24105 MiB free
D load_tensors: layer   0 assigned to device CPU, is_swa = 0
D load_tensors: layer   1 assigned to device RPC0, is_swa = 0
D load_tensors: layer   2 assigned to device RPC1, is_swa = 0
D tensor blk.1.ffn_up.weight (1 MiB q4_K) buffer type overridden to RPC0[127.0.0.1:50053]
D tensor blk.0.ffn_down.weight (1 MiB q4_K) buffer type overridden to CPU
I load_tensors:   CPU_Mapped model buffer size =     4.39 MiB
I load_tensors:   CPU_REPACK model buffer size =     1.00 MiB
I load_tensors: RPC0[127.0.0.1:50052] model buffer size =    28.73 MiB
I load_tensors: RPC0[127.0.0.1:50053] model buffer size =    28.02 MiB
I llama_kv_cache: RPC0[127.0.0.1:50052] KV buffer size =    20.00 MiB
I llama_kv_cache: RPC0[127.0.0.1:50053] KV buffer size =    12.00 MiB
I llama_kv_cache: RPC0[127.0.0.1:50053] KV buffer size =     2.00 MiB
I sched_reserve: RPC0[127.0.0.1:50052] compute buffer size =    26.51 MiB
I sched_reserve: RPC0[127.0.0.1:50053] compute buffer size =    26.50 MiB
I sched_reserve:        CPU compute buffer size =     8.01 MiB
"""


def test_load_log_read_back(small_models):
    spec = load_model(str(small_models["llama"]))  # 2 layers: the output layer is layer 2
    log = parse_load_log(LOG, spec)
    assert log.devices == ["RPC0", "RPC1"]
    # every single-device RPC server's buffer type is RPC0[endpoint]: RPC1's is the 50053 one
    assert log.buffers["RPC1"] == DeviceBuffers(round(28.02 * MIB), 14 * MIB, round(26.5 * MIB))
    assert log.buffers["RPC0"].kv_bytes == 20 * MIB
    assert log.buffers["CPU"].model_bytes == round(4.39 * MIB) + MIB
    t = log.tensors
    assert t["token_embd.weight"] == "CPU"
    assert t["blk.0.attn_q.weight"] == "CPU" and t["blk.0.ffn_down.weight"] == "CPU"
    assert t["blk.1.attn_q.weight"] == "RPC0" and t["blk.1.ffn_up.weight"] == "RPC1"
    assert t["output_norm.weight"] == "RPC1" and t["output.weight"] == "RPC1"


def test_flags_moved_onto_rpc_servers():
    args = ["-ngl", "9", "-dev", "CUDA0,CUDA1", "-ot", "^blk\\.(3)\\.ffn_up$=CUDA1,^x$=CPU"]
    eps = ["127.0.0.1:1", "127.0.0.1:2"]
    assert on_rpc(args, eps) == [
        "--rpc", "127.0.0.1:1,127.0.0.1:2", "-ngl", "9", "-dev", "RPC0,RPC1",
        "-ot", "^blk\\.(3)\\.ffn_up$=RPC0[127.0.0.1:2],^x$=CPU",
    ]  # fmt: skip


def test_a_run_that_reports_no_buffer_is_run_once_more_then_refused(monkeypatch, tmp_path):
    """llama.cpp has exited 0 printing nothing under load: verify must not read that as a
    device that allocated nothing."""
    import subprocess

    from refengine.errors import UserError
    from solver import llamacpp_check

    runs = []

    def silent(cmd, **kw):
        runs.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(llamacpp_check.subprocess, "run", silent)
    monkeypatch.setattr(llamacpp_check, "llama_binary", lambda d, name: tmp_path / name)
    with pytest.raises(UserError, match="without reporting a buffer it allocated"):
        run_llamacpp(tmp_path, "m.gguf", ["-ngl", "1"])
    assert len(runs) == 2


def test_compare_names_misplaced_tensors_and_budgets():
    d = {
        "fingerprint": {"budget_bytes": [100 * MIB]},
        "memory_worst": {"0": {"weights": 50 * MIB, "kv": 10 * MIB, "compute": 30 * MIB}},
    }
    log = LoadLog(["RPC0"], {"a": "RPC0", "b": "CPU"}, {"RPC0": DeviceBuffers(50 * MIB, 10 * MIB,
                                                                           45 * MIB)})
    v = compare(d, {"a": "RPC0", "b": "RPC0"}, log, ["RPC0"])
    assert v.misplaced == [("b", "RPC0", "CPU")]
    (row,) = v.rows
    assert row.planned.compute_bytes == 30 * MIB
    assert not row.within_budget and not row.within_tolerance and not v.ok


# (model, ubatch, context, flash attention): the cases each term of the model dominates
MATRIX = [
    ("smollm2-135m", 1024, 2048, True),  # the head: 4 x (n_vocab + n_embd) per row
    ("smollm2-135m", 512, 8192, False),  # KQ scores without flash attention
    ("gemma3-270m", 512, 4096, True),  # sliding-window layers' own mask
    ("gemma3-270m", 64, 16384, True),
    ("dense", 2048, 4096, True),  # FFN: 3 n_ff + 2 n_embd + q_dim per token, plus the mask
    ("dense", 512, 16384, True),
    ("dense", 4096, 4096, False),
    ("moe", 4096, 16384, True),  # routed FFN: experts used x n_ff_exp
    ("moe", 512, 4096, False),
    # experts narrow beside n_embd: mixing their outputs, (k + 3) n_embd, outweighs computing them
    ("moe-narrow", 512, 2048, True),
    # (at ubatches of 256-512 and contexts of 2048-8192 llama.cpp reserves 2.8-5.6 MiB more for
    # this shape than planned: not yet modelled, docs/measured/2026-11-28-gpt-oss-compute.txt)
    ("gpt-oss", 4096, 16384, True),
    ("gpt-oss", 1024, 8192, True),
]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """Synthetic models wide enough that the head does not hide the layers' terms."""
    root = tmp_path_factory.mktemp("verify")
    models = {"smollm2-135m": str(resolve_model("smollm2-135m")),
              "gemma3-270m": str(resolve_model("gemma3-270m"))}  # fmt: skip
    for name, flags in {
        "dense": "--arch llama --layers 4 --embd 1024 --ff 2816 --heads 16 --kv-heads 4 "
        "--vocab 8000 --qtype Q4_K",
        "moe": "--arch qwen3moe --layers 4 --embd 512 --ff 1024 --heads 8 --kv-heads 4 "
        "--experts 16 --experts-used 4 --expert-ff 384 --vocab 8000 --qtype Q4_K",
        "moe-narrow": "--arch qwen3moe --layers 2 --embd 1024 --ff 1024 --heads 8 --kv-heads 2 "
        "--experts 16 --experts-used 8 --expert-ff 128 --vocab 1000 --qtype Q8_0",
        # sinks, biases on the router and the experts, every other layer a 128-token window
        "gpt-oss": "--arch gpt-oss --layers 4 --embd 512 --ff 1024 --heads 8 --kv-heads 4 "
        "--head-dim 64 --experts 16 --experts-used 4 --expert-ff 384 --swa 128 --vocab 8000 "
        "--qtype MXFP4_MOE",
    }.items():
        out = root / f"{name}.gguf"
        r = refengine("synth", out, *flags.split())
        assert r.returncode == 0, r.stderr
        models[name] = str(out)
    return models


@pytest.mark.parametrize("name,n_ubatch,n_ctx,flash_attn", MATRIX)
def test_compute_buffer_as_llamacpp_reserves_it(shapes, llama_bin, rpc_servers, name, n_ubatch,
                                               n_ctx, flash_attn):  # fmt: skip
    path = shapes[name]
    spec = load_model(path)
    args = ["--rpc", rpc_servers[0], "-dev", "RPC0", "-fit", "off", "-ngl", "999",
            "-c", str(n_ctx), "-b", str(max(n_ubatch, 2048)), "-ub", str(n_ubatch),
            "-fa", "on" if flash_attn else "off"]  # fmt: skip
    log = parse_load_log(run_llamacpp(llama_bin, path, args), spec)
    measured = log.buffers["RPC0"].compute_bytes
    planned = llamacpp_compute_nbytes(spec, n_ubatch, n_ctx, flash_attn, n_ubatch)
    assert abs(measured - planned) <= 0.03 * planned + 4 * MIB, (measured / MIB, planned / MIB)


def _solve(model, tmp_path, *flags):
    out = tmp_path / "plan.json"
    r = refengine("solve", model, "--target", "llamacpp", "-o", out, *flags)
    assert r.returncode == 0, r.stderr
    return out


def _verify(plan, llama_bin, endpoints, *flags):
    return refengine("verify", plan, "--llama-bin", llama_bin, "--rpc", ",".join(endpoints),
                     *flags)  # fmt: skip


@pytest.mark.parametrize(
    "model,profile,budget,ctx,strategy",
    [
        ("smollm2-135m", "h100", "500MiB", "2048", None),  # all on the device
        ("smollm2-135m", "h100", "150MiB", "2048", None),  # a layer's tensors left on the CPU
        ("dense", "rtx4090-rtx3060-epyc-7742", "60MiB,50MiB", "4096", None),  # two devices
        # --cpu-moe, two layers on the CPU, two on the first device, the head alone on the second
        ("moe", "rtx4090-rtx3060-epyc-7742", "30MiB,30MiB", "4096", "fit"),
    ],
)
def test_verify_places_every_tensor_as_planned(shapes, llama_bin, rpc_servers, tmp_path, model,
                                               profile, budget, ctx, strategy):  # fmt: skip
    plan = _solve(shapes[model], tmp_path, "--profile", profile, "--budget", budget,
                  "--ctx", ctx, "--tiers", "1,512",
                  *(["--strategy", strategy] if strategy else []))  # fmt: skip
    r = _verify(plan, llama_bin, rpc_servers)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(load_model(shapes[model]).tensors)
    assert f"tensors placed as planned: {n}/{n}" in r.stdout
    assert "over budget" not in r.stdout


def test_verify_fails_a_device_over_its_budget(shapes, llama_bin, rpc_servers, tmp_path):
    plan = _solve(shapes["smollm2-135m"], tmp_path, "--profile", "h100", "--budget", "500MiB",
                  "--ctx", "2048", "--tiers", "1,512")  # fmt: skip
    d = json.loads(plan.read_text())
    d["fingerprint"]["budget_bytes"] = [100 * MIB]  # llama.cpp takes ~230 MiB here
    plan.write_text(json.dumps(d))
    r = _verify(plan, llama_bin, rpc_servers)
    assert r.returncode == 1 and "over budget" in r.stdout, r.stdout + r.stderr


def test_verify_fails_a_device_off_its_plan(shapes, llama_bin, rpc_servers, tmp_path,
                                          monkeypatch):  # fmt: skip
    """A memory model deliberately wrong (each layer's KV priced twice over): within budget, but
    off the plan by more than 3% + 4 MiB, so verify exits 1 and names the device and the term."""
    from click.testing import CliRunner

    import solver.usage
    from refengine.commands import cli

    plan = _solve(shapes["smollm2-135m"], tmp_path, "--profile", "h100", "--budget", "500MiB",
                  "--ctx", "8192", "--tiers", "1,512")  # fmt: skip
    args = ["verify", str(plan), "--llama-bin", str(llama_bin), "--rpc", rpc_servers[0]]
    right = CliRunner().invoke(cli, args)
    assert right.exit_code == 0, right.output
    kv = solver.usage.kv_layer_nbytes
    monkeypatch.setattr(solver.usage, "kv_layer_nbytes", lambda *a, **k: 2 * kv(*a, **k))
    wrong = CliRunner().invoke(cli, args)
    assert wrong.exit_code == 1, wrong.output
    assert "RPC0: llama.cpp allocated" in wrong.output and "most in its KV buffer" in wrong.output
    assert "off plan" in wrong.output and "over budget" not in wrong.output


def test_verify_refuses_in_one_line(shapes, llama_bin, tmp_path):
    plan = _solve(shapes["smollm2-135m"], tmp_path, "--profile", "h100", "--budget", "500MiB")
    r = refengine("verify", plan, "--llama-bin", tmp_path)
    assert r.returncode == 2 and "no llama-completion in" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = refengine("solve", shapes["smollm2-135m"], "--profile", "h100", "--budget", "500MiB",
                  "-o", tmp_path / "ours.json")  # fmt: skip
    r = refengine("verify", tmp_path / "ours.json", "--llama-bin", llama_bin)
    assert r.returncode == 2 and "solve with --target llamacpp" in r.stderr


@pytest.mark.parametrize("split", ["20,4,7", "21,9,1"], ids=["head-with-layers", "head-alone"])
def test_pipelined_compute_buffers_per_device(llama_bin, rpc_servers, split):
    """Every layer offloaded over three devices: llama.cpp pipelines ubatches and keeps four
    copies of each input a device receives. The first device makes the masks and receives the
    activations; the second receives both; the last holds the head, with layers (masks received)
    or alone (none). Each within a tenth of a MiB of llama.cpp's own figure."""
    path = str(resolve_model("smollm2-135m"))
    spec = load_model(path)
    args = ["--rpc", ",".join(rpc_servers), "-dev", "RPC0,RPC1,RPC2", "-fit", "off", "-ngl", "31",
            "-ts", split, "-sm", "layer", "-c", "2048", "-b", "2048", "-ub", "512", "-fa", "on"]  # fmt: skip
    log = parse_load_log(run_llamacpp(llama_bin, path, args), spec)
    roles = [(0, True, True), (0, True, False), (512, split != "21,9,1", False)]
    for name, (rows, attends, holds_masks) in zip(["RPC0", "RPC1", "RPC2"], roles):
        planned = llamacpp_compute_nbytes(spec, 512, 2048, True, rows, 4, attends, holds_masks)
        measured = log.buffers[name].compute_bytes
        assert abs(measured - planned) <= 0.1 * MIB, (name, measured / MIB, planned / MIB)


# -ngl and -ts over 4 layers and the head: (logit rows, mixes its layers', mixes the one before)
CPU_MOE_SPLITS = {
    ("5", "4,1"): [(0, True, False), (512, False, True)],  # the head alone mixes the last layer
    ("5", "1,1"): [(0, True, False), (512, True, True)],  # the head beside mixing layers
    ("3", "2,1"): [(0, True, True), (512, False, True)],  # layers 0 and 1 on the CPU
}


@pytest.mark.parametrize("ngl,split", CPU_MOE_SPLITS, ids=["head-alone", "head-with-layers",
                                                             "after-cpu-layers"])  # fmt: skip
def test_compute_buffers_where_the_cpu_computes_the_experts(shapes, llama_bin, rpc_servers, ngl,
                                                            split):  # fmt: skip
    """--cpu-moe over two devices (no pipelining: tensor overrides stop it): a device receives its
    layers' experts' outputs from the CPU and only mixes them, and also mixes the layer before
    its first when that layer's experts ran on the CPU; a device holding the head alone mixes
    the last layer's and keeps its inputs beside the logits. Each within a tenth of a MiB of
    llama.cpp's own figure (the full FFN term was up to 5 MiB over, the head alone 5 MiB under)."""
    path = shapes["moe"]
    spec = load_model(path)
    args = ["--rpc", ",".join(rpc_servers[:2]), "-dev", "RPC0,RPC1", "-fit", "off", "-ngl", ngl,
            "-ts", split, "-sm", "layer", "-c", "4096", "-b", "2048", "-ub", "512", "-fa", "on",
            "--cpu-moe"]  # fmt: skip
    log = parse_load_log(run_llamacpp(llama_bin, path, args), spec)
    for name, (rows, mixes, before) in zip(["RPC0", "RPC1"], CPU_MOE_SPLITS[ngl, split]):
        planned = llamacpp_compute_nbytes(spec, 512, 4096, True, rows, 1, True, False, mixes,
                                          before)  # fmt: skip
        measured = log.buffers[name].compute_bytes
        assert abs(measured - planned) <= 0.1 * MIB, (name, measured / MIB, planned / MIB)
