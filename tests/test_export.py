"""Exported llama.cpp flags mean exactly the plan: llama.cpp's own rules (-ngl counting the
output layer, -ot searched in order with the first match winning) applied to the flags recover
every tensor's device."""

import re

import pytest

from refengine.errors import UserError
from refengine.synthetic import SyntheticConfig, spec_from_hparams
from solver.cost import CPU, PINNED, STREAMED, Loc, TierPlacement, Workload, evaluate
from solver.export import apply_llamacpp_args, llamacpp_args, tensor_devices
from solver.groups import tensor_groups
from solver.optimize import agrees, optimize
from solver.strategies import STRATEGIES, Problem
from solver.usage import device_usage

from .test_strategies import DENSE_CFG, MOE_CFG, PROFILE

GIB = 2**30
MODELS = {
    "dense": DENSE_CFG,
    "tied": SyntheticConfig(
        "llama",
        n_layer=16,
        n_embd=2048,
        n_ff=8192,
        n_head=16,
        n_head_kv=4,
        head_dim=128,
        n_vocab=64000,
        qtype="Q4_K",
        tied_output=True,
    ),
    "moe": MOE_CFG,
}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("budget_gib", [1.5, 3, 5, 10])
def test_fit_plans_export_to_flags_that_recover_them(model, budget_gib):
    spec = spec_from_hparams(MODELS[model])
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    plan = STRATEGIES["fit"](Problem(spec, PROFILE, w, (1, 512), int(budget_gib * GIB), "llamacpp"))
    place = plan[1]  # the static placement (CPU-held weights op-offloaded at >= 32 tokens)
    args = llamacpp_args(spec, place, 8192, "f16", True)
    assert args[:2] == ["-fit", "off"] and "-ngl" in args
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    for item in args[args.index("-ot") + 1].split(",") if "-ot" in args else []:
        pattern = item.split("=")[0]
        assert pattern.startswith("^") and pattern.endswith("$")  # anchored
        re.compile(pattern)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("budget_gib", [1.5, 5])
def test_optimized_llamacpp_plans_export_and_never_lose_to_fit(model, budget_gib):
    spec = spec_from_hparams(MODELS[model])
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    p = Problem(spec, PROFILE, w, (1, 512), int(budget_gib * GIB), "llamacpp")
    fit = STRATEGIES["fit"](p)
    sol = optimize(p, hint=fit, time_limit_seconds=2)
    assert sol.tiers[1] == sol.tiers[512]  # one static placement: llama.cpp cannot switch
    place = sol.tiers[1]
    args = llamacpp_args(spec, place, 8192, "f16", True)
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    ours = evaluate(sol.tiers, spec, PROFILE, w, "llamacpp").e2e_seconds
    assert ours <= evaluate(fit, spec, PROFILE, w, "llamacpp").e2e_seconds * (1 + 1e-9)
    usage = device_usage(spec, tensor_groups(spec), place, 512, w, "llamacpp")
    assert usage.total <= budget_gib * GIB
    for program, evaluated in sol.program_check.values():  # one class of layers: exact hops
        assert agrees(program, evaluated)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_gpu_llamacpp_plans_export_with_tensor_split_counts(model):
    from dataclasses import replace

    spec = spec_from_hparams(MODELS[model])
    prof = replace(PROFILE, gpus=(PROFILE.gpus[0], replace(PROFILE.gpus[0], name="second")))
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    p = Problem(spec, prof, w, (1, 512), int(1.5 * GIB), "llamacpp", (int(1.0 * GIB),))
    sol = optimize(p, hint=STRATEGIES["fit"](p), time_limit_seconds=2)
    place = sol.tiers[512]
    args = llamacpp_args(spec, place, 8192, "f16", True, n_devices=2)
    assert "-ts" in args and args[args.index("-dev") + 1] == "CUDA0,CUDA1"
    ts = [int(x) for x in args[args.index("-ts") + 1].split(",")]
    assert sum(ts) == int(args[args.index("-ngl") + 1])
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    for d, budget in enumerate(p.budgets):
        assert device_usage(spec, tensor_groups(spec), place, 512, w, "llamacpp", d).total <= budget


def test_a_hand_made_mixed_placement_round_trips():
    spec = spec_from_hparams(MODELS["dense"])
    groups = tensor_groups(spec)
    locs = {g.name: Loc(PINNED) for g in groups}
    locs["token_embd"] = Loc(CPU)
    for il in range(0, 10):  # front layers on the CPU, with their KV
        for g in groups:
            if g.layer == il:
                locs[g.name] = Loc(CPU)
    locs["blk.15.ffn_down"] = Loc(CPU)  # a fractional layer
    locs["blk.3.attn"] = Loc(PINNED)  # attention of a CPU layer on the GPU
    kv = {il: Loc(CPU) if il < 10 else Loc(PINNED) for il in range(24)}
    place = TierPlacement(locs, kv)
    args = llamacpp_args(spec, place, 4096, "q8_0", False)
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    assert args[args.index("-ngl") + 1] == "15"  # output layer + 14 repeating layers


def test_what_llamacpp_cannot_express_is_refused():
    spec = spec_from_hparams(MODELS["dense"])
    groups = tensor_groups(spec)
    streamed = TierPlacement(
        {g.name: Loc(STREAMED) for g in groups}, {il: Loc(PINNED) for il in range(24)}
    )
    with pytest.raises(UserError, match="cannot stream"):
        llamacpp_args(spec, streamed, 4096, "f16", True)
    holes = TierPlacement(
        {g.name: Loc(PINNED) for g in groups},
        {il: Loc(PINNED) if il % 2 else Loc(CPU) for il in range(24)},
    )
    with pytest.raises(UserError, match="suffix"):
        llamacpp_args(spec, holes, 4096, "f16", True)
