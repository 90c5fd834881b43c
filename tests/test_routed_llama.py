"""A llama file with routed experts (Mixtral's layout): llama.cpp routes it by its expert count
alone, every layer, softmax over the experts, the top k renormalized, each expert as wide as
feed_forward_length (docs/llamacpp-architectures.md, 2.7). We read, plan and run it the same."""

from __future__ import annotations

from refengine.gguf_file import read_gguf
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic

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
