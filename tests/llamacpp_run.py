"""A file run by real llama.cpp (`llama-completion`), and by the reference engine on the same
prompt: both load it and generate."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path

from refengine.engine import NumpyEngine
from refengine.generate import generate, prompt_for
from refengine.sampling import Sampler
from refengine.spec import load_spec

PROMPT = "the cat sat on the mat and then"
N_PREDICT = 8
N_CTX = 256


def assert_both_run(path: Path, llama_bin: Path) -> None:
    spec = load_spec(path)
    request = prompt_for(spec, PROMPT, None, N_PREDICT, N_CTX)
    ours = generate(NumpyEngine(spec, n_ctx=N_CTX), request, N_PREDICT, Sampler(0.0, 0, 1.0, 0),
                    io.StringIO())  # fmt: skip
    assert ours.tokens
    cmd = [str(llama_bin / "llama-completion"), "-m", str(path), "-p", PROMPT, "-n",
           str(N_PREDICT), "--temp", "0", "-t", "2", "-c", str(N_CTX), "-no-cnv", "--no-warmup"]
    p = subprocess.run(cmd, capture_output=True, timeout=120)
    if p.returncode == 0 and not p.stdout:  # under CI's load it has once exited 0 printing
        p = subprocess.run(cmd, capture_output=True, timeout=120)  # nothing: once more
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.decode(errors="replace").startswith(PROMPT), (p.stdout, p.stderr[-2000:])
