"""The named placements: each respects the budget in every tier and has the shape its system gives
it (docs/llamacpp.md for fit, docs/pshard.md for pshard's)."""

import pytest

from refengine.synthetic import SyntheticConfig, spec_from_hparams
from solver.cost import CPU, PINNED, STREAMED, CostModel, Workload, evaluate
from solver.groups import tensor_groups
from solver.profile import HardwareProfile
from solver.strategies import LLAMACPP_UBATCH, STRATEGIES, Problem, fit
from solver.usage import device_usage

from .test_profile import PROFILES

GIB = 2**30
DENSE_CFG = SyntheticConfig(
    "llama",
    n_layer=24,
    n_embd=4096,
    n_ff=14336,
    n_head=32,
    n_head_kv=8,
    head_dim=128,
    n_vocab=128256,
    qtype="Q4_K",
)
MOE_CFG = SyntheticConfig(
    "qwen3moe",
    n_layer=24,
    n_embd=2048,
    n_ff=6144,
    n_head=32,
    n_head_kv=4,
    head_dim=128,
    n_vocab=151936,
    qtype="Q4_K",
    n_expert=128,
    n_expert_used=8,
    n_ff_exp=768,
)
DENSE, MOE = spec_from_hparams(DENSE_CFG), spec_from_hparams(MOE_CFG)
TIERS = (1, 16, 512, 2048)
PROFILE = HardwareProfile.load(PROFILES / "rtx4090-epyc-7742.json")


def problem(spec, budget_gib, target="refengine"):
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    return Problem(spec, PROFILE, w, TIERS, int(budget_gib * GIB), target)


def pinned_layers(spec, place):
    groups = tensor_groups(spec)
    return [
        il
        for il in range(spec.hparams.n_layer)
        if all(place.groups[g.name].kind == PINNED for g in groups if g.layer == il)
    ]


