"""The runtime's GPU acceptance (the engine issue), ready to run on the lent GPU machine after
scripts/gpu_check.sh (scripts/device_session.sh runs its agreement stage):

1. the machine's profile (`refengine profile`), used by every plan below;
2. SmolLM2-135M- and Gemma-3-270M-shaped synthetic models under three plans each (everything
   pinned; 40% of the weights, streaming; CPU-placed tensors), prefill at tier 512 and decode at
   tier 1: greedy 64 tokens against the NumPy engine (CONTRACTS.md's near-tie rule and bounds);
3. an 8B-shaped Q4_K model: `optimal` against `fit` (op-offload streamed at >= 32 tokens) at 25%,
   50% and 75% of its weights — TTFT at a 4K prompt and end-to-end 4K in / 200 out — and, for the
   all-pinned and half-streamed plans, tiers 1 and 512 at depths 0 and 4096, measured next to
   predicted; the half-streamed decode traced (Gantt PNG) with its copy/compute overlap.

Each stage is one call of a few minutes on the device (`--stage`); every line is appended to
<date>-runtime-gpu-check.txt in $OUT (the device tool's; else docs/measured/) as soon as it is
printed, so a call cut short by its time limit keeps what it measured.

    python3 scripts/runtime_gpu_check.py [--stage agreement|eight-b|per-test] [--quick]
        [--profile P]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cudarun.bench_plan import run_bench  # noqa: E402
from cudarun.cuda_engine import CudaEngine  # noqa: E402
from cudarun.trace import overlap_fraction, write_trace  # noqa: E402
from refengine.agreement import agreement_along, reference_run  # noqa: E402
from refengine.engine import NumpyEngine  # noqa: E402
from refengine.spec import load_spec  # noqa: E402
from refengine.synthetic import SyntheticConfig, preset, write_synthetic  # noqa: E402
from solver.cost import Workload  # noqa: E402
from solver.profile import HardwareProfile  # noqa: E402
from solver.solve import load_profile, solve_plan  # noqa: E402

OUT_DIR = ROOT / "docs" / "measured"


class Log(list):
    """The lines printed, each also appended at once to the files named."""

    def __init__(self, paths: list[Path]):
        super().__init__()
        self.paths = paths

    def append(self, text: str) -> None:
        super().append(text)
        for path in self.paths:
            with open(path, "a") as f:
                f.write(text + "\n")


def say(lines: Log, text: str) -> None:
    print(text, flush=True)
    lines.append(text)


def engine_for(spec, profile, fraction, strategy, n_ctx, prompt, gen, tiers):
    w = Workload(n_ctx=n_ctx, prompt_tokens=prompt, gen_tokens=gen, threads=profile.cpu.threads)
    plan = solve_plan(spec, profile, w, tiers, [int(fraction * spec.weights_nbytes)], strategy)
    engine = CudaEngine(spec, plan)
    engine.warm_up()
    return engine, plan


# Qwen2-1.5B's shape (its config.json), beside the two presets: `--stage agreement-1.5b`
QWEN2_1_5B = SyntheticConfig("qwen2", n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2,
                             n_vocab=151936, qtype="Q4_K_M", name="qwen2-1.5b")  # fmt: skip


def agreement(lines, models: Path, profile, quick: bool, names=("smollm2-135m", "gemma3-270m")):
    for name in names:
        config = QWEN2_1_5B if name == "qwen2-1.5b" else preset(name)
        path = write_synthetic(models / f"{name}.gguf", config)
        spec = load_spec(str(path))
        reference = NumpyEngine(spec, n_ctx=1024)
        prompt = list(np.random.default_rng(0).integers(0, spec.hparams.n_vocab, 100))
        rows = reference_run(reference, prompt, 64)
        for label, fraction, strategy in (("pinned", 3.0, None), ("streamed-40%", 0.4, None),
                                          ("cpu-placed", 0.4, "ffncpu-attnstream")):  # fmt: skip
            engine, plan = engine_for(spec, profile, fraction, strategy, 1024, 100, 64, [1, 512])
            a = agreement_along(engine, prompt, rows, engine.tolerance)
            say(lines, f"{name} {label}: {'OK' if a.ok else 'FAILS'}: {a.summary()}")
            for line in engine.memory_report():
                say(lines, "  " + line)
            engine.close()


def eight_b(lines, models: Path, profile, quick: bool) -> None:
    spec = eight_b_spec(models)
    prompt, gen = (512, 32) if quick else (4096, 200)
    n_ctx = prompt + gen + 8
    say(
        lines,
        f"\n8B-shaped: optimal vs fit, TTFT at {prompt} in, end-to-end {prompt} in / {gen} out",
    )
    say(lines, "budget  plan     TTFT s  e2e s   predicted TTFT  predicted e2e")
    for fraction in (0.25, 0.5, 0.75):
        for strategy in (None, "fit"):
            engine, plan = engine_for(spec, profile, fraction, strategy, n_ctx, prompt, gen,
                                      [1, 16, 512])  # fmt: skip
            ids = np.random.default_rng(1).integers(0, spec.hparams.n_vocab, prompt)
            start = time.perf_counter()
            logits = engine.prefill(ids)
            ttft = time.perf_counter() - start
            for _ in range(gen - 1):
                logits = engine.decode(int(np.argmax(logits)))
            e2e = time.perf_counter() - start
            p = plan["prediction"]
            say(lines, f"{fraction:>5.0%}  {plan['strategy']:<8} {ttft:7.2f} {e2e:7.2f} "
                       f"{p['ttft_seconds']:14.2f} {p['e2e_seconds']:14.2f}")  # fmt: skip
            engine.close()


def eight_b_spec(models: Path):
    path = models / "llama3-8b-q4k.gguf"
    if not path.exists():
        write_synthetic(path, preset("llama3-8b"))
    return load_spec(str(path))


def per_test(lines, models: Path, profile, quick: bool) -> None:
    spec = eight_b_spec(models)
    say(lines, "\n8B-shaped: measured vs predicted per test (all pinned = 1.5x the weights)")
    for label, fraction in (("all-pinned", 1.5), ("half-streamed", 0.5)):
        engine, plan = engine_for(spec, profile, fraction, None, 4096 + 600, 512, 128, [1, 512])
        trace = label == "half-streamed"
        if trace:
            engine.trace_events = []
        rows = run_bench(engine, profile, 512, 32 if quick else 128, [0, 4096])
        for r in rows:
            say(lines, f"{label:<14} {r.test:<14} measured {r.tps:9.2f} t/s  predicted "
                       f"{r.tokens / r.predicted_seconds:9.2f}  bound {r.tokens / r.bound_seconds:9.2f}"
                       f"  measured/predicted {r.measured_seconds / r.predicted_seconds:.2f}")  # fmt: skip
        for line in engine.memory_report() + engine.launch_report(
            profile.gpus[0].launch_seconds.value
        ):
            say(lines, "  " + line)
        if trace and engine.trace_events:
            png = write_trace(engine.trace_events, OUT_DIR / "half-streamed-trace.json")
            say(
                lines,
                f"  trace {png}: copies under compute {overlap_fraction(engine.trace_events):.0%}",
            )
        engine.close()


def agreement_1_5b(lines, models: Path, profile, quick: bool) -> None:
    agreement(lines, models, profile, quick, ("qwen2-1.5b",))


STAGES = {"agreement": "agreement", "agreement-1.5b": "agreement_1_5b", "eight-b": "eight_b",
          "per-test": "per_test"}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", choices=sorted(STAGES), action="append",
                    help="one part of the check (repeatable; default: all, in order)")
    ap.add_argument("--quick", action="store_true", help="a 512-token prompt instead of 4K")
    ap.add_argument("--profile", help="a profile file or shipped name (default: measure now)")
    args = ap.parse_args()
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    models = Path(os.environ.get("REFENGINE_MODELS", ROOT / "models"))
    models.mkdir(parents=True, exist_ok=True)
    name = f"{date.today()}-runtime-gpu-check.txt"
    paths = [Path(os.environ["OUT"]) / name if os.environ.get("OUT") else OUT_DIR / name]
    lines = Log(paths)
    smi = shutil.which("nvidia-smi")
    say(lines, subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()
        if smi else "(no nvidia-smi here)")  # fmt: skip
    if args.profile:
        profile = load_profile(args.profile)
    else:
        prof_path = OUT_DIR / f"{date.today()}-profile.json"
        subprocess.run([sys.executable, "-m", "refengine", "profile", "-o", str(prof_path)],
                       check=True)  # fmt: skip
        profile = HardwareProfile.load(prof_path)
    say(lines, f"runtime GPU check, {date.today()}, profile {profile.name}, "
               f"stages {', '.join(args.stage or STAGES)}")  # fmt: skip
    for stage in args.stage or STAGES:
        globals()[STAGES[stage]](lines, models, profile, args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
