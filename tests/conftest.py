import os
import subprocess
import sys

import pytest
from gguf import GGUFWriter

from cudarun.driver import gpu_present
from refengine.synthetic import SyntheticConfig, write_synthetic

# Without a GPU the Numba CUDA kernels run on the simulator (tiny shapes); with one, on it. This
# must be decided before anything imports numba.cuda.
GPU = gpu_present()
if not GPU:
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="no NVIDIA GPU here (the simulator runs the kernel tests)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


SMALL = {
    "llama": SyntheticConfig(
        "llama", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=300, qtype="Q8_0"
    ),
    "qwen2": SyntheticConfig(
        "qwen2", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=300, qtype="Q4_1"
    ),
    "qwen3": SyntheticConfig(
        "qwen3",
        n_layer=2,
        n_embd=64,
        n_ff=128,
        n_head=4,
        n_head_kv=2,
        head_dim=32,
        n_vocab=300,
        qtype="F16",
    ),
    "qwen3moe": SyntheticConfig(
        "qwen3moe",
        n_layer=2,
        n_embd=64,
        n_ff=128,
        n_head=4,
        n_head_kv=2,
        head_dim=16,
        n_vocab=300,
        qtype="Q5_1",
        n_expert=4,
        n_expert_used=2,
        n_ff_exp=32,
    ),
    "gemma3": SyntheticConfig(
        "gemma3",
        n_layer=6,
        n_embd=64,
        n_ff=128,
        n_head=2,
        n_head_kv=1,
        head_dim=32,
        n_vocab=300,
        qtype="Q5_0",
        n_swa=5,
    ),
}


@pytest.fixture(scope="session")
def small_models(tmp_path_factory):
    """One tiny synthetic GGUF per architecture: {arch: path}."""
    root = tmp_path_factory.mktemp("models")
    return {arch: write_synthetic(root / f"{arch}.gguf", cfg) for arch, cfg in SMALL.items()}


def tiny_gguf(path, arch: str, tensors: dict, **writer_calls):
    """A hand-made GGUF: `tensors` maps name -> (array, raw ggml type or None); each keyword
    calls `GGUFWriter.add_<keyword>(value)` (e.g. embedding_length=8)."""
    w = GGUFWriter(path, arch)
    for call, value in writer_calls.items():
        getattr(w, f"add_{call}")(value)
    for name, (array, raw_dtype) in tensors.items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refengine(*args, timeout_seconds: int = 600, env: dict | None = None):
    """Run the `refengine` command as a user does, in a subprocess (`env`: its whole
    environment)."""
    return subprocess.run(
        [sys.executable, "-m", "refengine", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout_seconds,
        env=env,
    )
