"""refengine's runtime beside llama.cpp on one GGUF file, at budgets that are fractions of its
weights: one row a budget with prompt processing (pp) and generation (tg) t/s of
- refengine: `refengine bench`'s tests on the optimizer's plan for the budget, run in this process
  (the kernels compile once for every budget);
- llama.cpp --fit: `llama-bench` with llama.cpp's own fit, held to the budget by a `-fitt` margin
  of the device's free memory less the budget;
- llama.cpp, our flags: `llama-bench` with the placement of a `--target llamacpp` plan solved for
  the same budget (`refengine export --format llama-bench`).
Each row is printed and appended to --out as soon as it is measured.

On the lent GPU (llama.cpp built by scripts/build_llamacpp_cuda.sh):
    python3 scripts/gpu_vs_llamacpp.py MODEL.gguf --llama-bin /tmp/llama-cuda/bin
Here, without a GPU (the stand-in engine; an ggml-rpc-server endpoint as llama.cpp's device):
    python scripts/gpu_vs_llamacpp.py MODEL.gguf --engine standin --rpc 127.0.0.1:50052 -p 32 -n 4
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cudarun.bench_plan import run_bench  # noqa: E402
from cudarun.session import plan_engine  # noqa: E402
from refengine.models import load_model  # noqa: E402
from solver.export import llama_bench_args  # noqa: E402
from solver.llamacpp_check import exported_args, on_rpc, run_llama_bench  # noqa: E402
from solver.profile import for_devices  # noqa: E402
from solver.solve import load_profile  # noqa: E402

MIB = 1 << 20


def free_mib(engine: str) -> int:
    """GPU 0's free memory now, MiB (0 without one): nvidia-smi's, which needs no context."""
    if engine != "cuda":
        return 0
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return int(out.stdout.split()[0])


def context_mib(engine: str) -> int:
    """What creating a CUDA context takes of the GPU, MiB: this process's, measured as it starts
    its own. llama.cpp's fit counts its context against the margin; our budget excludes ours."""
    if engine != "cuda":
        return 0
    from cudarun import driver

    before = free_mib(engine)
    driver.init()
    return max(before - driver.mem_info()[0] // MIB, 0)


def ours(a, spec, budget_mib: int) -> tuple[float, float, str]:
    plan_args = dict(plan_path=None, budget=f"{budget_mib}MiB", reserve="0",
                     profile_name=a.profile, strategy=None, tiers=a.tiers, threads=0)  # fmt: skip
    n_ctx = a.p + a.n + 1
    engine, plan = plan_engine(a.engine, spec, n_ctx, a.p, a.n, **plan_args, say=lambda s: None)
    try:
        profile = for_devices(load_profile(a.profile), 1)
        rows = run_bench(engine, profile, a.p, a.n, [0], repetitions=a.r)
        memory = [line for line in engine.memory_report() if "since the context" in line]
        if hasattr(engine, "launch_report"):  # launches per token: one graph a decode ubatch
            memory += engine.launch_report(profile.gpus[0].launch_seconds.value)
    finally:
        if hasattr(engine, "close"):  # llama.cpp runs next, on the memory the arena held
            engine.close()
    beside = "; ".join(f"{r.test}: measured {r.tps:.1f}, predicted "
                       f"{r.tokens / r.predicted_seconds:.1f}, bound {r.tokens / r.bound_seconds:.1f} t/s"
                       for r in rows)  # fmt: skip
    return rows[0].tps, rows[1].tps, "; ".join([f"refengine {plan['strategy']} plan: {beside}",
                                                 *memory])


def llama(a, args: list[str], timeout_s: float) -> tuple[float, float]:
    records, _ = run_llama_bench(a.llama_bin, a.model, [*args, "-t", str(a.threads)], a.p, a.n,
                                 a.r, timeout_s)  # fmt: skip
    rate = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in records}
    return rate["pp"], rate["tg"]


