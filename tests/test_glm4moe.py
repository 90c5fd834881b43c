"""glm4moe (GLM-4.5/4.6), planned for llama.cpp: a dense first layer, routed layers with a shared
expert and a selection bias, and a NextN block that is in the file but loaded by nobody
(docs/llamacpp-architectures.md, 2.2). Its files read as llama.cpp lays them out, the exported
flags count the NextN block among llama.cpp's layers, and real llama.cpp places our synthetic
files as planned."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.quants import Q
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, preset, spec_from_hparams, write_synthetic
from solver.cost import CPU, PINNED, CostModel, Loc, TierPlacement, Workload
from solver.groups import tensor_groups
from solver.profile import Figure

from .conftest import refengine
from .rpc_verify import verify_over_two_servers
from .test_cost import toy_profile

GLM = SyntheticConfig("glm4moe", n_layer=4, n_embd=256, n_ff=512, n_head=8, n_head_kv=2,
                      head_dim=64, n_rot=32, n_vocab=1000, qtype="Q4_K_M", n_expert=16,
                      n_expert_used=4, n_ff_exp=128, n_expert_shared=1, n_dense_lead=1,
                      n_nextn=1, seed=5)  # fmt: skip


def test_a_glm4moe_file_reads_as_llama_cpp_lays_it_out(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "glm.gguf", GLM))
    hp, by = spec.hparams, spec.by_name
    assert spec.arch.name == "glm4moe" and not spec.arch.engines
    assert (hp.n_layer, hp.n_nextn, hp.n_block, hp.n_dense_lead) == (4, 1, 5, 1)
    assert (hp.n_ff_shexp, hp.n_rot, hp.head_dim) == (128, 32, 64)
    # layer 0 dense (n_ff wide, no router), the others routed beside a shared expert
    assert by["blk.0.ffn_up.weight"].shape == (512, 256) and "blk.0.ffn_gate_inp.weight" not in by
    assert by["blk.1.ffn_up_exps.weight"].shape == (16, 128, 256)
    assert by["blk.1.ffn_down_shexp.weight"].shape == (256, 128)
    assert by["blk.3.exp_probs_b.bias"].shape == (16,) and "blk.1.ffn_up.weight" not in by
    assert by["blk.2.post_attention_norm.weight"].shape == (256,) and by["blk.2.attn_q.bias"]
    # the NextN block: a whole routed block and its own projection, read but never placed
    assert {t.layer for t in spec.unloaded} == {4}
    assert {"blk.4.nextn.eh_proj.weight", "blk.4.ffn_up_exps.weight"} <= {
        t.name for t in spec.unloaded}
    assert all(t.layer is None or t.layer < 4 for t in spec.tensors)
    # Q4_K_M counts the layers over all five blocks: use_more_bits picks 2 and 4 (of four, 2
    # and 3); the shared expert's down is an ffn_down (128-value rows: Q6_K falls back to Q8_0,
    # Q4_K to Q5_0)
    assert by["blk.2.attn_v.weight"].qtype == Q.Q6_K and by["blk.3.attn_v.weight"].qtype == Q.Q4_K
    assert by["blk.2.ffn_down_shexp.weight"].qtype == Q.Q8_0
    assert by["blk.3.ffn_down_shexp.weight"].qtype == Q.Q5_0
    groups = {g.name: g for g in tensor_groups(spec)}
    assert {"blk.1.exp_probs_b.bias", "blk.1.ffn_gate_inp.weight"} <= set(
        groups["blk.1.attn"].tensors)
    assert groups["blk.1.ffn_up_shexp"].kind == "ffn" and groups["blk.1.ffn_up_exps"].kind == (
        "experts")
    layer1 = [g.name for g in tensor_groups(spec) if g.layer == 1]
    assert layer1.index("blk.1.ffn_down_shexp") > layer1.index("blk.1.ffn_down_exps")
    planned = [t for g in groups.values() for t in g.tensors]
    assert sorted(planned) == sorted(by)  # every loaded tensor in exactly one group


def test_a_spec_only_glm_has_its_published_parameters():
    # zai-org: GLM-4.5-Air 106B total parameters, GLM-4.6 (as GLM-4.5) 355B, the MTP layer aside
    for name, billions in (("glm-4.5-air", 106), ("glm-4.6", 355)):
        spec = spec_from_hparams(preset(name))
        assert spec.n_params / 1e9 == pytest.approx(billions, rel=0.01)
        assert len({t.layer for t in spec.unloaded}) == 1


@pytest.mark.parametrize("missing", ["expert_count", "expert_shared_count"])
def test_a_glm4moe_file_without_a_key_its_pricing_needs_is_refused_naming_it(tmp_path, missing,
                                                                             monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, f"add_{missing}", lambda self, n: None)
    r = refengine("info", write_synthetic(tmp_path / "glm.gguf", GLM))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"'glm4moe.{missing}' is missing" in r.stderr


def test_a_dense_leading_layer_pays_no_routed_layer_costs():
    """llama.cpp's CPU pays a routed layer's fixed cost and each chosen expert's start on the
    routed layers only; layer 0, dense, pays a dense layer's."""
    base = toy_profile()
    f = lambda v: Figure(v, "toy")  # noqa: E731
    measured = replace(base, cpu=replace(base.cpu, llamacpp_layer_seconds=f(2e-5),
                                         llamacpp_routed_layer_seconds=f(7e-5),
                                         llamacpp_expert_seconds=f(1e-6)))  # fmt: skip
    spec = spec_from_hparams(GLM)
    w = Workload(n_ctx=4096, prompt_tokens=512, gen_tokens=100)
    priced, plain = CostModel(spec, measured, w, "llamacpp"), CostModel(spec, base, w, "llamacpp")
    attn = {g.layer: g for g in priced.groups if g.kind == "attn"}
    extra = [priced.cpu_seconds(attn[il], 1) - plain.cpu_seconds(attn[il], 1) for il in (0, 1)]
    assert extra[0] == pytest.approx(2e-5)
    assert extra[1] == pytest.approx(7e-5 + 4 * 1e-6)  # one token chooses 4 experts


