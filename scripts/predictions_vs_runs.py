"""The cost model's predictions held against real runs on this machine (issue 33): for each model,
llama.cpp's CPU backend (`llama-bench -t T`, no GPU) beside the `--target llamacpp` cost model
with every part on the CPU, and our cpu engine (`refengine bench --engine cpu`) beside the
`refengine` cost model — pp512 and tg128 at depth 0 and a deeper one — from a profile that
`refengine profile` measured on this machine. Rounds alternate the two systems (the host is shared
and noisy); each cell is the median of its rounds; ratio = measured t/s / predicted t/s.

Models: SmolLM2-135M and Gemma-3-270M (real, depth 4096), and synthetic files at the shapes of
Qwen2-1.5B, a small Qwen3-MoE and Llama-3.2-1B (depth 2048), Q4_K_M. The cost model's terms may be
fitted on the first three only; the last two are held out (marked *).

    python scripts/predictions_vs_runs.py --profile P.json [--rounds 3] [--models a,b]
        [--raw raw.json] [--out docs/measured/DATE-predictions-vs-runs.txt]

`--profile-each-round` measures the profile too, once at the start of every round (`refengine
profile`, written beside P as P's stem + `.round-R.json`), and writes P as their median, figure by
figure; rounds then go model after model, so every cell's runs and the profile's figures sample
the same hour of a shared host whose memory bandwidth drifts by a fifth over tens of minutes.

`--raw` keeps every run's figures (appended as measured; a rerun with the same file reuses them
and measures only what is missing), so the prediction side can be recomputed after a model fix
without running anything again (`--predict-only`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from refengine.models import load_model, resolve_model  # noqa: E402
from refengine.synthetic import SyntheticConfig, write_synthetic  # noqa: E402
from solver.cpu_tests import cpu_cost_model, generation_seconds, prompt_seconds  # noqa: E402
from solver.solve import load_profile  # noqa: E402

N_PROMPT, N_GEN = 512, 128
SYNTHETIC = {  # name -> (config, held out)
    "qwen2-1.5b": (SyntheticConfig("qwen2", n_layer=28, n_embd=1536, n_ff=8960, n_head=12,
                                   n_head_kv=2, n_vocab=151936, qtype="Q4_K_M"), False),
    "qwen3moe-2b": (SyntheticConfig("qwen3moe", n_layer=16, n_embd=1024, n_ff=3072, n_head=16,
                                    n_head_kv=4, head_dim=64, n_vocab=32000, qtype="Q4_K_M",
                                    n_expert=32, n_expert_used=4, n_ff_exp=512), True),
    "llama-1b": (SyntheticConfig("llama", n_layer=16, n_embd=2048, n_ff=8192, n_head=32,
                                 n_head_kv=8, n_vocab=128256, qtype="Q4_K_M"), True),
}  # fmt: skip
DEPTH = {"smollm2-135m": 4096, "gemma3-270m": 4096}  # the others: 2048
MODELS = ("smollm2-135m", "gemma3-270m", "qwen2-1.5b", "qwen3moe-2b", "llama-1b")


def model_file(name: str, models: Path) -> str:
    if name not in SYNTHETIC:
        return str(resolve_model(name))
    path = models / f"{name}.gguf"
    if not path.exists():
        write_synthetic(path, SYNTHETIC[name][0])
    return str(path)


def llama_bin(given: Path | None) -> Path:
    if given:
        return given
    out = subprocess.run([str(ROOT / "scripts" / "build_llamacpp.sh")], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


def cells(records: list[dict]) -> dict[str, float]:
    """llama-bench-style records -> {"pp512@0": t/s, ...}."""
    out = {}
    for r in records:
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        out[f"{test}@{r.get('n_depth', 0)}"] = r["avg_ts"]
    return out


def run_llamacpp(bin_dir: Path, path: str, threads: int, depth: int) -> dict[str, float]:
    out = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", path, "-t", str(threads), "-p", str(N_PROMPT), "-n",
         str(N_GEN), "-d", f"0,{depth}", "-r", "1", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return cells(json.loads(out.stdout))


def run_ours(path: str, threads: int, depth: int, profile: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "refengine", "bench", path, "--engine", "cpu", "--threads",
         str(threads), "-p", str(N_PROMPT), "-n", str(N_GEN), "--depth", f"0,{depth}", "-r", "1",
         "-c", str(depth + N_PROMPT + N_GEN + 8), "--profile", profile, "-o", "json"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    return cells(json.loads(out.stdout))


def predicted(name: str, path: str, profile, threads: int, depth: int) -> dict[str, dict]:
    """{system: {cell: t/s}} from the cost model."""
    spec = load_model(path)
    out = {}
    for system, target in (("llama.cpp", "llamacpp"), ("ours", "refengine")):
        cm = cpu_cost_model(spec, profile, target, threads, depth + N_PROMPT + N_GEN + 8)
        out[system] = {}
        for d in (0, depth):
            out[system][f"pp{N_PROMPT}@{d}"] = N_PROMPT / prompt_seconds(cm, N_PROMPT, d)
            out[system][f"tg{N_GEN}@{d}"] = N_GEN / generation_seconds(cm, N_GEN, d)
    return out


def median_profile(profiles: list[dict]) -> dict:
    """Figure by figure (every {"value", "source"}), the median of the profiles' values."""
    first = profiles[0]
    if isinstance(first, dict) and "value" in first and "source" in first:
        value = statistics.median(p["value"] for p in profiles)
        return {**first, "value": value,
                "source": f"median of {len(profiles)} profiles; {first['source']}"}  # fmt: skip
    if isinstance(first, dict):
        return {k: median_profile([p[k] for p in profiles]) if all(k in p for p in profiles)
                else v for k, v in first.items()}  # fmt: skip
    if isinstance(first, list) and all(len(p) == len(first) for p in profiles):
        return [median_profile(list(items)) for items in zip(*profiles)]
    return first


