"""deepseek2 (DeepSeek-V3/R1, Kimi-K2), planned for llama.cpp: glm4moe's layer structure with
multi-head latent attention, whose cache keeps one row of kv_lora_rank + RoPE dims a token and
layer and no V (docs/llamacpp-architectures.md, 2.3). Its files read as llama.cpp lays them out,
real llama.cpp allocates the KV and compute buffers planned, and a plan over two RPC servers
verifies."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.errors import UserError
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, preset, spec_from_hparams, write_synthetic
from solver.groups import tensor_groups
from solver.memory import KVShape, kv_cell_nbytes, kv_layer_nbytes

from .conftest import refengine
from .rpc_verify import verify_over_two_servers

DS = SyntheticConfig("deepseek2", n_layer=4, n_embd=512, n_ff=1024, n_head=16, head_dim=96,
                     head_dim_v=64, n_rot=32, q_lora_rank=192, kv_lora_rank=128, n_vocab=1000,
                     qtype="Q8_0", n_expert=16, n_expert_used=4, n_ff_exp=384, n_expert_shared=1,
                     n_dense_lead=1, n_nextn=1, seed=7)  # fmt: skip


def test_a_deepseek2_file_reads_as_llama_cpp_lays_it_out(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "ds.gguf", DS))
    hp, by = spec.hparams, spec.by_name
    assert spec.arch.name == "deepseek2" and not spec.arch.engines and hp.mla
    # the cache's row: the latent (128) and the RoPE key (32), one "head"; the query heads 96
    assert (hp.head_dim, hp.head_dim_v, hp.n_head_kv) == (160, 128, 1)
    assert (hp.head_dim_mla, hp.head_dim_v_mla, hp.q_lora_rank) == (96, 64, 192)
    shapes = {n: by[f"blk.1.{n}.weight"].shape for n in (
        "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_k_b", "attn_v_b", "attn_output")}
    assert shapes == {"attn_q_a": (192, 512), "attn_q_b": (16 * 96, 192),
                      "attn_kv_a_mqa": (128 + 32, 512), "attn_k_b": (16, 128, 96 - 32),
                      "attn_v_b": (16, 64, 128), "attn_output": (512, 16 * 64)}  # fmt: skip
    assert "blk.1.attn_k.weight" not in by and "blk.1.attn_v.weight" not in by
    assert kv_cell_nbytes(spec, "f16") == 160 * 2  # K only
    attn = next(g for g in tensor_groups(spec) if g.name == "blk.1.attn")
    assert {"blk.1.attn_k_b.weight", "blk.1.attn_kv_a_norm.weight", "blk.1.exp_probs_b.bias"} <= (
        set(attn.tensors))
    assert {t.layer for t in spec.unloaded} == {4}


def test_a_deepseek2_file_without_the_selection_bias_reads(tmp_path, monkeypatch):
    """exp_probs_b is optional in deepseek2 (DeepSeek-V2 has none), required in glm4moe."""
    from gguf import GGUFWriter

    add = GGUFWriter.add_tensor
    monkeypatch.setattr(GGUFWriter, "add_tensor", lambda self, name, *a, **k: None if (
        "exp_probs_b" in name) else add(self, name, *a, **k))  # fmt: skip
    spec = load_spec(write_synthetic(tmp_path / "ds.gguf", DS))
    assert not any("exp_probs_b" in t.name for t in spec.tensors)
    with pytest.raises(UserError, match="tensors are missing"):
        load_spec(write_synthetic(tmp_path / "glm.gguf", replace(
            DS, arch="glm4moe", head_dim=64, head_dim_v=0, q_lora_rank=0, kv_lora_rank=0)))


@pytest.mark.parametrize("missing,says", [
    ("add_kv_lora_rank", "'deepseek2.attention.kv_lora_rank' is missing"),
    ("add_q_lora_rank", "'deepseek2.attention.q_lora_rank' is missing"),
    ("add_key_length_mla", "an older conversion (one attn_kv_b per layer)"),
])  # fmt: skip
def test_a_deepseek2_file_without_its_latent_keys_is_refused_in_one_line(tmp_path, monkeypatch,
                                                                         missing, says):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, missing, lambda self, n: None)
    r = refengine("info", write_synthetic(tmp_path / "ds.gguf", DS))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert says in r.stderr


def test_deepseek_v3_has_its_published_parameters_and_cache():
    # deepseek-ai: 671B parameters besides the MTP module; 61 layers of 576 cached values a token
    spec = spec_from_hparams(preset("deepseek-v3"))
    assert spec.n_params / 1e9 == pytest.approx(671, rel=0.005)
    per_token = kv_layer_nbytes(spec, 0, KVShape(n_ctx=256)) / 256 * spec.hparams.n_layer
    assert per_token == 61 * 576 * 2


def test_kv_and_compute_buffers_of_latent_attention_as_llamacpp_allocates(tmp_path, llama_bin,
                                                                          rpc_servers):
    """The K-only cache to the byte, and the compute buffer of attention-wide latent heads (32
    heads of 512 + 64) within [-0.1, +1] MiB of llama.cpp's, with and without flash attention
    (the ordinary attention's terms were 13 MiB under)."""
    from solver.llamacpp_check import MIB, parse_load_log, run_llamacpp
    from solver.memory import llamacpp_compute_nbytes

    cfg = replace(DS, n_head=32, head_dim=192, head_dim_v=128, n_rot=64, kv_lora_rank=512)
    path = write_synthetic(tmp_path / "ds.gguf", cfg)
    spec = load_spec(path)
    for fa in ("on", "off"):
        args = ["--rpc", rpc_servers[0], "-dev", "RPC0", "-fit", "off", "-ngl", "99", "-c", "2048",
                "-b", "2048", "-ub", "512", "-fa", fa]  # fmt: skip
        log = parse_load_log(run_llamacpp(llama_bin, str(path), args), spec)
        kv = sum(kv_layer_nbytes(spec, il, KVShape(n_ctx=2048)) for il in range(4))
        assert log.buffers["RPC0"].kv_bytes == kv
        planned = llamacpp_compute_nbytes(spec, 512, 2048, fa == "on", 512)
        measured = log.buffers["RPC0"].compute_bytes
        assert -0.1 * MIB <= planned - measured <= MIB, (fa, measured / MIB, planned / MIB)


def test_verify_a_deepseek2_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers):
    """Solved over two llama.cpp RPC servers of unequal budgets, exported and run in real
    llama.cpp: every tensor where the plan put it, each device's memory within 3% + 4 MiB of the
    plan and within its budget (docs/measured/2026-11-28-verify-deepseek2.txt)."""
    path = tmp_path / "ds.gguf"
    r = refengine("synth", path, *("--arch deepseek2 --layers 4 --embd 512 --ff 1024 --heads 8 "
                                   "--head-dim 96 --head-dim-v 64 --rope-dim 32 --q-lora 192 "
                                   "--kv-lora 128 --experts 16 --experts-used 4 --expert-ff 384 "
                                   "--shared-experts 1 --dense-lead 1 --nextn 1 --vocab 8000 "
                                   "--qtype Q4_K_M").split())  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, "40MiB,32MiB", 2048)
    assert "-ngl 6" in out
