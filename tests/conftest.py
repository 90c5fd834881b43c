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
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    # The simulator runs a block's threads as Python threads and its manager polls them in a loop
    # that holds the GIL they need (at the default 5 ms switch interval the CUDA engine's
    # tier-switch test took 126 s). A poller that sleeps between its polls gives the threads the
    # GIL: the tensor-split test takes 7.6 s instead of 26.5 at the 0.1 ms switch interval that
    # served before it.
    from .simulator_pace import pace

    pace()
    # and its copies as asynchronous as a GPU's where the host can tell (read before waiting,
    # rewritten while a copy still reads): those races pass the simulator and fail on a GPU
    from . import simulator_async

    simulator_async.install()


@pytest.fixture(autouse=True)
def no_copy_hazards():
    """A test fails where a host-to-device copy's source changed before the host waited for it."""
    from . import simulator_async

    simulator_async.HAZARDS.clear()
    yield
    if simulator_async.HAZARDS:
        pytest.fail("; ".join(dict.fromkeys(simulator_async.HAZARDS)))


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


@pytest.fixture(scope="session")
def int8_gemma3(tmp_path_factory):
    """A gemma3 for the int8 path's end-to-end bounds: the shape llama.cpp's own int8 path was
    recorded on (tests/golden.py), in a q8 type. The tiny gemma3 of `small_models` (64 wide,
    32-dim heads, a 5-token window, logits of 2.2 nats' entropy) reads mean KL 5.5e-3 through
    the int8 path however its prompt is cut (q8 rows, int8 tiles or a token a step), where its
    products' errors are llama's (4-10e-3 normwise each); this shape reads 2-2.6e-3 over three
    seeds."""
    from dataclasses import replace

    from .golden import SYNTHETIC_CASES

    path = tmp_path_factory.mktemp("int8") / "gemma3.gguf"
    return write_synthetic(path, replace(SYNTHETIC_CASES["synthetic-gemma3"], qtype="Q5_0"))


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


@pytest.fixture(scope="session")
def llama_bin():
    """Real llama.cpp (CPU + RPC) from the PyPI sdist, built once into the cache by
    scripts/build_llamacpp.sh (about 12 minutes on two cores the first time; .ci/run builds it)."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "build_llamacpp.sh"
    env = dict(os.environ, PYTHON=sys.executable)
    out = subprocess.run([str(script)], capture_output=True, text=True, env=env)
    assert out.returncode == 0, f"building llama.cpp failed:\n{out.stderr[-3000:]}"
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def rpc_servers(llama_bin):
    """Three llama.cpp RPC servers on localhost, devices to llama.cpp: their endpoints."""
    import socket
    import time

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    ports = [free_port() for _ in range(3)]
    procs = [
        subprocess.Popen([str(llama_bin / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(p)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        for p in ports
    ]
    try:
        for p in ports:
            for _ in range(100):
                try:
                    socket.create_connection(("127.0.0.1", p), timeout=0.1).close()
                    break
                except OSError:
                    time.sleep(0.05)
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        for proc in procs:
            proc.kill()
