"""The generic rule: a causal text architecture refengine has no exact model of is planned for
llama.cpp from its file's tensor names and shapes (refengine/generic.py) — granitemoe (routed)
and olmo2 (dense, norms where llama has none) are written, planned and verified in real
llama.cpp here; one with a state per sequence (lfm2) is refused naming it."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic
from solver.groups import tensor_groups

from .conftest import refengine, tiny_gguf
from .test_cli import assert_one_line_error
from .rpc_verify import verify_over_two_servers

OLMO2 = SyntheticConfig("olmo2", n_layer=6, n_embd=512, n_ff=1536, n_head=8, n_head_kv=2,
                        n_vocab=2000, qtype="Q4_K_M", seed=7)  # fmt: skip
GRANITEMOE = SyntheticConfig("granitemoe", n_layer=6, n_embd=512, n_ff=256, n_head=8,
                             n_head_kv=2, n_vocab=2000, qtype="Q4_K_M", n_expert=16,
                             n_expert_used=4, seed=8)  # fmt: skip


def test_an_olmo2_file_is_priced_by_its_tensors(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "olmo2.gguf", OLMO2))
    hp, by = spec.hparams, spec.by_name
    assert spec.arch.generic and not spec.arch.engines and not spec.arch.moe
    assert (hp.n_layer, hp.n_ff, hp.n_head_kv, hp.head_dim, hp.n_expert) == (6, 1536, 2, 64, 0)
    assert "blk.0.attn_norm.weight" not in by and by["blk.0.attn_q_norm.weight"].shape == (512,)
    assert by["blk.0.attn_k_norm.weight"].shape == (128,)
    groups = {g.name: g for g in tensor_groups(spec)}
    # a layer's norms read with its attention, but the one after the FFN, with the down matrix
    assert set(groups["blk.2.attn"].tensors) == {
        f"blk.2.{n}.weight" for n in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                                      "attn_k_norm", "post_attention_norm")}  # fmt: skip
    assert groups["blk.2.ffn_down"].tensors == ("blk.2.ffn_down.weight",
                                                "blk.2.post_ffw_norm.weight")  # fmt: skip
    assert groups["output"].tensors == ("output_norm.weight", "output.weight")
    planned = [t for g in groups.values() for t in g.tensors]
    assert sorted(planned) == sorted(by)  # every tensor in exactly one group


def test_a_granitemoe_file_routes_where_it_holds_expert_stacks(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "granitemoe.gguf", GRANITEMOE))
    hp = spec.hparams
    assert spec.arch.generic and spec.arch.moe
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp) == (16, 4, 256)
    assert all(hp.routed(il) for il in range(6)) and not hp.dense_layers
    kinds = {g.name: g.kind for g in tensor_groups(spec)}
    assert kinds["blk.3.ffn_up_exps"] == "experts" and "blk.3.ffn_gate_inp" not in kinds
    head = next(g for g in tensor_groups(spec) if g.name == "output")
    assert head.tensors == ("output_norm.weight", "output.weight")


def test_the_generic_rule_prices_a_dense_layer_between_routed_ones(tmp_path, monkeypatch):
    """A file whose layers route where they hold experts, not by a pattern refengine knows."""
    from refengine import synthetic

    real = synthetic.synthetic_layout

    def layer_2_dense(cfg, hp):
        slots = [s for s in real(cfg, hp) if not s.name.startswith("blk.2.ffn_")]
        dense = real(replace(cfg, n_expert=0, n_expert_used=0),
                     replace(hp, n_expert=0, n_expert_used=0))  # fmt: skip
        return slots + [s for s in dense if s.name.startswith("blk.2.ffn_")]

    monkeypatch.setattr(synthetic, "synthetic_layout", layer_2_dense)
    spec = load_spec(write_synthetic(tmp_path / "mixed.gguf", GRANITEMOE))
    assert [spec.hparams.routed(il) for il in range(6)] == [True, True, False, True, True, True]
    assert spec.hparams.dense_layers and spec.hparams.n_ff == 256
    assert {g.kind for g in tensor_groups(spec) if g.layer == 2} == {"attn", "ffn"}


def test_info_and_solve_say_the_model_is_priced_generically(tmp_path):
    path = write_synthetic(tmp_path / "olmo2.gguf", OLMO2)
    line = "priced generically: refengine has no exact model of olmo2"
    r = refengine("info", path)
    assert r.returncode == 0 and line in r.stdout, r.stderr
    r = refengine("solve", path, "--target", "llamacpp", "--budget", "64MiB", "--profile",
                  "h100", "--ctx", "4096")  # fmt: skip
    assert r.returncode == 0 and line in r.stdout, r.stderr
    known = refengine("info", write_synthetic(tmp_path / "q.gguf", SyntheticConfig("qwen3")))
    assert known.returncode == 0 and "priced generically" not in known.stdout


@pytest.mark.parametrize("command", [("run", "-p", "hi"), ("diff", "-p", "hi"),
                                     ("bench", "--engine", "cpu")])  # fmt: skip
def test_the_engines_say_a_generic_model_is_planned_only(tmp_path, command):
    path = write_synthetic(tmp_path / "olmo2.gguf", OLMO2)
    r = refengine(command[0], path, *command[1:])
    assert_one_line_error(r, "planned only: the engines run llama, qwen2, qwen3, qwen3moe, gemma3")
    assert r.returncode == 2


def test_a_routed_file_without_its_expert_count_is_refused_naming_the_key(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, "add_expert_count", lambda self, n: None)
    r = refengine("info", write_synthetic(tmp_path / "granitemoe.gguf", GRANITEMOE))
    assert_one_line_error(r, "'granitemoe.expert_count' is missing")


@pytest.mark.parametrize("arch, state", [("lfm2", "beside its KV cache"),
                                         ("mamba2", "instead of a KV cache")])  # fmt: skip
def test_an_architecture_with_a_state_per_sequence_is_refused_naming_it(tmp_path, arch, state):
    p = tiny_gguf(tmp_path / f"{arch}.gguf", arch,
                  {"token_embd.weight": (np.zeros((4, 8), np.float32), None)}, block_count=1)
    assert_one_line_error(refengine("info", p), f"architecture {arch!r} keeps a recurrent state "
                                                f"per sequence {state}")  # fmt: skip


@pytest.mark.parametrize("cfg, budget, ctx", [(OLMO2, "40MiB,32MiB", 16384),
                                              (GRANITEMOE, "40MiB,32MiB", 16384)])  # fmt: skip
def test_verify_a_generic_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers, cfg,
                                                    budget, ctx):  # fmt: skip
    """Solved over two llama.cpp RPC servers of unequal budgets, exported and run in real
    llama.cpp: every tensor where the plan put it, each device's memory within 3% + 4 MiB of the
    plan and within its budget (docs/measured/2026-11-28-verify-generic.txt)."""
    path = write_synthetic(tmp_path / f"{cfg.arch}.gguf", cfg)
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, budget, ctx)
    assert "RPC1" in out


def test_head_counts_given_per_layer_price_every_layer_with_the_most(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    def per_layer(self, n):  # as deci's and openelm's files give them
        self.add_array(f"{self.arch}.attention.head_count_kv", [n, n // 2, n, 1, n, n])

    monkeypatch.setattr(GGUFWriter, "add_head_count_kv", per_layer)
    spec = load_spec(write_synthetic(tmp_path / "olmo2.gguf", OLMO2))
    assert spec.hparams.n_head_kv == 2 and spec.hparams.n_head == 8