def our_flags(a, spec, budget_mib: int, work: Path) -> list[str]:
    """The llamacpp plan for the budget, exported as llama-bench's flags (GPU 0 as the RPC
    endpoint with --rpc)."""
    plan = work / f"llamacpp-{budget_mib}.plan.json"
    refengine = [sys.executable, "-m", "refengine"]
    subprocess.run([*refengine, "solve", a.model, "--target", "llamacpp", "--budget",
                    f"{budget_mib}MiB", "--profile", a.profile, "--ctx", str(a.p + a.n),
                    "--prompt-tokens", str(a.p), "--gen-tokens", str(a.n), "--time-limit", "5",
                    "-o", str(plan)], check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    out = subprocess.run([*refengine, "export", str(plan)], check=True, capture_output=True,
                         text=True)  # fmt: skip
    _, args = exported_args(out.stdout.strip().splitlines()[-1])
    if a.rpc:
        args = on_rpc(args, [a.rpc])
    return llama_bench_args(args, spec.hparams.n_layer)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's bin (default: the CPU build's)")
    ap.add_argument("--fractions", default="1,0.25,0.5", help="budgets, as fractions of the weights")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=2, help="timed runs of each test")
    ap.add_argument("--engine", default="cuda", choices=("cuda", "standin"))
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--tiers", default="1,16,512")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="llama.cpp's -t")
    ap.add_argument("--rpc", help="an RPC server as llama.cpp's GPU 0 (no GPU here)")
    ap.add_argument("--out", type=Path, help="also append each line here")
    return ap


class Table:
    """The table's header and rows, each printed and appended to `a.out` as it is measured."""

    def __init__(self, a, say=None):
        self.a = a
        self.spec = load_model(a.model)
        self.work = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_vs_llamacpp"
        self.work.mkdir(parents=True, exist_ok=True)
        self.rpc = ["--rpc", a.rpc, "-dev", "RPC0"] if a.rpc else []
        self.ctx_mib = context_mib(a.engine)
        self.print = say or print

    def say(self, line: str) -> None:
        self.print(line)
        if self.a.out:
            with open(self.a.out, "a") as f:
                f.write(line + "\n")

    def header(self) -> None:
        a, spec = self.a, self.spec
        self.say(f"{spec.name} ({spec.weights_nbytes / MIB:.0f} MiB of weights), pp{a.p} / tg{a.n} "
                 f"t/s, mean of {a.r} runs each; refengine engine {a.engine}, profile {a.profile}")
        self.say("| budget MiB | refengine pp | refengine tg | llama.cpp --fit pp "
                 "| llama.cpp --fit tg | llama.cpp our flags pp | llama.cpp our flags tg |")
        self.say("|---:|---:|---:|---:|---:|---:|---:|")

    def row(self, fraction: float, timeout_s: float = 600) -> None:
        """One budget's row; each of its three runs guarded (a failure is a cell and a note)."""
        a, spec = self.a, self.spec
        budget_mib = int(fraction * spec.weights_nbytes / MIB)
        cells = []
        try:
            pp, tg, memory = ours(a, spec, budget_mib)
            cells += [f"{pp:.1f}", f"{tg:.2f}"]
        except Exception as e:  # noqa: BLE001 - a row says what failed and the table goes on
            cells += ["failed", ""]
            memory = f"refengine at {budget_mib} MiB: {type(e).__name__}: {e}"
        for name in ("fit", "ours"):
            try:
                if name == "fit":  # llama.cpp's model, KV and compute within the budget: the
                    # margin is what its fit sees free (its own context taken) less the budget;
                    # 0 would turn the fit off
                    margin = free_mib(a.engine) - self.ctx_mib - budget_mib
                    flags = ["-fitt", str(max(margin, 1)), *self.rpc]
                else:
                    flags = our_flags(a, spec, budget_mib, self.work)
                pp, tg = llama(a, flags, timeout_s)
                cells += [f"{pp:.1f}", f"{tg:.2f}"]
            except Exception as e:  # noqa: BLE001
                cells += ["failed", ""]
                memory += f"; llama.cpp {name}: {type(e).__name__}: {str(e)[:300]}"
        self.say(f"| {budget_mib} | " + " | ".join(cells) + " |")
        if memory:
            self.say(f"  {memory}")


def main() -> int:
    a = parser().parse_args()
    table = Table(a)
    table.header()
    for fraction in (float(x) for x in a.fractions.split(",")):
        table.row(fraction)
    return 0


if __name__ == "__main__":
    sys.exit(main())
