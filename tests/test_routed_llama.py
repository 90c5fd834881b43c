"""A llama file with routed experts (Mixtral's layout): llama.cpp routes it by its expert count
alone, every layer, softmax over the experts, the top k renormalized, each expert as wide as
feed_forward_length (docs/llamacpp-architectures.md, 2.7). We read, plan and run it the same."""

from __future__ import annotations

from refengine.gguf_file import read_gguf
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic

from .conftest import refengine
from .rpc_verify import verify_over_two_servers
from .llamacpp_run import assert_both_run

ROUTED_LLAMA = SyntheticConfig("llama", n_layer=2, n_embd=64, n_ff=96, n_head=4, n_head_kv=2,
                               n_vocab=300, qtype="Q8_0", n_expert=4, n_expert_used=2, seed=7)


def test_a_llama_with_experts_routes_each_expert_as_wide_as_its_ffn(tmp_path):
    path = write_synthetic(tmp_path / "routed-llama.gguf", ROUTED_LLAMA)
    spec = load_spec(path)
    assert spec.arch.name == "llama" and spec.arch.moe and spec.arch.expert_weights_norm
    hp = spec.hparams
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp) == (4, 2, 96)
    assert spec.by_name["blk.1.ffn_down_exps.weight"].shape == (4, 64, 96)
    assert "blk.0.ffn_up.weight" not in spec.by_name
    fields = read_gguf(path).fields
    assert fields["llama.expert_count"] == 4 and "llama.expert_feed_forward_length" not in fields
    dense = load_spec(write_synthetic(tmp_path / "llama.gguf", SyntheticConfig("llama")))
    assert not dense.arch.moe and dense.hparams.n_ff_exp == 0


def test_llamacpp_and_the_reference_engine_both_run_a_routed_llama(tmp_path, llama_bin):
    assert_both_run(write_synthetic(tmp_path / "routed-llama.gguf", ROUTED_LLAMA), llama_bin)


def test_verify_a_mixtral_style_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers):
    """A llama whose layers route (Mixtral's layout) solved over two llama.cpp RPC servers of
    unequal budgets, exported and run in real llama.cpp: every tensor where the plan put it, each
    device's memory within 3% + 4 MiB of the plan (docs/measured/2026-11-28-verify-mixtral.txt)."""
    path = tmp_path / "mixtral.gguf"
    r = refengine("synth", path, *("--arch llama --layers 8 --embd 512 --ff 768 --heads 8 "
                                   "--kv-heads 2 --experts 8 --experts-used 2 --vocab 8000 "
                                   "--qtype Q4_K_M").split())  # fmt: skip
    assert r.returncode == 0, r.stderr
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, "48MiB,32MiB", 4096)
    assert "_exps" in out
