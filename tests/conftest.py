import pytest

from refengine.synthetic import SyntheticConfig, write_synthetic

SMALL = {
    "llama": SyntheticConfig("llama", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                             n_vocab=300, qtype="Q8_0"),
    "qwen2": SyntheticConfig("qwen2", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                             n_vocab=300, qtype="Q4_1"),
    "qwen3": SyntheticConfig("qwen3", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                             head_dim=32, n_vocab=300, qtype="F16"),
    "qwen3moe": SyntheticConfig("qwen3moe", n_layer=2, n_embd=64, n_ff=128, n_head=4,
                                n_head_kv=2, head_dim=16, n_vocab=300, qtype="Q5_1",
                                n_expert=4, n_expert_used=2, n_ff_exp=32),
    "gemma3": SyntheticConfig("gemma3", n_layer=6, n_embd=64, n_ff=128, n_head=2, n_head_kv=1,
                              head_dim=32, n_vocab=300, qtype="Q5_0", n_swa=5),
}


@pytest.fixture(scope="session")
def small_models(tmp_path_factory):
    """One tiny synthetic GGUF per architecture: {arch: path}."""
    root = tmp_path_factory.mktemp("models")
    return {arch: write_synthetic(root / f"{arch}.gguf", cfg) for arch, cfg in SMALL.items()}
