"""gpt-oss, planned for llama.cpp and not run by our engines: its files read as llama.cpp lays
them out (docs/llamacpp-architectures.md, 2.1), its expert biases move with their stacks, real
llama.cpp loads and places our synthetic files, and the engines refuse it in one line."""

from __future__ import annotations

import pytest

from refengine.errors import UserError
from refengine.quants import Q
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, preset, spec_from_hparams, write_synthetic
from solver.groups import tensor_groups

from .conftest import refengine
from .rpc_verify import verify_over_two_servers

GPT_OSS = SyntheticConfig("gpt-oss", n_layer=4, n_embd=256, n_ff=256, n_head=8, n_head_kv=2,
                          head_dim=64, n_vocab=1000, qtype="MXFP4_MOE", n_expert=8,
                          n_expert_used=2, n_ff_exp=128, n_swa=128, seed=3)  # fmt: skip


def test_a_gpt_oss_file_reads_as_llama_cpp_lays_it_out(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "gpt-oss.gguf", GPT_OSS))
    hp, by = spec.hparams, spec.by_name
    assert spec.arch.name == "gpt-oss" and not spec.arch.engines
    assert hp.swa_layers == (True, False, True, False) and hp.n_swa == 128  # even layers slide
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp, hp.head_dim) == (8, 2, 128, 64)
    assert by["blk.0.attn_sinks.weight"].shape == (8,)
    assert by["blk.1.ffn_down_exps.bias"].shape == (8, 256)
    assert by["blk.1.post_attention_norm.weight"].shape == (256,)
    assert "blk.1.ffn_norm.weight" not in by and "output.weight" in by
    # MXFP4_MOE: the expert stacks MXFP4, every other matrix Q8_0
    assert by["blk.2.ffn_up_exps.weight"].qtype == Q.MXFP4
    assert by["blk.2.attn_q.weight"].qtype == Q.Q8_0 and by["output.weight"].qtype == Q.Q8_0
    groups = {g.name: g for g in tensor_groups(spec)}
    assert groups["blk.3.ffn_gate_exps"].tensors == ("blk.3.ffn_gate_exps.weight",
                                                      "blk.3.ffn_gate_exps.bias")  # fmt: skip
    attn = set(groups["blk.3.attn"].tensors)
    assert {"blk.3.attn_sinks.weight", "blk.3.ffn_gate_inp.bias", "blk.3.attn_output.bias"} <= attn
    planned = [t for g in groups.values() for t in g.tensors]
    assert sorted(planned) == sorted(by)  # every tensor in exactly one group


def test_a_gpt_oss_file_without_its_window_is_refused_naming_the_key(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, "add_sliding_window", lambda self, n: None)
    path = write_synthetic(tmp_path / "no-window.gguf", GPT_OSS)
    with pytest.raises(UserError, match="'gpt-oss.attention.sliding_window' is missing"):
        load_spec(path)


def test_the_engines_and_our_runtime_refuse_a_planned_only_architecture(tmp_path):
    path = write_synthetic(tmp_path / "gpt-oss.gguf", GPT_OSS)
    for args in (("run", path, "-p", "hi", "-n", "2"), ("solve", path, "--profile", "h100")):
        r = refengine(*args)
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert "planned only" in r.stderr
    assert "the engines run llama, qwen2, qwen3, qwen3moe, gemma3" in refengine(
        "run", path, "-p", "hi", "-n", "2").stderr


def test_gpt_oss_20b_is_as_large_as_its_published_file():
    # bartowski/openai_gpt-oss-20b-GGUF gpt-oss-20b-MXFP4.gguf: 12.1 GB
    spec = spec_from_hparams(preset("gpt-oss-20b"))
    assert spec.weights_nbytes / 1e9 == pytest.approx(12.1, rel=0.01)


def test_real_llamacpp_loads_and_places_a_gpt_oss_file(tmp_path, llama_bin, rpc_servers):
    """llama.cpp reads our synthetic file as a gpt-oss model and places the experts of the first
    layers, biases and all, on the CPU with the exported flags."""
    from solver.cost import CPU, PINNED, Loc, TierPlacement
    from solver.export import llamacpp_args, tensor_devices
    from solver.llamacpp_check import on_rpc, parse_load_log, run_llamacpp

    path = write_synthetic(tmp_path / "gpt-oss.gguf", GPT_OSS)
    spec = load_spec(path)
    on_cpu = {g.name for g in tensor_groups(spec) if g.kind == "experts" and g.layer < 2}
    place = TierPlacement({g.name: Loc(CPU) if g.name in on_cpu | {"token_embd"} else Loc(PINNED)
                           for g in tensor_groups(spec)},
                          {il: Loc(PINNED) for il in range(spec.hparams.n_layer)})  # fmt: skip
    args = llamacpp_args(spec, place, 1024, "f16", True)
    log = parse_load_log(run_llamacpp(llama_bin, str(path), on_rpc(args, rpc_servers[:1])), spec)
    want = {name: "RPC0" if dev == "CUDA0" else dev
            for name, dev in tensor_devices(spec, place).items()
            if not name.endswith("@output")}  # fmt: skip
    assert log.tensors == want
    assert log.tensors["blk.1.ffn_down_exps.bias"] == "CPU"
    assert log.tensors["blk.2.ffn_down_exps.bias"] == "RPC0"


def test_verify_a_gpt_oss_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers):
    """Solved over two llama.cpp RPC servers of unequal budgets, exported and run in real
    llama.cpp: every tensor (expert biases with their stacks) where the plan put it, each
    device's memory within 3% + 4 MiB of the plan (docs/measured/2026-11-28-verify-gpt-oss.txt)."""
    path = tmp_path / "gpt-oss.gguf"
    r = refengine("synth", path, *("--arch gpt-oss --layers 4 --embd 512 --ff 1024 --heads 8 "
                                   "--kv-heads 4 --head-dim 64 --experts 16 --experts-used 4 "
                                   "--expert-ff 384 --swa 128 --vocab 8000 --qtype MXFP4_MOE"
                                   ).split())  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, "40MiB,32MiB", 2048)
    assert "-ts 2,3" in out
