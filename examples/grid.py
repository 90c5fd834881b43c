"""The optimizer against every named strategy over a grid, under one cost model, end to end.

    .venv/bin/python examples/grid.py [--time-limit 6]

Models: 8B, 32B, 70B dense (Q4_K); 30B-A3B MoE (Q4_K); Qwen3.5-122B-A10B (hybrid MoE), gpt-oss-120b
(MXFP4_MOE), GLM-4.5-Air and DeepSeek-V3 (Q4_K_M), which refengine plans for llama.cpp only, so their cells solve
`--target llamacpp`, beside the named strategy llama.cpp runs (its --fit); `--models` takes a
subset. Machines: the two client profiles with budgets 4, 8, 12, 16, 24 GB (skipped where larger
than the card), and the RTX 4090 + RTX 3060 pair with 16+6, 24+6 and 24+12 GB, where llama.cpp's fit
uses both GPUs (pshard's strategies, a one-GPU system, the first). Requests: the prompt fills a 4K
or 64K context but 200 tokens, which are generated; and a short one, a 60-token prompt and 20
generated tokens in a 4K context. Prints end-to-end seconds (the whole request: prompt ubatches,
decode steps, tier switches) of the chosen plan and of the best named strategy (which) per cell,
their ratio, the solver's status, and the median and worst ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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
    "Qwen3.5-122B-A10B": preset("qwen3.5-122b-a10b"),
    "gpt-oss-120b": preset("gpt-oss-120b"),
    "GLM-4.5-Air": preset("glm-4.5-air"),
    "DeepSeek-V3": preset("deepseek-v3"),
}
GIB = 2**30
MACHINES = {  # profile -> budgets in GB (one list per cell, a GB per GPU)
    "rtx5080-xeon-w5-3425": [[4], [8], [12], [16]],
    "rtx4090-epyc-7742": [[4], [8], [12], [16], [24]],
    "rtx4090-rtx3060-epyc-7742": [[16, 6], [24, 6], [24, 12]],
}
REQUESTS = {  # name -> (context, prompt tokens, generated tokens)
    "4K": (4096, 4096 - 200, 200),
    "64K": (65536, 65536 - 200, 200),
    "4K, 60+20": (4096, 60, 20),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--time-limit", type=float, default=6.0)
    ap.add_argument("--models", help="a comma-separated subset of: " + ", ".join(MODELS))
    args = ap.parse_args()
    models = args.models.split(",") if args.models else list(MODELS)
    print(
        "| profile | model | budget GB | request | optimal e2e s | best named | its e2e s "
        "| named / optimal | solver |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ratios, walls = [], []
    for prof_name, budget_cells in MACHINES.items():
        prof = HardwareProfile.load(SHIPPED_PROFILES / f"{prof_name}.json")
        for model in models:
            spec = spec_from_hparams(MODELS[model])
            target = "refengine" if spec.arch.engines else "llamacpp"
            for gbs in budget_cells:
                budgets = [gb * GIB for gb in gbs]
                for req, (ctx, prompt, gen) in REQUESTS.items():
                    w = Workload(n_ctx=ctx, prompt_tokens=prompt, gen_tokens=gen)
                    tiers = viable_tiers(spec, w, default_tiers(ctx), budgets, target)
                    began = time.perf_counter()
                    chosen, baselines, facts = solve(
                        spec,
                        prof,
                        w,
                        tiers,
                        budgets if len(budgets) > 1 else budgets[0],
                        time_limit_seconds=args.time_limit,
                        target=target,
                    )
                    walls.append(time.perf_counter() - began)
                    # the strategies the same system runs (llama.cpp's: its --fit)
                    best_named = min((b.prediction.e2e_seconds, b.name) for b in baselines
                                     if b.target == target)  # fmt: skip
                    ours = chosen.prediction.e2e_seconds
                    ratio = best_named[0] / ours
                    ratios.append(ratio)
                    status = facts.get("status", "not needed" if facts else "")
                    if facts.get("gap"):
                        status += f" {facts['gap']:.1%}"
                    print(
                        f"| {prof_name} | {model} | {'+'.join(map(str, gbs))} | {req} | "
                        f"{ours:.2f} | {best_named[1]} | {best_named[0]:.2f} | {ratio:.3f} | "
                        f"{status} |",
                        flush=True,
                    )
    worse = sum(r < 1 - 1e-9 for r in ratios)
    better = sum(r > 1 + 1e-9 for r in ratios)
    print(
        f"\n{len(ratios)} cells; named / optimal: median {statistics.median(ratios):.2f}, "
        f"worst {min(ratios):.3f}, best {max(ratios):.2f}"
    )
    print(
        f"cells where the chosen plan is worse end to end than the best named strategy: {worse}; "
        f"strictly better: {better}; solve wall time median {statistics.median(walls):.1f} s, "
        f"longest {max(walls):.1f} s"
    )
    sys.exit(1 if worse else 0)


if __name__ == "__main__":
    main()
