"""The held-out routed file of `predictions_vs_runs.py` (qwen3moe-2b) with other expert counts and
types, each beside the `--target llamacpp` cost model: pp512@0 with `llama-bench -t T` (three
runs, twice), so a change in the expert count or type that the model prices wrong shows apart from
the host's drift, which moves every variant of one sitting alike.

    python scripts/routed_variants.py --profile P.json [--llama-bin DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cudarun.measure_llamacpp import bench_runs  # noqa: E402
from predictions_vs_runs import SYNTHETIC, llama_bin  # noqa: E402
from refengine.models import load_model  # noqa: E402
from refengine.synthetic import write_synthetic  # noqa: E402
from solver.cpu_tests import cpu_cost_model, prompt_seconds  # noqa: E402
from solver.solve import load_profile  # noqa: E402

BASE = SYNTHETIC["qwen3moe-2b"][0]
# name -> (experts, chosen, type); E has the narrow expert twin's counts and widths (a control)
VARIANTS = {
    "A": (32, 4, "Q4_K_M"), "B": (32, 4, "Q4_K"), "C": (8, 1, "Q4_K"), "D": (16, 2, "Q4_K"),
    "E": (8, 2, "Q4_K"),
}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--llama-bin", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/refengine-routed-variants"))
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=True)
    bench = llama_bin(a.llama_bin) / "llama-bench"
    profile = load_profile(a.profile)
    print(f"{'variant':18s} {'predicted':>9s} {'measured':>9s} {'runs':>11s} {'ratio':>6s}")
    for name, (experts, chosen, qtype) in VARIANTS.items():
        path = a.dir / f"{name}.gguf"
        if not path.exists():
            write_synthetic(path, replace(BASE, n_expert=experts, n_expert_used=chosen,
                                          qtype=qtype))  # fmt: skip
        cm = cpu_cost_model(load_model(str(path)), profile, "llamacpp", a.threads, 1024)
        predicted = 512 / prompt_seconds(cm, 512, 0)
        runs = [bench_runs(bench, path, a.threads, 3, prompts=(512,), gen=0)["pp512"]["avg_ts"]
                for _ in range(2)]  # fmt: skip
        measured = statistics.median(runs)
        print(f"{name} {experts}/{chosen} {qtype:10s} {predicted:9.1f} {measured:9.1f} "
              f"{min(runs):5.0f}-{max(runs):<5.0f} {measured / predicted:6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
