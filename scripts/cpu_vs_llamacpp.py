"""Our CPU matvec against llama.cpp's decode on this machine, alternated: this host is shared and
its memory bandwidth swings by 2x within minutes, so one measurement of each side can be taken in
different weather. Each round measures llama.cpp (scripts/llamacpp_cpu_rate.py, in an environment
with llama-cpp-python), then ours (`cudarun.bench_cpu`, 1 token, both acceptance shapes), then the
host read ceiling; the table gives every round and the median ratio.

    .venv/bin/python scripts/cpu_vs_llamacpp.py --llama-python /tmp/llama/bin/python [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cudarun import bench_cpu  # noqa: E402

TYPES = ("Q4_K", "Q8_0")
SHAPES = ((4096, 14336), (14336, 4096))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-python", required=True, help="a python with llama-cpp-python")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    ratios = {(t, s): [] for t in TYPES for s in SHAPES}
    print("round  type  shape        ours GB/s  llama.cpp GB/s  ratio  host read GB/s")
    for k in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            peer = Path(tmp) / "peer.json"
            cmd = [args.llama_python, str(ROOT / "scripts/llamacpp_cpu_rate.py"), "--out", str(peer)]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            subprocess.run(cmd, check=True, capture_output=True)
            theirs = {t: v["weight_gbps"] for t, v in json.loads(peer.read_text())["types"].items()}
        for t in TYPES:
            for shape in SHAPES:
                ours = bench_cpu.matmul_rate(t, shape, 1, args.threads, 9).gbps
                ratios[t, shape].append(ours / theirs[t])
                read = bench_cpu.host_read_gbps(args.threads)
                print(
                    f"{k:5}  {t:4}  {shape[0]:5}x{shape[1]:<5}  {ours:9.2f}  {theirs[t]:14.2f}"
                    f"  {ours / theirs[t]:5.2f}  {read:14.1f}"
                )
    print("median ratio (ours / llama.cpp), 1 token:")
    for (t, shape), r in ratios.items():
        print(f"  {t} {shape[0]}x{shape[1]}: {statistics.median(r):.2f}  (rounds: "
              + ", ".join(f"{x:.2f}" for x in r) + ")")


if __name__ == "__main__":
    main()
