"""Kernel launches and host synchronizations per token of an 8B-shaped model under three plans —
resident, half-streamed and CPU-heavy — from the plans' schedules alone (`cudarun.counts`): the
model is spec-only (shapes.json's llama3-8b, llama.cpp's Q4_K_M mix), so there is no file to run
and no GPU is needed. The plans come from the solver: everything pinned where the budget holds the
model, the optimizer's placement at half the weights, and the CPU-heavy named strategy
(ffncpu-attnstream) at a quarter.

    .venv/bin/python scripts/launch_counts.py [--model llama3-8b:Q4_K_M] [--tiers 1,512]
"""

from __future__ import annotations

import argparse

from cudarun.counts import tier_counts
from refengine.synthetic import preset, spec_from_hparams
from solver.cost import CPU, STREAMED, Workload
from solver.budget import viable_tiers
from solver.solve import load_profile, solve

PLANS = {  # name: (budget as a fraction of the weights, named strategy or None: the optimizer)
    "resident": (2.0, None),
    "half-streamed": (0.5, None),
    "CPU-heavy": (0.25, "ffncpu-attnstream"),
}


def rows(model: str, tiers: list[int], n_ctx: int, profile: str, seconds: float) -> list[dict]:
    name, _, qtype = model.partition(":")
    spec = spec_from_hparams(preset(name, **({"qtype": qtype} if qtype else {})))
    prof = load_profile(profile)
    w = Workload(n_ctx=n_ctx, prompt_tokens=max(tiers), gen_tokens=128, threads=16)
    out = []
    for plan, (fraction, strategy) in PLANS.items():
        budget = int(fraction * spec.weights_nbytes)
        viable = viable_tiers(spec, w, tiers, [budget])
        chosen, _, _ = solve(spec, prof, w, viable, budget, strategy=strategy,
                             time_limit_seconds=seconds)  # fmt: skip
        for tier, place in sorted(chosen.tiers.items()):
            tokens = tier  # a full ubatch of the tier: one token at decode
            counts, graph = tier_counts(spec, place, tokens)
            kinds = [loc.kind for loc in place.groups.values()]
            out.append({
                "plan": plan, "strategy": chosen.name, "budget_gib": budget / 2**30, "tier": tier,
                "tokens": tokens, "graph": graph, "cpu_groups": kinds.count(CPU),
                "streamed_groups": kinds.count(STREAMED), "groups": len(kinds),
                "launches": counts.launches / tokens, "syncs": counts.syncs / tokens,
                "segments": counts.segments / tokens, "downloads": counts.downloads,
                "uploads": counts.uploads,
            })  # fmt: skip
    return out


def table(model: str, data: list[dict]) -> str:
    head = ("| plan | strategy | budget | tier | groups cpu/streamed/all | launches/token "
            "| syncs/token | CPU segments/token | hand-offs down/up per ubatch |")  # fmt: skip
    lines = [f"{model}: per token, from each plan's schedule (no run)", "", head,
             "|" + "---|" * 9]  # fmt: skip
    for r in data:
        how = " (graph)" if r["graph"] else ""
        lines.append(
            f"| {r['plan']} | {r['strategy']} | {r['budget_gib']:.2f} GiB | {r['tier']} | "
            f"{r['cpu_groups']}/{r['streamed_groups']}/{r['groups']} | {r['launches']:.2f}{how} "
            f"| {r['syncs']:.3f} | {r['segments']:.3f} | {r['downloads']}/{r['uploads']} |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama3-8b:Q4_K_M", help="a shapes.json name[:QTYPE]")
    ap.add_argument("--tiers", default="1,512", help="the plans' tiers")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--seconds", type=float, default=5.0, help="the optimizer's time limit")
    a = ap.parse_args(argv)
    tiers = sorted(int(t) for t in a.tiers.split(","))
    print(table(a.model, rows(a.model, tiers, a.n_ctx, a.profile, a.seconds)))


if __name__ == "__main__":
    main()
