"""`refengine solve`: a model, a machine and a budget in; the best plan, its explanation and the
comparison with every named strategy out."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

from refengine.defaults import SOLVER_SECONDS
from refengine.errors import UserError
from refengine.spec import ModelSpec

from .budget import Budgets, default_tiers, mib_text, minimum_budget_bytes, parse_tiers
from .budget import plan_budgets
from .budget import viable_or_refuse
from .cost import CPU, PINNED, Loc, Prediction, TierPlacement, Workload, evaluate
from .groups import ATTN_SIDE, EXPERTS, FFN_MATRIX, tensor_groups
from .memory import kv_layer_nbytes
from .optimize import RELATIVE_GAP, optimize, score_starts, warm_starts
from .profile import HardwareProfile
from .strategies import STRATEGIES, Problem, fit_for_runtime
from .shares import Shares, units
from .tensor_split import evaluate_tensor_split, refengine_split, short_devices
from .targets import traits
from .tensor_split import tensor_split_nbytes
from .usage import device_usage, fits_budgets, kv_shape

SHIPPED_PROFILES = Path(__file__).resolve().parents[1] / "examples" / "profiles"
PREFILL_MIN_TOKENS = 512  # the smallest prefill tier (docs/pshard.md's 512 * 2^k)
SPLIT_MODES = ("layer", "tensor")  # llama.cpp's -sm over several GPUs


def load_profile(name_or_path: str | None) -> HardwareProfile:
    shipped = sorted(p.stem for p in SHIPPED_PROFILES.glob("*.json"))
    if name_or_path is None:
        raise UserError(
            "give --profile: a file from `refengine profile`, or a shipped one ("
            + ", ".join(shipped)
            + ")"
        )
    p = Path(name_or_path)
    if not p.exists() and name_or_path in shipped:
        p = SHIPPED_PROFILES / f"{name_or_path}.json"
    return HardwareProfile.load(p)


@dataclass
class Outcome:
    name: str
    tiers: dict[int, TierPlacement]
    prediction: Prediction
    target: str
    split_mode: str = "layer"  # or "tensor" (every matrix split; tiers then say nothing)
    shares: Shares | None = None  # our runtime's tensor split: what each device holds


def solve(
    spec: ModelSpec,
    profile: HardwareProfile,
    w: Workload,
    tiers: list[int],
    budget_bytes: int | list[int],
    objective: str = "e2e",
    strategy: str | None = None,
    time_limit_seconds: float = SOLVER_SECONDS,
    target: str = "refengine",
    split_mode: str | None = None,
    expert_cache: str = "auto",
) -> tuple[Outcome, list[Outcome], dict]:
    """(chosen plan, every named strategy's plan, solver facts). `budget_bytes`: one per GPU
    (the named strategies use the first). Target llamacpp: the best static placement llama.cpp's
    flags can express, warm-started from its --fit placement; over several GPUs a layer split or
    a tensor split (`split_mode` "layer" or "tensor"; None: the faster); target refengine: a
    tensor split only when asked for."""
    check_split_mode(split_mode, budget_bytes, strategy)
    began = time.perf_counter()
    budgets = [budget_bytes] if isinstance(budget_bytes, int) else list(budget_bytes)
    first, more = budgets[0], tuple(budgets[1:])
    # the warm starts and pshard's strategies use the first GPU; llama.cpp's fit every GPU
    ours = warm_starts(Problem(spec, profile, w, tuple(tiers), first))
    baselines = []
    for name, make in STRATEGIES.items():
        runs_on = "llamacpp" if name == "fit" else "refengine"
        plan = ours.get(name) or make(Problem(spec, profile, w, tuple(tiers), first, runs_on, more))
        baselines.append(Outcome(name, plan, evaluate(plan, spec, profile, w, runs_on), runs_on))
    if strategy is not None:
        if strategy not in STRATEGIES:
            raise UserError(f"unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
        named = next(b for b in baselines if b.name == strategy)
        if named.target != target:  # fit, for our runtime: op-offload as streamed weights
            tiers_ = fit_for_runtime(Problem(spec, profile, w, tuple(tiers), first), named.tiers)
            named = Outcome(strategy, tiers_, evaluate(tiers_, spec, profile, w, target), target)
        return named, baselines, {}
    runner = traits(target)
    if runner.our_runtime and split_mode == "tensor":
        chosen, facts = split_by_tensors(spec, profile, w, tiers, budgets, began)
        return chosen, baselines, facts
    all_pinned = _all_pinned(spec, tiers)
    if (
        runner.our_runtime
        and not more
        and all(fits_budgets(spec, w, all_pinned[t], t, budgets, target) for t in tiers)
    ):
        return (
            Outcome("not-needed", all_pinned, evaluate(all_pinned, spec, profile, w), "refengine"),
            baselines,
            {"not_needed": True},
        )
    # The prompt runs in ubatches of the plan's largest tier. A smaller one can be faster where a
    # large tier's workspace crowds out pinned weights (pshard's cache_ubatch), so each largest
    # prefill tier is a candidate, each optimized with an equal share of the time limit; a GPU
    # too small for one layer, its KV and that tier's workspace takes no part in it (llama.cpp
    # #14484).
    fit_plan = next(b.tiers for b in baselines if b.name == "fit")
    fit_ours = fit_for_runtime(Problem(spec, profile, w, tuple(tiers), first), fit_plan)
    starts = {**ours, "fit": fit_ours} if runner.our_runtime else {}
    candidates = []
    tops = [t for t in tiers if t >= PREFILL_MIN_TOKENS] or [max(tiers)]
    short = [t for t in tiers if t < min(tops)]
    if runner.per_tier and short:  # a short prompt may be faster in decode-sized ubatches
        tops.insert(0, max(short))  # (no large tier's workspace, no switch)
    for top in tops:
        below = tuple(t for t in tiers if t <= top)
        excluded = excluded_devices(spec, w, top, budgets) if more else {}
        usable = [0 if d in excluded else b for d, b in enumerate(budgets)]
        sub = Problem(spec, profile, w, below, usable[0], target, tuple(usable[1:]), expert_cache)
        if not runner.our_runtime:  # llama.cpp's program starts from its own --fit
            name, start = "fit", STRATEGIES["fit"](sub)
            seconds = evaluate(start, spec, profile, w, target).objective(objective)
            scored = []
        else:
            scored = [
                (sec, n, plan)
                for sec, n, plan in score_starts(sub, objective, starts)
                if plan and _plan_fits(spec, w, plan, usable, target)
            ]
            seconds, name, start = min(scored, key=lambda c: c[0], default=(0.0, None, None))
        candidates.append((seconds, top, sub, name, start, excluded, scored))
    # our runtime: a program per tier, the shorter tiers' shared by the candidates (memo), so each
    # distinct program gets an equal share (about a program per tier and one more per candidate);
    # llama.cpp: one program per candidate
    memo: dict = {}
    share = time_limit_seconds / (
        len(tiers) + len(candidates) if runner.per_tier else len(candidates)
    )
    pool, bounds, refusals, solved = [], [], [], None
    for _, top, sub, name, start, excluded, scored in sorted(candidates, key=lambda c: c[0]):
        pool += [(sec, 2, f"{n} (ubatch {top})", plan, excluded) for sec, n, plan in scored]
        try:
            units = len(sub.tiers) if runner.per_tier else 1
            sol = optimize(sub, objective, share * units, start, memo)
        except UserError as e:  # this prefill ubatch does not fit; a smaller one may
            refusals.append(str(e))
            continue
        bounds.append(sol.bound_seconds)
        pool.append((sol.objective_seconds, 0, f"optimizer (ubatch {top})", sol.tiers, excluded))
        if runner.per_tier:  # one placement for every tier: no switch to pay
            for t, place in sorted(sol.tiers.items()):
                static = {
                    u: place for u in sub.tiers if fits_budgets(spec, w, place, u, sub.budgets)
                }
                if static:
                    sec = evaluate(static, spec, profile, w).objective(objective)
                    label = f"optimizer's tier {t} in every tier (ubatch {top})"
                    pool.append((sec, 1, label, static, excluded))
            # the decode placement kept in the prefill tiers, less what does not fit there (a
            # switch of a few groups, or none): where a switch costs more than it saves
            dt = min(sub.tiers)
            for src, plan in (("optimizer's", sol.tiers), ("fit's", fit_ours)):
                if dt not in plan:
                    continue
                near = {u: _shrink(spec, w, plan[dt], u, sub.budgets) for u in sub.tiers}
                if all(near.values()):
                    for how, variant in (
                        ("per tier", near),
                        ("in every tier", {u: near[top] for u in sub.tiers}),
                    ):
                        sec = evaluate(variant, spec, profile, w).objective(objective)
                        label = f"{src} tier {dt} shrunk to fit, {how} (ubatch {top})"
                        pool.append((sec, 1, label, variant, excluded))
        if solved is None or sol.objective_seconds < solved[0].objective_seconds:
            solved = (sol, name, top)
    if solved is None:
        need = "its workspace" + (
            " and room to copy its largest CPU-held weight" if runner.op_offload else ""
        )
        raise UserError(
            f"no placement fits ({'; '.join(refusals)}): the first GPU needs {need}; "
            "raise --budget or lower --tiers"
        )
    # Never worse end to end: the whole request (every ubatch, tier switches included) of the
    # optimizer's plan against every warm start, named strategy and static plan; the best stands.
    _, _, chosen_from, plan, excluded = min(pool, key=lambda c: c[:2])
    chosen = Outcome("optimal", plan, evaluate(plan, spec, profile, w, target), target)
    tensor_facts = None
    if runner.our_runtime and more and split_mode is None:  # or our tensor split, if faster
        try:
            split, tensor_facts = split_by_tensors(spec, profile, w, tiers, budgets, began)
        except UserError:  # it does not fit, or the model cannot be split so
            split = None
        if split is not None:
            baselines.append(replace(split, name="tensor-split"))
            if split.prediction.objective(objective) < chosen.prediction.objective(objective):
                chosen = split
            else:
                tensor_facts = None
    if runner.llamacpp_flags and more and split_mode != "layer":  # or split every matrix
        split = _tensor_split(spec, profile, w, tiers, budgets)
        if split is not None:
            baselines.append(split)
            faster = split.prediction.objective(objective) < chosen.prediction.objective(objective)
            if faster or split_mode == "tensor":
                chosen = replace(split, name="optimal")
        elif split_mode == "tensor":
            need = tensor_split_nbytes(spec, w, max(tiers), len(budgets))
            raise UserError(
                f"a tensor split needs {need / 2**20:.0f} MiB on each GPU and flash attention; "
                "raise --budget or leave out --split-mode"
            )
    sol, start_name, _ = solved
    value = chosen.prediction.objective(objective)
    # each candidate's bound holds for plans with its prefill ubatch; the least holds for all
    # (switches cost nothing in it), so a plan that pays for a switch shows it as gap
    bound = min(min(bounds), value)
    gap = max(0.0, (value - bound) / value) if value > 0 else 0.0
    facts = {
        "status": "OPTIMAL" if gap <= RELATIVE_GAP + 1e-9 else "FEASIBLE",
        "objective_seconds": value,
        "bound_seconds": bound,
        "gap": gap,
        "wall_seconds": time.perf_counter() - began,  # the whole solve, every candidate
        "warm_start": start_name,
        "chosen_from": chosen_from,
        "prefill_ubatch": max(chosen.tiers),
        "excluded": excluded,
    }
    if tensor_facts is not None:
        facts = tensor_facts
    elif chosen.split_mode == "tensor":  # the program's figures are the layer split's
        facts = {"split_mode": "tensor", "excluded": excluded, "prefill_ubatch": max(tiers)}
    return chosen, baselines, facts


def check_split_mode(split_mode: str | None, budget_bytes, strategy=None) -> None:
    if split_mode is None:
        return
    if split_mode not in SPLIT_MODES:
        raise UserError(f"unknown split mode {split_mode!r} (known: {', '.join(SPLIT_MODES)})")
    several = not isinstance(budget_bytes, int) and len(budget_bytes) > 1
    if split_mode == "tensor" and not several:
        raise UserError("--split-mode tensor splits every matrix over several devices: give a "
                        "budget per device, e.g. --budget 120MiB,60MiB")  # fmt: skip
    if split_mode == "tensor" and strategy is not None:
        raise UserError("the named strategies place layers on one device: leave out --strategy "
                        "with --split-mode tensor")  # fmt: skip


def split_by_tensors(spec, profile, w, tiers, budgets, began) -> tuple[Outcome, dict]:
    """Our runtime's tensor split: the shares that fit the budgets, as even as they allow."""
    try:
        units(spec)
    except ValueError as e:
        raise UserError(f"{spec.name} cannot be split by tensors ({e}): use --split-mode layer")
    # the largest tiers' workspaces may crowd the shares out: the prompt then runs in the
    # largest ubatches that leave room
    tiers, dropped = sorted(tiers), []
    speeds = [g.hbm_gbps.value for g in profile.gpus[: len(budgets)]]  # decode reads weights
    while True:
        shares, excluded = refengine_split(spec, w, tiers[-1], budgets, speeds)
        if shares is not None or len(tiers) == 1:
            break
        dropped.append(tiers.pop())
    if shares is None:
        raise UserError(
            f"the budgets ({', '.join(mib_text(b) for b in budgets)}) cannot hold "
            f"{spec.name} split by tensors with ubatches of {tiers[-1]}: raise --budget or use "
            "--split-mode layer"
        )
    prediction = evaluate_tensor_split(spec, profile, w, tiers, len(budgets), "refengine", shares)
    chosen = Outcome("optimal", _all_pinned(spec, tiers), prediction, "refengine", "tensor", shares)
    left_out = {d: excluded.get(d, 0) for d in range(len(budgets)) if d not in shares.devices}
    facts = {"split_mode": "tensor", "excluded": left_out, "prefill_ubatch": max(tiers),
             "dropped_tiers": dropped[::-1], "wall_seconds": time.perf_counter() - began}  # fmt: skip
    return chosen, facts


def _tensor_split(spec, profile, w, tiers, budgets) -> Outcome | None:
    """llama.cpp's -sm tensor plan, when flash attention is on (it needs it) and every GPU holds
    its share."""
    if not w.flash_attn or short_devices(spec, w, max(tiers), budgets):
        return None
    prediction = evaluate_tensor_split(spec, profile, w, tiers, len(budgets))
    return Outcome("tensor-split", _all_pinned(spec, tiers), prediction, "llamacpp", "tensor")


def _all_pinned(spec: ModelSpec, tiers: list[int]) -> dict[int, TierPlacement]:
    groups = tensor_groups(spec)
    place = TierPlacement(
        {g.name: Loc(PINNED) for g in groups},
        {il: Loc(PINNED) for il in range(spec.hparams.n_layer)},
    )
    return {t: place for t in tiers}


def _shrink(spec: ModelSpec, w: Workload, place: TierPlacement, tier: int, budgets):
    """`place` with pinned layer groups moved to the CPU until it fits each GPU in `tier` (expert
    stacks first, then the last layers' FFN matrices, then attention sides); None if it cannot."""
    if fits_budgets(spec, w, place, tier, budgets):
        return place
    groups = tensor_groups(spec)
    rank = {EXPERTS: 0, FFN_MATRIX: 1, ATTN_SIDE: 2}
    movable = sorted(
        (g for g in groups if g.kind in rank and place.groups[g.name].kind == PINNED),
        key=lambda g: (rank[g.kind], -g.layer, -g.nbytes),
    )
    locs = dict(place.groups)
    for d, b in enumerate(budgets):
        over = device_usage(spec, groups, TierPlacement(locs, place.kv), tier, w, "refengine", d)
        left = over.total - b
        for g in movable:
            if left <= 0:
                break
            if locs[g.name].device == d:
                locs[g.name] = Loc(CPU)
                left -= g.nbytes
    out = TierPlacement(locs, dict(place.kv))
    return out if fits_budgets(spec, w, out, tier, budgets) else None


def _plan_fits(spec: ModelSpec, w: Workload, plan: dict, budgets, target: str) -> bool:
    return all(fits_budgets(spec, w, place, t, budgets, target) for t, place in plan.items())


def excluded_devices(spec: ModelSpec, w: Workload, tier: int, budgets: list[int]) -> dict:
    """Devices too small for one layer, its KV and a workspace (llama.cpp #14484), with what they
    lack."""
    groups = tensor_groups(spec)
    kv = kv_shape(w, tier)
    need = minimum_budget_bytes(spec, w, tier) + min(
        sum(g.nbytes for g in groups if g.layer == il) + kv_layer_nbytes(spec, il, kv)
        for il in range(spec.hparams.n_layer)
    )
    return {d: need - b for d, b in enumerate(budgets) if b < need}


def _kind(loc: Loc) -> str:
    """A location's kind, with a routed stack's expert cache (`routed+16`, prefetched: `16p`)."""
    return loc.kind + (f"+{loc.cache}{'p' if loc.prefetch else ''}" if loc.cache else "")


def summarize(spec: ModelSpec, place: TierPlacement) -> str:
    """Counts per layer kind: `41 pinned, 4 attn pinned + ffn streamed, 3 streamed; KV 45 gpu 3 cpu;
    output pinned`."""
    groups = tensor_groups(spec)
    kinds: dict[str, int] = {}
    for il in range(spec.hparams.n_layer):
        lg = [g for g in groups if g.layer == il]
        attn = place.groups[lg[0].name].kind
        ffn = sorted({_kind(place.groups[g.name]) for g in lg if g.kind != ATTN_SIDE})
        desc = attn if ffn == [attn] else f"attn {attn} + ffn {'/'.join(ffn)}"
        kinds[desc] = kinds.get(desc, 0) + 1
    kv: dict[str, int] = {}
    for loc in place.kv.values():
        kv[loc.kind] = kv.get(loc.kind, 0) + 1
    layers = ", ".join(f"{n} {d}" for d, n in sorted(kinds.items(), key=lambda x: -x[1]))
    kvs = " ".join(f"{n} {k}" for k, n in sorted(kv.items()))
    return f"layers: {layers}; KV: {kvs}; output {place.groups['output'].kind}"


def solve_plan(
    spec: ModelSpec,
    profile: HardwareProfile,
    w: Workload,
    tiers: list[int],
    budgets: list[int],
    strategy: str | None = None,
    time_limit_seconds: float = SOLVER_SECONDS,
    objective: str = "e2e",
    split_mode: str | None = None,
    runtime_nbytes: int = 0,
) -> dict:
    """A `refengine` plan as JSON, for the runtime: the optimizer's, or a named strategy's; split
    by tensors when asked. `runtime_nbytes`: what the runtime allocates on each device outside its
    arena (budget.CUDA_RUNTIME_NBYTES on a GPU), taken off the budgets the arenas get."""
    from .plan import plan_json

    budgets = [b - runtime_nbytes for b in budgets]
    viable = viable_or_refuse(spec, w, tiers, budgets)
    chosen, _, facts = solve(
        spec, profile, w, viable, budgets, objective, strategy, time_limit_seconds,
        split_mode=split_mode,
    )  # fmt: skip
    plan = plan_json(
        spec, w, profile.name, budgets, chosen.tiers, chosen.prediction, chosen.name,
        chosen.target, facts, facts.get("not_needed", False), chosen.split_mode, chosen.shares,
    )  # fmt: skip
    plan["runtime_nbytes"] = runtime_nbytes
    return plan


def request_workload(
    profile: HardwareProfile,
    n_ctx: int,
    users: int,
    prompt_tokens: int | None,
    gen_tokens: int,
    kv_type: str,
    flash_attn: bool,
    threads: int,
    unified: bool = False,
) -> Workload:
    """The workload of a `solve` request: `n_ctx` cells for the users, a stream of n_ctx / users
    each or (`unified`) one cache they share; the prompt fills each user's share less the generated
    tokens unless given; threads 0 is the profile's (resolved, so the fingerprint names it)."""
    per_user = n_ctx // users
    prompt = prompt_tokens if prompt_tokens is not None else per_user - gen_tokens
    if prompt < 1 or prompt + gen_tokens > per_user:
        raise UserError(
            f"prompt {prompt} + generation {gen_tokens} tokens must fit each user's "
            f"share of --ctx {n_ctx} ({per_user} tokens for {users} users)"
        )
    return Workload(
        n_ctx=n_ctx,
        prompt_tokens=prompt,
        gen_tokens=gen_tokens,
        users=users,
        kv_type=kv_type,
        flash_attn=flash_attn,
        threads=threads or profile.cpu.threads,
        unified=unified,
        op_offload=not (profile.gpus and profile.gpus[0].is_rpc),
    )


@dataclass(frozen=True)
class Solved:
    budgets: Budgets
    chosen: Outcome
    baselines: list[Outcome]
    facts: dict


def solve_request(
    spec: ModelSpec,
    profile: HardwareProfile,
    w: Workload,
    tiers: str | None,
    budget: str | None,
    reserve: str,
    objective: str = "e2e",
    strategy: str | None = None,
    time_limit_seconds: float = SOLVER_SECONDS,
    target: str = "refengine",
    split_mode: str | None = None,
    expert_cache: str = "auto",
) -> Solved:
    """`solve` as the command line asks it: tiers and budgets as written (`plan_budgets` decides
    the defaults, the reserve and which tiers are viable), then `solve` over the viable tiers."""
    if not traits(target).llamacpp_flags and not spec.arch.engines:
        raise UserError(f"planned only: our runtime does not run {spec.arch.name}; plan it for "
                        "llama.cpp with --target llamacpp")  # fmt: skip
    tier_list = parse_tiers(tiers) if tiers else default_tiers(w.n_ctx, w.users)
    b = plan_budgets(spec, w, tier_list, budget, reserve, profile, target)
    chosen, baselines, facts = solve(
        spec, profile, w, b.tiers, b.bytes, objective, strategy, time_limit_seconds, target,
        split_mode, expert_cache,
    )  # fmt: skip
    return Solved(b, chosen, baselines, facts)