def measure_profile(out: Path, threads: int, bin_dir: Path, gpu_from: str) -> None:
    subprocess.run([sys.executable, "-m", "refengine", "profile", "-o", str(out), "--gpu-from",
                    gpu_from, "--threads", str(threads), "--llama-bin", str(bin_dir)],
                   check=True, cwd=ROOT)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="measured here by `refengine profile`")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llama-bin", type=Path)
    ap.add_argument("--raw", type=Path, help="every run's figures, kept and reused (JSON lines)")
    ap.add_argument("--predict-only", action="store_true", help="measure nothing: --raw's runs")
    ap.add_argument("--profile-each-round", action="store_true",
                    help="measure the profile each round; --profile: their median, written")
    ap.add_argument("--gpu-from", default="h100", help="the GPU side of measured profiles")
    ap.add_argument("--synthetic-dir", type=Path, default=Path("/tmp/refengine-predictions"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    a.synthetic_dir.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in a.models.split(",") if n.strip()]
    runs = []  # (model, system, round, {cell: t/s})
    if a.raw and a.raw.exists():
        runs = [tuple(json.loads(line)) for line in a.raw.read_text().splitlines() if line]
    bin_dir = None if a.predict_only else llama_bin(a.llama_bin)
    paths = {name: model_file(name, a.synthetic_dir) for name in names}
    rounds = [Path(a.profile).with_suffix(f".round-{r}.json") for r in range(a.rounds)]
    for r in range(a.rounds):
        if a.profile_each_round and not rounds[r].exists() and not a.predict_only:
            measure_profile(rounds[r], a.threads, bin_dir, a.gpu_from)
        bench_profile = str(rounds[r] if a.profile_each_round else a.profile)
        for name in names:
            depth = DEPTH.get(name, 2048)
            for system in ("llama.cpp", "ours"):
                if a.predict_only or any(m == name and s == system and k == r
                                         for m, s, k, _ in runs):  # fmt: skip
                    continue
                got = (run_llamacpp(bin_dir, paths[name], a.threads, depth)
                       if system == "llama.cpp"
                       else run_ours(paths[name], a.threads, depth, bench_profile))  # fmt: skip
                runs.append((name, system, r, got))
                print(name, system, r, got, flush=True)
                if a.raw:
                    with open(a.raw, "a") as f:
                        f.write(json.dumps([name, system, r, got]) + "\n")
    if a.profile_each_round:
        merged = median_profile([json.loads(p.read_text()) for p in rounds if p.exists()])
        Path(a.profile).write_text(json.dumps(merged, indent=1) + "\n")
    profile = load_profile(a.profile)
    lines = [f"predictions vs runs, {date.today()}, {a.threads} threads, profile {profile.name} "
             f"({a.profile}); medians of {a.rounds} alternated rounds; ratio = measured / "
             "predicted t/s; * held out of any fit; spread = slowest to fastest round"]  # fmt: skip
    lines.append(f"{'model':14s} {'system':9s} {'test':10s} {'measured':>9s} {'predicted':>9s} "
                 f"{'ratio':>6s} {'spread':>13s}")  # fmt: skip
    # under drift, a round's runs beside its own profile's prediction: the median of those ratios
    by_round = {r: load_profile(str(p)) for r, p in enumerate(rounds)
                if a.profile_each_round and p.exists()}  # fmt: skip
    if by_round:
        lines[0] += "; by round = median over rounds of a round's runs / its own profile's"
        lines[1] += f" {'by round':>8s}"
    worst = (0.0, "")
    for name in names:
        path, depth = paths[name], DEPTH.get(name, 2048)
        pred = predicted(name, path, profile, a.threads, depth)
        pred_r = {r: predicted(name, path, p, a.threads, depth) for r, p in by_round.items()}
        held = name in SYNTHETIC and SYNTHETIC[name][1]
        for system in ("llama.cpp", "ours"):
            ratios = []
            for cell, want in pred[system].items():
                got = [g[cell] for m, s, _, g in runs if m == name and s == system and cell in g]
                if not got:
                    continue
                measured = statistics.median(got)
                ratio = measured / want
                ratios.append(ratio)
                if abs(math.log(ratio)) > abs(math.log(worst[0] or 1.0)):
                    worst = (ratio, f"{name} {system} {cell}")
                own = [g[cell] / pred_r[k][system][cell] for m, s, k, g in runs
                       if m == name and s == system and cell in g and k in pred_r]  # fmt: skip
                lines.append(f"{name + ('*' if held else ''):14s} {system:9s} {cell:10s} "
                             f"{measured:9.1f} {want:9.1f} {ratio:6.2f} "
                             f"{f'{min(got):.0f}-{max(got):.0f}':>13s}"
                             + (f" {statistics.median(own):8.2f}" if own else ""))  # fmt: skip
            if ratios:
                geo = math.exp(statistics.mean(math.log(x) for x in ratios))
                lines.append(f"{'':14s} {system:9s} {'geo mean':10s} {'':9s} {'':9s} {geo:6.2f}")
    lines.append(f"worst cell: {worst[1]} at {worst[0]:.2f}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
