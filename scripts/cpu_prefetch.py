"""The CPU row loops' software prefetch distance (`cudarun.kernels.simd.PREFETCH_BYTES`) swept on
this machine: a decode's matvec rate at each distance (weights rotated through twice the last-level
cache, so every byte comes from DRAM) beside the host's parallel read of 1 GiB, the ceiling.

    .venv/bin/python scripts/cpu_prefetch.py [--threads 2] [--distances 0,512,1024,2048,4096]

Each distance runs in its own process: the row intrinsics read the distance when they compile.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a decode's matrices of the models the CPU benchmarks run: qwen2-1.5B's FFN up and down, SmolLM2's
SHAPES = (("Q4_K", (8960, 1536)), ("Q6_K", (1536, 8960)), ("Q4_1", (1536, 576)))

_CHILD = """
import json, sys
from cudarun import bench_cpu
threads = int(sys.argv[1])
shapes = json.loads(sys.argv[2])
rows = [bench_cpu.matmul_rate(t, tuple(s), 1, threads, q8=True).gbps for t, s in shapes]
print(json.dumps({"rates": rows, "read": bench_cpu.host_read_gbps(threads)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--distances", default="0,512,1024,2048,4096")
    a = ap.parse_args()
    print(f"q8 matvec, 1 token, -t {a.threads}, GB/s of weights (every byte from DRAM) / the "
          "host's 1 GiB parallel read")
    print(f"{'prefetch B':>10}  " + "  ".join(f"{t} {s[0]}x{s[1]:<6}" for t, s in SHAPES)
          + "  host read")  # fmt: skip
    for d in a.distances.split(","):
        env = dict(os.environ, REFENGINE_PREFETCH_BYTES=d)
        out = subprocess.run([sys.executable, "-c", _CHILD, str(a.threads), json.dumps(SHAPES)],
                             capture_output=True, text=True, check=True, cwd=ROOT, env=env)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        cells = "  ".join(f"{r:>6.1f} ({r / got['read']:.0%})".rjust(17) for r in got["rates"])
        print(f"{d:>10}  {cells}  {got['read']:>9.1f}", flush=True)


if __name__ == "__main__":
    main()
