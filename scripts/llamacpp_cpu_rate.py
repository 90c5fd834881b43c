"""llama.cpp's CPU decode rate on this machine, as weight bytes per second: the peer figure that
`refengine bench-kernels --cpu --peer FILE` holds the CPU matvec to (issue: at least 0.8x).

Run in an environment with llama-cpp-python (it builds llama.cpp from source, ~8 min on two cores),
not in CI; it writes one synthetic llama model per type (every matrix of that type, 4096-wide, the
shapes of the benchmark's matvecs) and decodes with them:

    python -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python==0.3.36 gguf numpy
    /tmp/llama/bin/python scripts/llamacpp_cpu_rate.py --out /tmp/peer.json
    .venv/bin/refengine bench-kernels --cpu --peer /tmp/peer.json

Weight bytes per second = model file bytes x generated tokens per second (the issue's definition;
the file is almost all matrices here: a 512-token vocabulary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_cpp import Llama, __version__ as llama_cpp_version  # noqa: E402

from refengine.synthetic import SyntheticConfig, write_synthetic  # noqa: E402

SHAPE = dict(n_layer=4, n_embd=4096, n_ff=14336, n_head=32, n_head_kv=8, n_vocab=512)


def decode_rate(path: Path, threads: int, tokens: int, runs: int) -> float:
    """Median generated tokens per second over `runs` greedy runs of `tokens` tokens (the median,
    as `refengine bench-kernels` takes for ours: this host is shared and noisy)."""
    llm = Llama(str(path), n_ctx=256, n_batch=64, n_threads=threads, verbose=False)
    rates = []
    for _ in range(runs + 1):  # the first warms up
        llm.reset()
        llm.eval(llm.tokenize(b"hello world"))
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    result = {"llama_cpp_version": llama_cpp_version, "threads": args.threads, "types": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in ("Q4_K", "Q8_0"):
            path = write_synthetic(Path(tmp) / f"{qtype}.gguf", SyntheticConfig(qtype=qtype, **SHAPE))
            tps = decode_rate(path, args.threads, args.tokens, args.runs)
            nbytes = path.stat().st_size
            result["types"][qtype] = {
                "file_nbytes": nbytes,
                "tokens_per_second": round(tps, 3),
                "weight_gbps": round(nbytes * tps / 1e9, 3),
            }
            print(f"{qtype}: {nbytes / 2**20:.0f} MiB x {tps:.2f} t/s = {nbytes * tps / 1e9:.2f} GB/s")
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
