"""The optimizer against every named strategy over a grid, under one cost model.

    .venv/bin/python examples/grid.py [--time-limit 6]

Models: 8B, 32B, 70B dense (Q4_K); 30B-A3B and 122B-A10B MoE (Q4_K); budgets 4, 8, 12, 16, 24 GB
(skipped where larger than the card); contexts 4K and 64K; the two client profiles. Workload: the
prompt fills the context but 200 tokens, which are generated. Prints end-to-end seconds of the
optimizer and of the best named strategy (which) per cell, and their ratio.
"""

from __future__ import annotations

import argparse
import sys

from refengine.synthetic import preset, spec_from_hparams
from solver.budget import default_tiers, viable_tiers
from solver.cost import Workload
from solver.profile import HardwareProfile
from solver.solve import SHIPPED_PROFILES, solve

MODELS = {
    "8B": preset("llama3-8b"),
    "32B": preset("qwen3-32b"),
    "70B": preset("llama3-70b"),
    "30B-A3B": preset("qwen3moe-30b-a3b"),
    "122B-A10B": preset("qwen3moe-122b-a10b"),
}
GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=6.0)
    args = ap.parse_args()
    print(
        "| profile | model | budget GB | ctx | optimal e2e s | best named | its e2e s | named / optimal |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    worse = better = 0
    for prof_name in ("rtx5080-xeon-w5-3425", "rtx4090-epyc-7742"):
        prof = HardwareProfile.load(SHIPPED_PROFILES / f"{prof_name}.json")
        card = prof.gpus[0].memory_bytes.value
        for model, cfg in MODELS.items():
            spec = spec_from_hparams(cfg)
            for budget_gb in (4, 8, 12, 16, 24):
                if budget_gb * GIB > card:
                    continue
                for ctx in (4096, 65536):
                    w = Workload(n_ctx=ctx, prompt_tokens=ctx - 200, gen_tokens=200)
                    tiers = tuple(viable_tiers(spec, w, default_tiers(ctx), budget_gb * GIB))
                    chosen, baselines, _ = solve(
                        spec,
                        prof,
                        w,
                        list(tiers),
                        budget_gb * GIB,
                        time_limit_seconds=args.time_limit,
                    )
                    best_named = min((b.prediction.e2e_seconds, b.name) for b in baselines)
                    ours = chosen.prediction.e2e_seconds
                    ratio = best_named[0] / ours
                    worse += ratio < 1 - 1e-6
                    better += ratio > 1 + 1e-6
                    print(
                        f"| {prof_name} | {model} | {budget_gb} | {ctx // 1024}K | {ours:.1f} | "
                        f"{best_named[1]} | {best_named[0]:.1f} | {ratio:.2f} |",
                        flush=True,
                    )
    print(
        f"\ncells where the optimizer is worse than the best named strategy: {worse}; "
        f"strictly better: {better}"
    )
    sys.exit(0)


if __name__ == "__main__":
    main()