def test_exported_flags_count_the_nextn_block_among_llamacpps_layers(tmp_path, llama_bin,
                                                                     rpc_servers):
    """-ngl and -ts count the NextN block (llama.cpp assigns devices over every block), and
    --n-cpu-moe moves the routed stacks of the first layers but not their shared experts: real
    llama.cpp places every tensor as planned."""
    from solver.export import llamacpp_args, tensor_devices
    from solver.llamacpp_check import on_rpc, parse_load_log, run_llamacpp

    path = write_synthetic(tmp_path / "glm.gguf", GLM)
    spec = load_spec(path)
    on_cpu = {g.name for g in tensor_groups(spec) if g.kind == "experts" and g.layer < 3}
    place = TierPlacement({g.name: Loc(CPU) if g.name in on_cpu | {"token_embd"} else
                           Loc(PINNED, device=0 if g.layer is not None and g.layer < 2 else 1)
                           for g in tensor_groups(spec)},
                          {il: Loc(PINNED, device=0 if il < 2 else 1)
                           for il in range(spec.hparams.n_layer)})  # fmt: skip
    args = llamacpp_args(spec, place, 1024, "f16", True, n_devices=2)
    assert args[args.index("-ngl") + 1] == "6" and args[args.index("-ts") + 1] == "2,4"
    assert args[args.index("--n-cpu-moe") + 1] == "3"
    log = parse_load_log(run_llamacpp(llama_bin, str(path), on_rpc(args, rpc_servers[:2])), spec)
    want = {name: dev.replace("CUDA", "RPC") for name, dev in tensor_devices(spec, place).items()}
    assert log.tensors == want
    assert log.tensors["blk.2.ffn_up_exps.weight"] == "CPU"
    assert log.tensors["blk.2.ffn_up_shexp.weight"] == "RPC1"
    assert log.tensors["blk.0.ffn_up.weight"] == "RPC0"


