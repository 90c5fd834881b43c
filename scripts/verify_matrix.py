"""`refengine verify` over models x 1, 2 and 3 devices with unequal budgets, the devices being
llama.cpp RPC servers on localhost (issue 18's acceptance): solve --target llamacpp, then verify,
and one row per device of each plan — planned and allocated MiB, tensors placed as planned.

    .venv/bin/python scripts/verify_matrix.py [--out docs/measured/verify-matrix.txt]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# model -> (solve flags, budgets per device count, or per (count, plan) where llama.cpp's fit and
# the optimizer need other budgets to use every device): every plan of n devices uses all n
# (found by solving; Gemma-3's fit needs room for llama.cpp's 512-token compute buffer of its
# 262K-token head on each device it uses, and found no three-device placement at any budgets
# tried: its row says it uses two)
CASES = {
    "smollm2-135m": (["--ctx", "2048", "--tiers", "1,512"],
                     {1: "200MiB", 2: "300MiB,200MiB", 3: "100MiB,60MiB,160MiB"}),
    "gemma3-270m": (["--ctx", "4096", "--tiers", "1,32"],
                    {1: "400MiB", (2, "optimal"): "150MiB,400MiB", (2, "fit"): "640MiB,720MiB",
                     (3, "optimal"): "40MiB,50MiB,220MiB", (3, "fit"): "540MiB,560MiB,690MiB"}),
    "qwen3moe": (["--ctx", "4096", "--tiers", "1,512"],
                 {1: "60MiB", 2: "50MiB,60MiB", 3: "50MiB,50MiB,60MiB"}),
}  # fmt: skip
# over several devices the optimizer's layer split (verify reads layer placements) and llama.cpp's
# own fit, which fills every GPU it can from the last
PLANS = {"optimal": ["--split-mode", "layer"], "fit": ["--strategy", "fit"]}
MOE = ("--arch qwen3moe --layers 8 --embd 512 --ff 1024 --heads 8 --kv-heads 4 --experts 16 "
       "--experts-used 4 --expert-ff 384 --vocab 8000 --qtype Q4_K")  # fmt: skip


def refengine(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "refengine", *map(str, args)],
                          capture_output=True, text=True)  # fmt: skip


def profile_with(n_gpus: int, out: Path) -> Path:
    """The RTX 4090 + RTX 3060 profile with GPUs dropped or the 3060 repeated to n_gpus."""
    d = json.loads((ROOT / "examples/profiles/rtx4090-rtx3060-epyc-7742.json").read_text())
    d["gpus"] = (d["gpus"] + [d["gpus"][1]] * 2)[:n_gpus]
    d["name"] = f"{d['name']}-{n_gpus}gpu"
    out.write_text(json.dumps(d))
    return out


def start_servers(bin_dir: Path, n: int) -> tuple[list[subprocess.Popen], list[str]]:
    ports = []
    for _ in range(n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    procs = [subprocess.Popen([str(bin_dir / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(p)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for p in ports]  # fmt: skip
    time.sleep(0.5)
    return procs, [f"127.0.0.1:{p}" for p in ports]


ROW = re.compile(r"│ (RPC\d)\s+│ plan\s+│\s+([\d.]+) │\s+([\d.]+) │\s+([\d.]+) │\s+([\d.]+) │\s+(\d+) │ (.+?)\s+│")
LLAMA = re.compile(r"│\s+│ llama\.cpp │\s+([\d.]+) │\s+([\d.]+) │\s+([\d.]+) │\s+([\d.]+) │")


def verify_case(bin_dir, endpoints, tmp, path, model, flags, n, budget, kind, how) -> list[str]:
    """One plan solved and verified: a line per device."""
    plan = tmp / f"{model}-{n}-{kind}.json"
    head = f"{model:14s} {n:4d} {kind:8s}"
    r = refengine("solve", path, "--target", "llamacpp", "--profile",
                  profile_with(n, tmp / f"p{n}.json"), "--budget", budget, *flags, *how,
                  "-o", plan)  # fmt: skip
    if r.returncode != 0:
        return [f"{head} solve failed: {r.stderr.strip()}"]
    r = refengine("verify", plan, "--llama-bin", bin_dir, "--rpc", ",".join(endpoints))
    placed = re.search(r"tensors placed as planned: (\S+)", r.stdout)
    rows, llama = ROW.findall(r.stdout), LLAMA.findall(r.stdout)
    if not rows:
        return [f"{head} verify failed: {r.stderr.strip()}"]
    out = []
    used = sum(float(plan_total) > 0 or float(got) > 0
               for (*_, plan_total, _b, _v), (*_, got) in zip(rows, llama))  # fmt: skip
    for (dev, *_, plan_total, budget_mib, verdict), (*_, got) in zip(rows, llama):
        off = (float(got) - float(plan_total)) / max(float(plan_total), 1e-9)
        if float(plan_total) == 0 and float(got) == 0:  # proves nothing of the memory model
            verdict = "holds nothing: no claim"
        out.append(f"{head} {dev:6s} {budget_mib:>7s} {float(plan_total):8.1f} {float(got):9.1f} "
                   f"{100 * off:+6.1f}  {verdict:24s} {placed.group(1) if placed else '?'}"
                   f"{'' if used == n else f'  (uses {used} of {n} devices)'}")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--llama-bin", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from solver.llamacpp_check import default_llama_bin

    bin_dir = args.llama_bin or default_llama_bin()
    lines = ["refengine verify on llama.cpp RPC servers (localhost): planned / allocated MiB",
             f"{'model':14s} {'devs':>4s} {'plan':8s} {'device':6s} {'budget':>7s} {'plan':>8s} "
             f"{'llama.cpp':>9s} {'off %':>6s}  {'verdict':24s} placed"]  # fmt: skip
    procs, endpoints = start_servers(bin_dir, 3)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tmp = Path(tmp)
            moe = tmp / "qwen3moe.gguf"
            r = refengine("synth", moe, *MOE.split())
            assert r.returncode == 0, r.stderr
            for model, (flags, budgets) in CASES.items():
                path = moe if model == "qwen3moe" else model
                for n in (1, 2, 3):
                    for kind, how in PLANS.items() if n > 1 else [("optimal", [])]:
                        budget = budgets.get((n, kind)) or budgets[n]
                        lines += verify_case(bin_dir, endpoints, tmp, path, model, flags, n,
                                             budget, kind, how)  # fmt: skip
                        print("\n".join(lines[-n:]), flush=True)
    finally:
        for p in procs:
            p.kill()
    claims = [line for line in lines[2:] if "RPC" in line and "no claim" not in line]
    worst = max((abs(float(line.split()[7])) for line in claims), default=0.0)
    lines.append(f"{len(claims)} device rows hold something (the claims); worst off the plan "
                 f"{worst:.1f}%; rows over budget or off the plan: "
                 f"{sum('off plan' in line or 'over budget' in line for line in claims)}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
