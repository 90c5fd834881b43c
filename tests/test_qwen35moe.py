"""qwen35moe (Qwen3.5/3.6 MoE) and qwen3next (Qwen3-Next), planned for llama.cpp: three of every four layers a gated delta
net whose state per sequence stands in for the KV cache, every fourth gated full attention, each
layer routed beside a sigmoid-gated shared expert (docs/llamacpp-architectures.md, 2.5). Its files
read as llama.cpp lays them out, real llama.cpp allocates the cache and state planned and no more
compute buffer than planned, and a plan over two RPC servers verifies."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, preset, spec_from_hparams, write_synthetic
from solver.groups import tensor_groups
from solver.memory import KVShape, kv_layer_nbytes

from .conftest import refengine
from .rpc_verify import verify_over_two_servers

Q35 = SyntheticConfig("qwen35moe", n_layer=8, n_embd=512, n_ff=1024, n_head=8, n_head_kv=2,
                      head_dim=128, n_rot=32, n_vocab=1000, qtype="Q8_0", n_expert=16,
                      n_expert_used=4, n_ff_exp=256, n_ff_shexp=256, ssm_state=128, ssm_groups=4,
                      ssm_v_heads=8, n_nextn=1, seed=13)  # fmt: skip


def test_a_qwen35moe_file_reads_as_llama_cpp_lays_it_out(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "q35.gguf", Q35))
    hp, by = spec.hparams, spec.by_name
    assert spec.arch.name == "qwen35moe" and not spec.arch.engines
    assert hp.recurrent_layers == (True, True, True, False) * 2
    # a recurrent layer: Q, K and V in one product (2 x 4 key heads + 8 value heads of 128)
    assert by["blk.0.attn_qkv.weight"].shape == (2 * 4 * 128 + 8 * 128, 512)
    assert by["blk.0.ssm_conv1d.weight"].shape == (2048, 4) and by["blk.0.ssm_a"].shape == (8,)
    assert "blk.0.attn_q.weight" not in by and "blk.0.attn_output.weight" not in by
    # a full-attention layer: Q twice as wide (the queries and their gate)
    assert by["blk.3.attn_q.weight"].shape == (2 * 8 * 128, 512) and "blk.3.ssm_a" not in by
    assert by["blk.5.ffn_gate_inp_shexp.weight"].shape == (512,)
    assert by["blk.5.ffn_up_shexp.weight"].shape == (256, 512)
    attn = next(g for g in tensor_groups(spec) if g.name == "blk.0.attn")
    assert {"blk.0.ssm_out.weight", "blk.0.ffn_gate_inp_shexp.weight"} <= set(attn.tensors)
    assert {t.layer for t in spec.unloaded} == {8}
    # the state of a recurrent layer and sequence: the convolution's last 3 inputs, 128 x 1024
    assert hp.state_nbytes == 4 * (3 * 2048 + 128 * 1024)
    assert kv_layer_nbytes(spec, 0, KVShape(n_ctx=4096, users=3)) == 3 * hp.state_nbytes


def test_a_qwen3next_file_holds_its_delta_nets_two_gates_in_one_product(tmp_path):
    """qwen3next (Qwen3-Next): qwen35moe's layers but for ssm_ba, the write strength and decay
    of each value head in one product."""
    spec = load_spec(write_synthetic(tmp_path / "q3n.gguf", replace(Q35, arch="qwen3next")))
    by = spec.by_name
    assert by["blk.0.ssm_ba.weight"].shape == (2 * 8, 512) and "blk.0.ssm_beta.weight" not in by
    assert spec.hparams.recurrent_layers == (True, True, True, False) * 2


def test_a_qwen35moe_file_without_its_delta_net_sizes_is_refused_naming_the_key(tmp_path,
                                                                                monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, "add_ssm_state_size", lambda self, n: None)
    r = refengine("info", write_synthetic(tmp_path / "q35.gguf", Q35))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'qwen35moe.ssm.state_size' is missing" in r.stderr


def test_qwen35_35b_a3b_and_qwen3_next_are_as_large_as_published():
    # Qwen: 35B parameters, 3B active (a Q4_K_M file of about 21 GB); Qwen3-Next 80B
    spec = spec_from_hparams(preset("qwen3.5-35b-a3b"))
    assert spec.n_params / 1e9 == pytest.approx(35, rel=0.02)
    assert spec.weights_nbytes / 1e9 == pytest.approx(21.1, rel=0.03)
    assert spec_from_hparams(preset("qwen3-next-80b-a3b")).n_params / 1e9 == pytest.approx(
        80, rel=0.01)


@pytest.mark.parametrize("ssm", [(128, 4, 8), (128, 8, 8), (64, 4, 16)])
def test_cache_state_and_compute_buffer_as_llamacpp_allocates(tmp_path, llama_bin, rpc_servers,
                                                              ssm):
    """The full-attention layers' KV and the recurrent layers' state to 1/100 MiB; the compute
    buffer a bound within 3 MiB (over 30 shapes: 0.6-13.4 MiB over, the most where the delta net's
    chunks outweigh its convolution; docs/measured/2026-11-28-qwen35moe-compute.txt)."""
    from solver.llamacpp_check import MIB, parse_load_log, run_llamacpp
    from solver.memory import llamacpp_compute_nbytes

    state, groups, v_heads = ssm
    cfg = replace(Q35, ssm_state=state, ssm_groups=groups, ssm_v_heads=v_heads)
    path = write_synthetic(tmp_path / "q35.gguf", cfg)
    spec = load_spec(path)
    args = ["--rpc", rpc_servers[0], "-dev", "RPC0", "-fit", "off", "-ngl", "99", "-c", "4096",
            "-b", "2048", "-ub", "512", "-fa", "on"]  # fmt: skip
    log = parse_load_log(run_llamacpp(llama_bin, str(path), args), spec)
    kv = KVShape(n_ctx=4096)
    planned_kv = sum(kv_layer_nbytes(spec, il, kv) for il in range(8))
    assert abs(log.buffers["RPC0"].kv_bytes - planned_kv) <= 0.01 * MIB  # as llama.cpp prints it
    planned = llamacpp_compute_nbytes(spec, 512, 4096, True, 512)
    measured = log.buffers["RPC0"].compute_bytes
    assert -0.1 * MIB <= planned - measured <= 3 * MIB, (measured / MIB, planned / MIB)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_verify_a_hybrid_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers, arch):
    """Solved over two llama.cpp RPC servers of unequal budgets, exported and run in real
    llama.cpp: every tensor where the plan put it, each device's memory (its recurrent state
    with its KV) within 3% + 4 MiB of the plan and within its budget
    (docs/measured/2026-11-28-verify-qwen35moe.txt)."""
    cfg = replace(Q35, arch=arch, n_vocab=8000, qtype="Q4_K_M")
    path = write_synthetic(tmp_path / "hybrid.gguf", cfg)
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, "64MiB,48MiB", 4096)
    assert "-ngl 10" in out