# -ot: which layers' routed experts the CPU computes, with -ngl 8 -ts 3,5 (layers 3-5, the NextN
# block and the head on RPC1): (mixes all its layers', the layers whose experts it mixes)
CPU_EXPERTS = {"blk\\.4\\.": (False, (4,)), "blk\\.[3-5]\\.": (True, (3, 4, 5))}


@pytest.mark.parametrize("vocab", [8000, 1000])
@pytest.mark.parametrize("layers", CPU_EXPERTS)
def test_compute_buffer_where_the_cpu_computes_experts_beside_a_shared_one(
        tmp_path, llama_bin, rpc_servers, layers, vocab):  # fmt: skip
    """A device mixing CPU-computed experts keeps the shared expert's output beside the mix, and
    beside the logits, where it mixes a layer before the last, the chosen experts' gate and up
    outputs and n_embd (without these terms the plan was 6 MiB under llama.cpp's figure and the
    solve went over budget; docs/measured/2026-11-28-verify-glm4moe.txt). A bound within a MiB."""
    from solver.llamacpp_check import MIB, parse_load_log, run_llamacpp
    from solver.memory import llamacpp_compute_nbytes

    cfg = replace(GLM, n_layer=6, n_embd=512, n_ff=1024, n_head_kv=4, n_ff_exp=384,
                  n_vocab=vocab, qtype="Q8_0")  # fmt: skip
    path = write_synthetic(tmp_path / "glm.gguf", cfg)
    spec = load_spec(path)
    args = ["--rpc", ",".join(rpc_servers[:2]), "-dev", "RPC0,RPC1", "-fit", "off", "-ngl", "8",
            "-ts", "3,5", "-sm", "layer", "-c", "2048", "-b", "2048", "-ub", "512", "-fa", "on",
            "-ot", f"{layers}ffn_(gate|up|down)_exps\\.weight=CPU"]  # fmt: skip
    log = parse_load_log(run_llamacpp(llama_bin, str(path), args), spec)
    mixes, mixed = CPU_EXPERTS[layers]
    planned = llamacpp_compute_nbytes(spec, 512, 2048, True, 512, 1, True, False, mixes, False,
                                      mixed)  # fmt: skip
    measured = log.buffers["RPC1"].compute_bytes
    assert -0.1 * MIB <= planned - measured <= MIB, (measured / MIB, planned / MIB)


def test_verify_a_glm4moe_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers):
    """Solved over two llama.cpp RPC servers of unequal budgets, exported and run in real
    llama.cpp: every tensor where the plan put it, each device's memory within 3% + 4 MiB of the
    plan (docs/measured/2026-11-28-verify-glm4moe.txt)."""
    path = tmp_path / "glm.gguf"
    r = refengine("synth", path, *("--arch glm4moe --layers 4 --embd 512 --ff 1024 --heads 8 "
                                   "--kv-heads 4 --head-dim 64 --rope-dim 32 --experts 16 "
                                   "--experts-used 4 --expert-ff 384 --shared-experts 1 "
                                   "--dense-lead 1 --nextn 1 --vocab 8000 --qtype Q4_K_M"
                                   ).split())  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, "40MiB,32MiB", 2048)
    assert "-ngl 6" in out


def test_synth_refuses_a_part_the_architecture_lacks():
    from refengine.errors import UserError

    with pytest.raises(UserError, match="a qwen3moe model has no shared experts"):
        replace(GLM, arch="qwen3moe").hparams()


def test_info_shows_a_spec_only_shape_with_its_unloaded_nextn_block():
    r = refengine("info", "glm-4.5-air")
    assert r.returncode == 0, r.stderr
    assert "architecture glm4moe" in r.stdout and "spec-only shape" in r.stdout
    assert "NextN block 46: 1,631.68 MiB in the file that llama.cpp does not load" in (
        " ".join(r.stdout.split()))