@pytest.mark.parametrize("spec", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("budget", [3, 6, 12])
def test_every_strategy_fits_its_budget_in_every_tier(spec, name, budget):
    target = "llamacpp" if name == "fit" else "refengine"
    p = problem(spec, budget, target)
    plan = STRATEGIES[name](p)
    groups = tensor_groups(spec)
    for tier, place in plan.items():
        assert set(place.groups) == {g.name for g in groups}
        u = device_usage(spec, groups, place, tier, p.workload, target)
        assert u.total <= p.budget_bytes, (name, tier, u)
    pred = evaluate(plan, spec, PROFILE, p.workload, "llamacpp" if name == "fit" else "refengine")
    assert pred.ttft_seconds > 0 and pred.tps > 0


def test_fit_offloads_the_last_layers_and_op_offloads_the_rest_at_32_tokens():
    plan = fit(problem(DENSE, 2.5, "llamacpp"))
    assert max(plan) == LLAMACPP_UBATCH
    on_gpu = pinned_layers(DENSE, plan[1])
    n = DENSE.hparams.n_layer
    assert 0 < len(on_gpu) < n and on_gpu == list(range(n - len(on_gpu), n))  # back to front
    assert plan[1].groups["output"].kind == PINNED  # -ngl counts the output layer first
    assert plan[1].groups["token_embd"].kind == CPU
    assert plan[1].groups["blk.0.ffn_up"].kind == CPU and plan[1].kv[0].kind == CPU
    assert plan[512] == plan[1]  # one static placement; llama.cpp's op-offload is priced instead
    p = problem(DENSE, 2.5, "llamacpp")
    cm = CostModel(DENSE, PROFILE, p.workload, "llamacpp")
    up = next(g for g in cm.groups if g.name == "blk.0.ffn_up")
    assert cm.effective(up, plan[1].groups[up.name], 512).kind == STREAMED  # >= 32 tokens
    assert cm.effective(up, plan[1].groups[up.name], 16).kind == CPU
    embd = next(g for g in cm.groups if g.name == "token_embd")
    assert cm.effective(embd, plan[1].groups["token_embd"], 512).kind == CPU


def test_fit_gives_moe_layers_dense_only_first_then_full_layers_front_to_back():
    plan = fit(problem(MOE, 4, "llamacpp"))[1]
    n = MOE.hparams.n_layer
    assert all(plan.groups[f"blk.{il}.attn"].kind == PINNED for il in range(n))
    full = pinned_layers(MOE, plan)
    assert full and full == list(range(len(full)))  # front to back
    assert plan.groups[f"blk.{n - 1}.ffn_down_exps"].kind == CPU


def test_layerstream_pins_the_front_and_streams_the_rest():
    place = STRATEGIES["layerpin-layerstream"](problem(DENSE, 2.5))[1]
    pinned = pinned_layers(DENSE, place)
    assert pinned == list(range(len(pinned))) and len(pinned) < DENSE.hparams.n_layer
    last = DENSE.hparams.n_layer - 1
    assert place.groups[f"blk.{last}.ffn_up"].kind == STREAMED
    assert place.groups["output"].kind == CPU  # docs/pshard.md reason 8


def test_streaming_beats_cpu_prefill_for_a_model_that_does_not_fit():
    p = problem(DENSE, 2.5)
    stream = evaluate(STRATEGIES["layerpin-layerstream"](p), DENSE, PROFILE, p.workload)
    static = evaluate(STRATEGIES["pshard-fitparams"](p), DENSE, PROFILE, p.workload)
    assert stream.ttft_seconds < static.ttft_seconds / 3


def test_fit_on_two_gpus_uses_both_as_llamacpps_fit_does():
    """common/fit.cpp: back to front, the last GPU takes the last layers and the output layer, the
    first GPU the layers before them; the rest stay on the CPU. Each GPU within its budget, and
    the pair no slower than the first GPU alone."""
    from dataclasses import replace

    prof = replace(PROFILE, gpus=(PROFILE.gpus[0], replace(PROFILE.gpus[0], name="second")))
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    for spec, gib in ((DENSE, 2.0), (MOE, 2.0)):
        one = Problem(spec, prof, w, TIERS, int(gib * GIB), "llamacpp")
        two = replace(one, more_budgets=(int(gib * GIB),))
        place = fit(two)[1]
        groups = tensor_groups(spec)
        for d in (0, 1):
            assert device_usage(spec, groups, place, LLAMACPP_UBATCH, w, "llamacpp", d).total <= (
                gib * GIB
            )
        assert place.groups["output"] == place.groups["output"].__class__(PINNED, 1)
        homes = [  # the GPU of each layer's attention side (None: the CPU)
            place.groups[f"blk.{il}.attn"].device if place.groups[f"blk.{il}.attn"].on_gpu else None
            for il in range(spec.hparams.n_layer)
        ]
        on = [d for d in homes if d is not None]
        assert on == sorted(on) and set(on) == {0, 1}  # a contiguous range on each, in order
        assert homes[-1] == 1 and all(d is not None for d in homes[homes.index(on[0]) :])
        cost = lambda p: evaluate(fit(p), spec, prof, w, "llamacpp").e2e_seconds  # noqa: E731
        assert cost(two) < cost(one)


@pytest.mark.parametrize("budgets_mib", [(200, 150, 120), (300, 200), (160, 120)])
def test_fit_and_the_optimizer_keep_every_gpu_within_budget_once_llamacpp_pipelines(budgets_mib):
    """SmolLM2's shape over several GPUs: fit fills the last GPU first, then the earlier ones; once
    every layer is on a GPU llama.cpp pipelines ubatches, which grows the compute buffer of the
    GPUs already filled (the last: 147.5 -> 156.9 MiB on 200+150+120 MiB), so each step checks
    every GPU. The optimizer keeps its warm start only where that fits too."""
    from dataclasses import replace

    from refengine.synthetic import preset
    from solver.solve import solve
    from solver.usage import fits_budgets

    spec = spec_from_hparams(preset("smollm2-135m"))
    prof = replace(PROFILE, gpus=(PROFILE.gpus[0],) * len(budgets_mib))
    w = Workload(n_ctx=2048, prompt_tokens=1848, gen_tokens=200)
    budgets = [b * 2**20 for b in budgets_mib]
    chosen, baselines, _ = solve(spec, prof, w, [1, 512], budgets, time_limit_seconds=2,
                                 target="llamacpp")  # fmt: skip
    fit_plan = next(b for b in baselines if b.name == "fit")
    for outcome in (chosen, fit_plan):
        for tier, place in outcome.tiers.items():
            assert fits_budgets(spec, w, place, tier, budgets, "llamacpp"), (outcome.name, tier)


def test_rpc_servers_compute_nothing_for_the_cpu_so_their_plans_budget_the_mix():
    """llama.cpp's first device op-offloads CPU-held weights only when it is a GPU: over RPC
    servers the CPU computes the routed experts it holds, and a device holding only the head
    mixes the last layer's outputs (n_embd per token and expert used) in its compute buffer. The
    workload of a solve over RPC servers says so, budgets by it, and keeps it in its plan."""
    from dataclasses import replace

    from solver.cost import Loc, TierPlacement
    from solver.plan import plan_workload
    from solver.solve import load_profile, request_workload

    gpus = load_profile("rtx4090-rtx3060-epyc-7742")
    rpc = replace(gpus, gpus=tuple(replace(g, backend="rpc", endpoint=f"127.0.0.1:{5 + i}")
                                   for i, g in enumerate(gpus.gpus)))  # fmt: skip
    local = request_workload(gpus, 4096, 1, None, 16, "f16", True, 0)
    served = request_workload(rpc, 4096, 1, None, 16, "f16", True, 0)
    assert local.op_offload and not served.op_offload
    spec = spec_from_hparams(SyntheticConfig("qwen3moe", n_layer=4, n_embd=512, n_ff=1024,
                                             n_head=8, n_head_kv=4, n_vocab=8000, n_expert=16,
                                             n_expert_used=4, n_ff_exp=384, qtype="Q4_K"))
    groups = tensor_groups(spec)
    locs = {g.name: Loc(CPU) if g.kind == "experts" or g.name == "token_embd"
            else Loc(PINNED, 1 if g.name == "output" else 0) for g in groups}  # fmt: skip
    place = TierPlacement(locs, {il: Loc(PINNED) for il in range(4)})
    head = [device_usage(spec, groups, place, 512, w, "llamacpp", 1).compute
            for w in (local, served)]  # fmt: skip
    assert head[1] - head[0] == 4 * 512 * spec.hparams.n_embd * (spec.hparams.n_expert_used + 1)
    assert plan_workload({"fingerprint": {"n_ctx": 4096, "users": 1, "kv_type": "f16",
                                          "flash_attn": True, "threads": 2},
                          "workload": {"prompt_tokens": 4080, "gen_tokens": 16, "users": 1,
                                       "op_offload": False}}).op_offload is False  # fmt: skip
