"""The placement program: it never loses to the best named strategy, its objective is what
`evaluate` says of its plan, it is deterministic, and it respects the budget."""

import pytest

from refengine.errors import UserError
from refengine.synthetic import SyntheticConfig, spec_from_hparams
from solver.cost import Workload, evaluate
from solver.groups import tensor_groups
from solver.optimize import agrees, best_start, optimize
from solver.strategies import Problem
from solver.usage import device_usage

from .test_strategies import PROFILE

GIB = 2**30
SPEC = spec_from_hparams(
    SyntheticConfig(
        "llama",
        n_layer=8,
        n_embd=2048,
        n_ff=8192,
        n_head=16,
        n_head_kv=4,
        head_dim=128,
        n_vocab=32000,
        qtype="Q4_K",
    )
)
MOE = spec_from_hparams(
    SyntheticConfig(
        "qwen3moe",
        n_layer=6,
        n_embd=1024,
        n_ff=3072,
        n_head=16,
        n_head_kv=4,
        head_dim=64,
        n_vocab=32000,
        qtype="Q4_K",
        n_expert=32,
        n_expert_used=4,
        n_ff_exp=512,
    )
)


def problem(spec, budget_gib, tiers=(1, 512)):
    w = Workload(n_ctx=4096, prompt_tokens=3000, gen_tokens=100)
    return Problem(spec, PROFILE, w, tiers, int(budget_gib * GIB))


@pytest.mark.parametrize(
    "spec,budget",
    [(SPEC, 0.4), (SPEC, 0.8), (MOE, 0.3), (MOE, 0.6)],
    ids=["dense-0.4", "dense-0.8", "moe-0.3", "moe-0.6"],
)
def test_never_worse_than_the_best_start_and_agrees_with_evaluate(spec, budget):
    p = problem(spec, budget)
    name, start, start_seconds = best_start(p)
    sol = optimize(p, hint=start, time_limit_seconds=5)
    pred = evaluate(sol.tiers, spec, PROFILE, p.workload)
    assert pred.e2e_seconds <= start_seconds * (1 + 1e-6)
    assert sol.objective_seconds == pytest.approx(pred.e2e_seconds)
    # the program prices its own placement as evaluate does (hops between layers included), up
    # to rounding each option's seconds to 100 ns
    assert sol.program_check, "no tier kept the program's own solution"
    for program, evaluated in sol.program_check.values():
        assert agrees(program, evaluated)
    assert sol.bound_seconds <= sol.objective_seconds * (1 + 1e-9)
    groups = tensor_groups(spec)
    for tier, place in sol.tiers.items():
        assert (
            device_usage(spec, groups, place, tier, p.workload, "refengine").total <= p.budget_bytes
        )


def test_deterministic():
    p = problem(SPEC, 0.5, tiers=(1, 16, 512))
    a = optimize(p, time_limit_seconds=2)
    b = optimize(p, time_limit_seconds=2)
    assert a.tiers == b.tiers and a.objective_seconds == b.objective_seconds


def test_strictly_better_than_every_named_strategy_somewhere():
    p = problem(SPEC, 0.5)
    _, start, start_seconds = best_start(p)
    sol = optimize(p, hint=start, time_limit_seconds=5)
    assert evaluate(sol.tiers, SPEC, PROFILE, p.workload).e2e_seconds < start_seconds * 0.999


def test_a_budget_below_any_placement_is_a_user_error():
    with pytest.raises(UserError, match="no placement fits"):
        optimize(problem(SPEC, 0.01), time_limit_seconds=1)


def two_gpus():
    from dataclasses import replace

    small = replace(PROFILE.gpus[0], name="small GPU")
    return replace(PROFILE, gpus=(PROFILE.gpus[0], small))


@pytest.mark.parametrize("second_gib", [0.3, 0.005])
def test_two_gpus_each_within_its_budget_and_never_worse_than_one(second_gib):
    prof = two_gpus()
    w = Workload(n_ctx=4096, prompt_tokens=3000, gen_tokens=100)
    one = Problem(SPEC, prof, w, (1, 512), int(0.25 * GIB))  # the model is 0.32 GiB
    two = Problem(SPEC, prof, w, (1, 512), int(0.25 * GIB), more_budgets=(int(second_gib * GIB),))
    a = optimize(one, time_limit_seconds=3)
    b = optimize(two, time_limit_seconds=3)
    assert b.objective_seconds <= a.objective_seconds * (1 + 1e-6)
    for t, place in b.tiers.items():
        for d, budget in enumerate(two.budgets):
            assert (
                device_usage(SPEC, tensor_groups(SPEC), place, t, w, "refengine", d).total <= budget
            )
        # layer split: each GPU holds one contiguous range of layers
        homes = [
            next((loc.device for g in tensor_groups(SPEC) if g.layer == il
                  for loc in [place.groups[g.name]] if loc.on_gpu), None)
            for il in range(SPEC.hparams.n_layer)
        ]  # fmt: skip
        seen = [d for d in homes if d is not None]
        assert seen == sorted(seen)
    for program, evaluated in b.program_check.values():
        assert agrees(program, evaluated)
    if second_gib == 0.005:  # too small for any group, KV or workspace: holds nothing
        assert all(
            device_usage(SPEC, tensor_groups(SPEC), place, t, w, "refengine", 1).total == 0
            for t, place in b.tiers.items()
        )
    else:
        assert b.objective_seconds < a.objective_seconds
