"""The placement program (OR-Tools CP-SAT): a multiple-choice knapsack per tier, over one or
several GPUs, for our runtime or (one static placement) for llama.cpp.

Data: layers l, tiers t, GPUs d and the request's ubatch shapes s (a tier, token count, depth and
weight w_s, from cost.request_shapes). A layer's *options* are every way to place it in a tier on
one GPU d: each of its groups (solver.groups) pinned on d, streamed to d or on the CPU (an expert
stack, for our runtime, also routed: only the chosen experts copied, after the router, in a slot for
the most the tier's ubatch routes to), and its KV pinned on d, streamed with the layer (pshard's
scheme) or on the CPU — llama.cpp: pinned or CPU only —, priced for the tier's CPU either idle or
busy (copies are slower while the CPU computes). Each option is priced once by the cost model
itself: seconds_o = sum_s w_s * CostModel.layer_terms(...).total over the tier's shapes (depths
vectorized), so the program's objective *is* `evaluate` of its solution, up to rounding to 100 ns
and to hop variables the search may leave above what the arrangement needs, within the gap limit
(`agrees`; the tests check it). Layers whose groups have the same shapes, types and KV share their
options; options dominated in (pinned bytes, extra unit, seconds) by another with the same busy
flag, end devices, GPU and KV side are dropped. The embedding (first GPU or CPU) and the head (any
GPU or CPU) are two more choices.

Variables, per tier (c: a class of identical layers, m_c of them):
  n[c,o] in 0..m_c    how many of class c's layers take option o; u[c,o] in {0,1}: any do
  e[g], h[g] in {0,1} the embedding's and the head's option
  busy in {0,1}       the tier computes something on the CPU
  ring[d] >= 0        bytes of d's largest streamed unit (our ring slot), or on the first GPU
                      llama.cpp's largest CPU-held weight (op-offload copies it there)
  holds[d] in {0,1}   GPU d computes anything (then it holds a workspace)
  range boundaries, per-range walk variables (5), (6), (9)

Constraints:
  (1) sum_o n[c,o] = m_c for each class; one embedding and one head option; n <= m_c * u.
  (2) u => busy for options priced with the CPU busy (all that use the CPU are), u => not busy
      for the others; busy <= the options using the CPU.
  (3) ring[d] >= unit_o * u[c,o]; u[c,o] => holds[d] for options that use GPU d.
  (4) memory, per GPU: pinned bytes of its options (weights, KV, the head's logits) +
      slots * ring[d] + workspace(t) * holds[d] <= budget[d] - reserve[d] (slots: our
      PREFETCH_DEPTH, llama.cpp 1); our runtime uses some GPU; llama.cpp's first GPU holds a
      workspace when it offloads.
  (5) hops, layer by layer in ranges (`_device_walk`): entering a non-empty range costs a hop
      unless the stream already is where its first layer starts, two from another GPU; inside a
      range the layers order freely, a walk between the CPU and its GPU (`_walk_hops`): each
      GPU->CPU layer (gc) or CPU->GPU layer (cg) crosses once, so |start - end - gc + cg| hops
      make up the imbalance, and a side some layer stays on but the walk never visits costs two
      more; then a hop to the head unless it is where the stream ends (two from another GPU).
  (6) ranges (`_ranges`, one-hot boundaries): ours, one per GPU in order; llama.cpp's, the
      layers whose KV stays on the CPU (on the first GPU's options), then one per GPU (-ngl,
      -ts): each class has in each range as many layers as it has there.
  (7) llama.cpp: a tied head sits with the output layer (on the last GPU) once a layer is
      offloaded.
  (8) llama.cpp on several GPUs: a later GPU's layer starts and ends on it (its attention side
      and last FFN matrix are not CPU-held), so the stream's devices at 32 tokens and more are
      known from the ranges.
  (9) llama.cpp, 32 tokens and more: every layer runs on a GPU (op-offload), so one hop from
      the embedding, two per further GPU used, two more when the head's GPU (the first one for
      a CPU-held head) is not the last layer's.
  The layers are then arranged (`_arrange`) range by range, taking where the stream is the layer
  that stays, else one that crosses, else one that stays on the other side (`walk_rank`): the
  fewest hops for one class of layers (a test checks it against a search over orders); with
  interleaved classes (Gemma-3's sliding-window layers) the count is a lower bound, and evaluate
  charges what the arrangement needs.
Objective (e2e by default; ttft or tps keep only the prefill or decode shapes):
  minimize sum seconds_o * n[c,o] + the globals' seconds + hop seconds * hops.
Tiers share no variable, so each tier is its own program, each with an equal share of the
(deterministic) time limit; the plan-switch cost between the last prefill tier and the decode tier
(re-pinned bytes / h2d) is then added as evaluate charges it. Tiers the request does not use get a
shape of their own (a full ubatch at half the context, weight 0.5), so they are planned too.
Deterministic: one worker, a fixed seed, a deterministic time limit and a relative gap limit
(RELATIVE_GAP); warm-started from the best named strategy or from `stream_rest` (llama.cpp:
from --fit), whichever evaluates better; never worse than that start.

CP-SAT, not a MIP, by measurement (qwen3moe-30b-a3b shape, 16K context, 15 GiB on the RTX 5080
profile, warm start at 22.38 s end to end): SCIP through pywraplp, single-threaded, 10 s: 22.38 s
(no better than the start, its root LP unfinished); CP-SAT, one worker, deterministic time 5:
4.92 s. This knapsack over option counts replaced (a) a program with a time variable per layer
and shape, and (b) one boolean per layer and option: on llama3-70b, 8K context, 5 tiers, 16 GiB
on the RTX 4090 profile, (a) took 47 s of CP-SAT for an end-to-end 123.7 s, (b) found no solution
in 0.6 deterministic seconds per tier (its presolve probing alone used them) and SCIP/CBC/HiGHS
needed 15-20 s on its identical-layer symmetry; the counts need 0.7 s for 117.2 s.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import numpy as np
from ortools.sat.python import cp_model

from refengine.defaults import SOLVER_SECONDS
from refengine.errors import UserError

from .cost import (
    CPU,
    OP_OFFLOAD_MIN_TOKENS,
    PINNED,
    ROUTED,
    STREAMED,
    CostModel,
    Loc,
    Shape,
    TierPlacement,
    evaluate,
    request_shapes,
    shape_terms,
)
from .groups import EMBD, EXPERTS, Group, cache_nbytes, routed_slot_nbytes
from .memory import PIPELINE_COPIES, compute_nbytes, kv_layer_nbytes
from .strategies import STRATEGIES, Problem, stream_rest
from .usage import PREFETCH_DEPTH, fits_budgets, kv_shape

TIME_UNIT = 1e7  # CP-SAT wants integers: 100 ns
RELATIVE_GAP = 1e-3  # proving the last 0.1% is not worth the seconds


@dataclass(frozen=True)
class Option:
    """One way to place a layer (locs: its groups in order; kv), the embedding or the head (locs:
    one; kv None) in a tier, using GPU `device` (an all-CPU option still names the device whose
    range of layers it sits in)."""

    locs: tuple[Loc, ...]
    kv: Loc | None
    busy: bool
    pinned_nbytes: int
    unit_nbytes: int  # the largest streamed unit
    first_on: bool  # the first op runs on the GPU
    last_on: bool
    seconds: float  # summed over the tier's shapes, weighted
    device: int = 0

    @property
    def uses_gpu(self) -> bool:
        return any(loc.on_gpu for loc in self.locs) or (self.kv is not None and self.kv.on_gpu)


@dataclass(frozen=True)
class Solution:
    tiers: dict[int, TierPlacement]
    objective_seconds: float  # evaluate's value of the plan for the objective
    bound_seconds: float  # the programs' bounds, a lower bound of what the request can take
    status: str
    wall_seconds: float
    # per tier whose program's own solution was kept: (the program's objective, evaluate's value
    # of that placement on the same ubatch shapes) — equal up to the 100 ns rounding
    program_check: dict[int, tuple[float, float]]

    @property
    def gap(self) -> float:
        return (
            0.0
            if self.objective_seconds <= 0
            else max(0.0, (self.objective_seconds - self.bound_seconds) / self.objective_seconds)
        )


def optimize(
    p: Problem,
    objective: str = "e2e",
    time_limit_seconds: float = SOLVER_SECONDS,
    hint: dict[int, TierPlacement] | None = None,
    memo: dict | None = None,
) -> Solution:
    """The best plan for p's target: per tier for our runtime; for llama.cpp one static placement
    (what its flags can say), sized at the largest tier and priced over every ubatch. `memo`
    (shared between calls on the same model, profile and workload) keeps each tier's program by
    its tier, ubatch shapes, budgets and target, so candidates sharing a tier solve it once."""
    start = time.perf_counter()
    cm = CostModel(p.spec, p.profile, p.workload, p.target)
    tiers = sorted(p.tiers)
    shapes, _, _ = request_shapes(cm, tiers)
    if objective == "ttft":
        shapes = [s for s in shapes if s.part == "prefill"]
    elif objective == "tps":
        shapes = [s for s in shapes if s.part == "decode"]
    if not cm.traits.per_tier:  # one placement for every ubatch the request runs
        units = [(max(tiers), tiers)]
    else:  # a plan per tier; those the request does not use are planned for a typical ubatch
        units = [(t, [t]) for t in tiers]
        used = {s.tier for s in shapes}
        for t in tiers:
            if t not in used:
                shapes.append(Shape(t, t, p.workload.n_ctx // 2, 1, 0.5, "other"))
    out, bound, statuses, check = {}, 0.0, set(), {}
    for top, covered in units:
        mine = [sh for sh in shapes if sh.tier in covered]
        unit_hint = hint.get(top) if hint else None
        if unit_hint is not None and not fits_budgets(
            p.spec, p.workload, unit_hint, top, p.budgets, p.target
        ):
            unit_hint = None  # a start that does not fit is neither a hint nor a fallback
        limit = time_limit_seconds / len(units)
        key = (top, tuple(mine), p.budgets, p.target, objective, p.expert_cache)
        if memo is not None and key in memo:
            placed, v, b, st = memo[key]
        else:
            placed, v, b, st = _program(p, cm, top, mine, limit, unit_hint)
            if memo is not None:
                memo[key] = (placed, v, b, st)
        hint_seconds = None if unit_hint is None else _tier_seconds(cm, unit_hint, mine)
        if placed is None:  # no solution within the time limit: the warm start stands
            if unit_hint is None:
                raise UserError(
                    f"tier {top}: no placement found within the time limit; raise --time-limit"
                )
            placed, v, st = unit_hint, hint_seconds, "FEASIBLE"
        seconds = _tier_seconds(cm, placed, mine)
        check[top] = (v, seconds)
        if hint_seconds is not None and hint_seconds < seconds:
            placed, seconds = unit_hint, hint_seconds  # never worse than the warm start
            del check[top]
        out.update({t: placed for t in covered})
        if any(sh.part != "other" for sh in mine):  # bounds of the tiers the request pays for
            bound += min(b, seconds)
        statuses.add(st)
    value = evaluate(out, p.spec, p.profile, p.workload, p.target).objective(objective)
    status = "OPTIMAL" if statuses == {"OPTIMAL"} else "FEASIBLE"
    return Solution(out, value, min(bound, value), status, time.perf_counter() - start, check)


def agrees(program_seconds: float, evaluated_seconds: float) -> bool:
    """Whether a program's objective is what evaluate says of its placement: each option's
    seconds are evaluate's own (rounded to 100 ns); the hop variables may sit above the hops the
    arrangement needs by as much as the gap limit lets the search stop early."""
    return (
        evaluated_seconds - 1e-5 <= program_seconds <= evaluated_seconds * (1 + RELATIVE_GAP) + 1e-5
    )


def _tier_seconds(cm: CostModel, place: TierPlacement, shapes: list[Shape]) -> float:
    """What evaluate charges a tier's placement for these shapes."""
    terms = shape_terms(cm, {sh.tier: place for sh in shapes}, shapes)
    return float(sum(sh.weight * t.total for sh, t in zip(shapes, terms)))


def _by_token_count(shapes: list[Shape]) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
    """(tokens, sequences, depths, weights): the shapes grouped so depth can be vectorized."""
    out: dict[tuple[int, int], list[Shape]] = {}
    for sh in shapes:
        out.setdefault((sh.tokens, sh.sequences), []).append(sh)
    return [
        (n, seqs, np.array([s.depth for s in ss], float), np.array([s.weight for s in ss]))
        for (n, seqs), ss in sorted(out.items())
    ]


def _pareto(options: list[Option]) -> list[Option]:
    """Drop options another beats or equals in pinned bytes, streamed unit and seconds, among
    those with the same busy flag, end devices, device and KV side (which decide the range a layer
    sits in)."""
    kept: list[Option] = []
    for o in sorted(options, key=lambda o: (o.pinned_nbytes, o.unit_nbytes, o.seconds)):
        if not any(
            k.busy == o.busy
            and k.first_on == o.first_on
            and k.last_on == o.last_on
            and k.device == o.device
            and (k.kv is None or k.kv.on_gpu == o.kv.on_gpu)
            and k.pinned_nbytes <= o.pinned_nbytes
            and k.unit_nbytes <= o.unit_nbytes
            and k.seconds <= o.seconds
            for k in kept
        ):
            kept.append(o)
    return kept


def _locs(cm: CostModel, device: int) -> tuple[Loc, ...]:
    """llama.cpp can hold a weight (and a layer's KV) on the GPU or on the CPU, not stream it."""
    if not cm.traits.streams:
        return (Loc(PINNED, device), Loc(CPU))
    return (Loc(PINNED, device), Loc(STREAMED, device), Loc(CPU))


def _extra_unit(cm: CostModel, groups: list[Group], locs, op_offload: bool,
                tokens: int = 0) -> int:  # fmt: skip
    """Device bytes an option needs besides what it pins: our runtime's ring slot (its largest
    streamed unit; a routed stack's slot for a ubatch of `tokens`, less its expert cache), or
    llama.cpp's room for copying its largest CPU-held weight (op-offload)."""
    if cm.traits.op_offload:
        held = [g.nbytes for g, loc in zip(groups, locs) if loc.kind == CPU and g.kind != EMBD]
        return max(held, default=0) if op_offload else 0
    units = [
        g.nbytes if loc.kind == STREAMED else routed_slot_nbytes(cm.spec, g, tokens, loc.cache)
        for g, loc in zip(groups, locs)
        if loc.kind in (STREAMED, ROUTED)
    ]
    return max(units, default=0)


def cache_choices(cm: CostModel, choice: str = "auto") -> list[tuple[int, bool]]:
    """(slots, prefetch) a layer's routed stacks' expert cache may take: "auto", none, k, 2k or
    E/2 slots, each also with prefetch where the routing was measured (its hit rate known); or
    the user's "N" / "Np" (N slots, with prefetch)."""
    hp = cm.spec.hparams
    if choice != "auto":
        slots = choice.removesuffix("p")
        if not slots.isdigit() or int(slots) > hp.n_expert:
            raise UserError(f"--expert-cache {choice}: say auto, or a number of slots up to the "
                            f"model's {hp.n_expert} experts, with a p to prefetch (16p)")  # fmt: skip
        if choice.endswith("p") and cm.w.routing is None:
            raise UserError("--expert-cache with prefetch needs the routing measured: run "
                            "refengine profile-routing and solve with --routing")  # fmt: skip
        return [(int(slots), choice.endswith("p") and int(slots) > 0)]
    sizes = sorted({0, hp.n_expert_used, 2 * hp.n_expert_used, hp.n_expert // 2} - {hp.n_expert})
    measured = cm.w.routing is not None
    return [(c, p) for c in sizes for p in (False, True) if not p or (c and measured)]


def _layer_options(cm: CostModel, il: int, shapes, kv_nbytes: int, op_offload: bool, device: int,
                   tokens: int = 0, caches=((0, False),)):  # fmt: skip
    """`tokens`: the tier's ubatch (our runtime may copy only the experts it routes to of a
    stack, after its router); `caches`: the expert caches its routed stacks may take, one for
    all of a layer's (their router's one choice fills them alike)."""
    groups = cm.by_layer[il]
    options = []
    locs_here = _locs(cm, device)
    routable = (Loc(ROUTED, device),) if cm.traits.streams else ()
    per_group = [locs_here + (routable if g.kind == EXPERTS else ()) for g in groups]
    combos = []
    for locs in itertools.product(*per_group):
        routes = any(loc.kind == ROUTED for loc in locs)
        for slots, prefetch in caches if routes else ((0, False),):
            if prefetch and not locs[0].on_gpu:  # the prediction runs with the attention side
                continue
            cached = Loc(ROUTED, device, slots, prefetch)
            combos.append(tuple(cached if loc.kind == ROUTED else loc for loc in locs))
    for locs in combos:
        for kv in locs_here:
            uses_cpu = kv.kind == CPU or any(loc.kind == CPU for loc in locs)
            place = TierPlacement({g.name: loc for g, loc in zip(groups, locs)}, {il: kv})
            pinned = sum(g.nbytes for g, loc in zip(groups, locs) if loc.kind == PINNED)
            pinned += sum(cache_nbytes(cm.spec, g, loc.cache) for g, loc in zip(groups, locs))
            pinned += kv_nbytes if kv.kind == PINNED else 0
            unit = _extra_unit(cm, groups, locs, op_offload, tokens)
            unit = max(unit, kv_nbytes if kv.kind == STREAMED else 0)
            for busy in (True, False) if not uses_cpu else (True,):
                seconds = 0.0
                for n, seqs, d, w in shapes:
                    # priced as if the residual stream arrived where the layer starts: hops
                    # between layers are the program's (5)
                    enter = cm.effective(groups[0], locs[0], n).where
                    total = cm.layer_terms(il, place, n, d, busy, seqs, enter).total
                    seconds += float(w @ np.broadcast_to(total, w.shape))
                first, last = locs[0].on_gpu, locs[-1].on_gpu
                options.append(Option(locs, kv, busy, pinned, unit, first, last, seconds, device))
    return _pareto(options)


def _global_options(cm: CostModel, g: Group, shapes, logits_nbytes: int, op_offload: bool, device):
    """The embedding's or the head's options using GPU `device` (the head's hop from the last
    layer is the program's)."""
    options = []
    if g.kind == EMBD:  # a row gather: never streamed (and llama.cpp keeps it on the CPU)
        locs = (Loc(CPU),) if cm.traits.embd_on_cpu else (Loc(PINNED, device), Loc(CPU))
    else:
        locs = _locs(cm, device)
    for loc in locs:
        place = TierPlacement({g.name: loc}, {})
        pinned = g.nbytes if loc.kind == PINNED else 0
        if g.kind != EMBD and loc.on_gpu:
            pinned += logits_nbytes
        unit = _extra_unit(cm, [g], [loc], op_offload)
        unit = max(unit, g.nbytes if loc.kind == STREAMED else 0)
        busy_choices = (True, False) if loc.on_gpu or g.kind == EMBD else (True,)
        for busy in busy_choices:
            seconds = 0.0
            for n, _, _, w in shapes:
                arrive = cm.effective(g, loc, n).where
                seconds += float(w.sum() * cm.global_terms(g, place, n, busy, arrive).total)
            on = loc.on_gpu
            options.append(Option((loc,), None, busy, pinned, unit, on, on, seconds, device))
    return options


def _layer_key(cm: CostModel, il: int, kv_nbytes: int) -> tuple:
    """Layers with equal keys have the same options."""
    shape = tuple((g.kind, g.nbytes, g.params, g.qtype) for g in cm.by_layer[il])
    return shape, cm.spec.is_swa(il), kv_nbytes


def _program(
    p: Problem,
    cm: CostModel,
    tier: int,
    shapes: list[Shape],
    time_limit_seconds: float,
    hint: TierPlacement | None,
) -> tuple[TierPlacement | None, float, float, str]:
    """The program of one tier (for llama.cpp: of the static placement, sized at `tier`): its
    placement (None when the time ran out first), objective, bound and status."""
    llama = cm.traits.llamacpp_flags  # llama.cpp runs this placement
    budgets = p.budgets
    devices = range(len(budgets))
    n_layer = p.spec.hparams.n_layer
    kvs = kv_shape(p.workload, tier)
    grouped = _by_token_count(shapes)
    op_offload = tier >= OP_OFFLOAD_MIN_TOKENS
    # over several GPUs llama.cpp may pipeline ubatches (every layer offloaded whole), keeping
    # copies of each device's inputs: reserved whatever the placement, as a bound
    copies = PIPELINE_COPIES if llama and len(budgets) > 1 else 1
    work = p.workload
    # (a device mixing CPU-computed experts may need more than the FFN it would compute)
    roles = [(copies, False, False)] + ([(1, True, True), (1, False, True)] if llama else [])
    mixed = tuple(range(n_layer)) if llama else ()  # (any layer's CPU experts, as a bound)
    bound = lambda rows: max(  # noqa: E731
        compute_nbytes(p.spec, tier, work.n_ctx, work.flash_attn, rows, p.target, n, True, False,
                       mixes, before, mixed)  # fmt: skip
        for n, mixes, before in roles
    )
    base = bound(0)
    rows = tier if llama else min(tier, work.users)  # llama.cpp reserves a full ubatch
    logits = bound(rows) - base

    # -- options, per class of identical layers and per device ---------------------------------
    caches = cache_choices(cm, p.expert_cache) if cm.spec.arch.moe else [(0, False)]
    classes: dict[tuple, list[int]] = {}
    class_options: dict[tuple, list[Option]] = {}
    for il in range(n_layer):
        kv_nbytes = kv_layer_nbytes(p.spec, il, kvs)
        key = _layer_key(cm, il, kv_nbytes)
        classes.setdefault(key, []).append(il)
        if key not in class_options:
            class_options[key] = [
                o
                for d in devices
                for o in _layer_options(cm, il, grouped, kv_nbytes, op_offload, d, tier, caches)
                if not llama
                or d == 0  # llama.cpp: the CPU-KV layers use the first GPU
                # a later GPU's layer starts and ends there, also when it computes CPU-held
                # weights on the first GPU (ubatches of 32 tokens and more)
                or (o.kv.on_gpu and o.locs[0].on_gpu and o.locs[-1].on_gpu)
            ]
    embd, head = cm.by_layer[None]
    embd_options = _global_options(cm, embd, grouped, logits, op_offload, 0)
    tied = p.spec.by_name.get("output.weight") is None
    head_devices = [devices[-1]] if llama and tied else list(devices)  # (7)
    head_options = [
        o
        for d in head_devices
        for o in _global_options(cm, head, grouped, logits, op_offload, d)
        if d == head_devices[0] or o.uses_gpu  # the CPU head once
    ]
    # residual hops between layers where devices follow the placement; under llama.cpp, ubatches
    # of 32 tokens and more run every layer on the GPU and hop once, from the CPU's embedding
    hop_var = hop_const = 0.0
    for n, _, _, w in grouped:
        hop = float(w.sum()) * cm.hop_seconds(n, p.spec.hparams.n_embd)
        if llama and n >= OP_OFFLOAD_MIN_TOKENS:
            hop_const += hop
        else:
            hop_var += hop

    # -- variables and constraints ---------------------------------------------------------
    m = cp_model.CpModel()
    coef = lambda seconds: int(round(seconds * TIME_UNIT))  # noqa: E731
    busy = m.NewBoolVar("busy")
    every = [o for opts in class_options.values() for o in opts] + embd_options + head_options
    rings = [m.NewIntVar(0, max(o.unit_nbytes for o in every), f"ring{d}") for d in devices]
    holds = [m.NewBoolVar(f"holds{d}") for d in devices]
    counts: list[tuple[object, Option]] = []  # (how many layers take it, option)

    cpu_users = []  # counts of options that compute on the CPU (the embedding's gather aside)

    def choose(options: list[Option], n: int, name: str, makes_busy: bool = True) -> list:
        xs = [m.NewIntVar(0, n, f"{name}[{i}]") for i in range(len(options))]
        m.Add(sum(xs) == n)  # (1)
        for i, (x, o) in enumerate(zip(xs, options)):
            if makes_busy and (
                any(loc.kind == CPU for loc in o.locs) or (o.kv is not None and o.kv.kind == CPU)
            ):
                cpu_users.append(x)
            used = m.NewBoolVar(f"u{name}[{i}]")
            m.Add(x <= n * used)
            m.AddImplication(used, busy if o.busy else busy.Not())  # (2)
            if o.unit_nbytes:  # (3) llama.cpp's op-offload copies go to the first GPU
                m.Add(rings[0 if llama else o.device] >= o.unit_nbytes * used)
            if o.uses_gpu:
                m.AddImplication(used, holds[o.device])
            counts.append((x, o))
        return xs

    X = {
        key: choose(opts, len(classes[key]), f"n{k}")
        for k, (key, opts) in enumerate(class_options.items())
    }
    layer_counts = list(counts)
    E = choose(embd_options, 1, "e", makes_busy=False)
    H = choose(head_options, 1, "h")
    m.Add(busy <= sum(cpu_users))  # (2) busy exactly when something computes on the CPU
    slots = 1 if llama else PREFETCH_DEPTH
    for d in devices:  # (4) a device computing anything holds a workspace
        pinned = sum(o.pinned_nbytes * x for x, o in counts if o.device == d)
        m.Add(pinned + slots * rings[d] + base * holds[d] <= budgets[d])
    if not llama:
        m.Add(sum(holds) >= 1)  # our runtime runs on a GPU
    elif op_offload:
        m.Add(holds[0] == 1)  # llama.cpp computes offloaded ubatches on the first GPU

    emb_on = sum(x for x, o in zip(E, embd_options) if o.first_on)
    head_on = sum(x for x, o in zip(H, head_options) if o.last_on)
    # (6) ranges of layers in order, each on one GPU (which its walk's "GPU" means): ours, one
    # per device; llama.cpp's, the layers whose KV stays on the CPU (-ngl offloads the last ones,
    # their weights placeable on the first GPU by -ot), then one per device (-ts)
    if llama:
        part = lambda o: 0 if not o.kv.on_gpu else o.device + 1  # noqa: E731
        gpu_of = [0, *devices]
    else:
        part = lambda o: o.device  # noqa: E731
        gpu_of = list(devices)
    if len(gpu_of) > 1:
        ranges = _ranges(m, classes, n_layer, len(gpu_of), "r")
        for key in classes:
            for r in range(len(gpu_of)):
                here = sum(x for x, o in zip(X[key], class_options[key]) if part(o) == r)
                m.Add(here == ranges[key][r])
        if llama and tied:  # (7) a tied head sits with the output layer once any layer is offloaded
            m.Add(n_layer * head_on >= n_layer - sum(ranges[key][0] for key in classes))
    by_range = [[xo for xo in layer_counts if part(xo[1]) == r] for r in range(len(gpu_of))]
    n_hops, starts, nonempty = _device_walk(
        m, list(zip(gpu_of, by_range)), list(zip(H, head_options)), emb_on, n_layer
    )
    big_hops = 0  # (9) llama.cpp at 32 tokens and more: GPU to GPU at each new device, and to
    # the head's (a CPU-held head computes on the first GPU); from the embedding: hop_const
    if llama and len(devices) > 1:
        used = [m.NewBoolVar(f"used{d}") for d in devices]
        for d in devices:
            m.AddMaxEquality(used[d], [nonempty[r] for r, g in enumerate(gpu_of) if g == d])
        last = m.NewIntVar(0, devices[-1], "last_gpu")
        m.AddMaxEquality(last, [g * nonempty[r] for r, g in enumerate(gpu_of)])
        head_gpu = sum(o.device * y for y, o in zip(H, head_options) if o.last_on)
        apart = m.NewBoolVar("head_apart")
        m.Add(len(devices) * apart >= head_gpu - last)
        m.Add(len(devices) * apart >= last - head_gpu)
        big_hops = 2 * (sum(used) - 1) + 2 * apart

    m.Minimize(
        sum(coef(o.seconds) * x for x, o in counts)
        + coef(hop_var) * n_hops
        + coef(hop_const) * (1 + big_hops)
    )
    if hint is not None:
        _add_hint(
            m, cm, hint, classes, class_options, X, (embd_options, E), (head_options, H), busy
        )

    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.num_workers, prm.random_seed, prm.max_deterministic_time = 1, 0, time_limit_seconds
    prm.relative_gap_limit = RELATIVE_GAP
    st = solver.Solve(m)
    status = solver.StatusName(st)
    if st == cp_model.INFEASIBLE:
        raise UserError(f"tier {tier}: no placement fits the budget")
    if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None, 0.0, 0.0, status

    e_opt = next(o for x, o in zip(E, embd_options) if solver.Value(x))
    h_opt = next(o for x, o in zip(H, head_options) if solver.Value(x))
    taken = {
        key: [o for x, o in zip(X[key], opts) for _ in range(solver.Value(x))]
        for key, opts in class_options.items()
    }
    begin = {r: bool(v if isinstance(v, int) else solver.Value(v)) for r, v in starts.items()}
    per_layer = _arrange(classes, taken, begin, n_layer, llama)
    groups = {embd.name: e_opt.locs[0], head.name: h_opt.locs[0]}
    kv = {}
    for il, o in enumerate(per_layer):
        groups.update({g.name: loc for g, loc in zip(cm.by_layer[il], o.locs)})
        kv[il] = o.kv
    place = TierPlacement({g.name: groups[g.name] for g in cm.groups}, kv)
    return (
        place,
        solver.ObjectiveValue() / TIME_UNIT,
        solver.BestObjectiveBound() / TIME_UNIT,
        status,
    )


def _ranges(m, classes: dict[tuple, list[int]], n_layer: int, parts: int, name: str) -> dict:
    """Split the layers into `parts` contiguous ranges, in order, by one-hot boundaries; returns
    per class the number of its layers in each range (linear in the boundaries)."""
    bounds = []
    for b in range(parts - 1):
        onehot = [m.NewBoolVar(f"{name}{b}={k}") for k in range(n_layer + 1)]
        m.AddExactlyOne(onehot)
        bounds.append(onehot)
    for a, b in zip(bounds, bounds[1:]):
        m.Add(sum(k * x for k, x in enumerate(a)) <= sum(k * x for k, x in enumerate(b)))
    out = {}
    for key, layers in classes.items():
        before = [sum(1 for il in layers if il < k) for k in range(n_layer + 1)]
        cuts = [0] + [sum(c * x for c, x in zip(before, onehot)) for onehot in bounds]
        cuts.append(len(layers))
        out[key] = [cuts[i + 1] - cuts[i] for i in range(parts)]
    return out


def _device_walk(m, ranges, head_counts, emb_on, n_layer: int):
    """(5) The fewest residual hops through the device ranges in order: entering a non-empty
    range costs a hop unless the stream is already where its first layer starts (the CPU, or
    this GPU after the embedding), a walk inside each range (`_walk_hops`), and a last hop to
    the head unless it is where the stream ends. An empty range passes the location on."""
    n_hops, starts, nonempty = 0, {}, {}
    cpu_at = 1 - emb_on  # where the stream is: the CPU, or (gpu_at) a GPU
    gpu_at = {0: emb_on}
    gpus = sorted({g for g, _ in ranges})
    for r, (d, mine) in enumerate(ranges):
        size = sum(x for x, _ in mine)
        busy, start, end = (m.NewBoolVar(f"{v}{r}") for v in ("nonempty", "start", "end"))
        starts[r] = start
        nonempty[r] = busy
        m.Add(size >= 1).OnlyEnforceIf(busy)
        m.Add(size == 0).OnlyEnforceIf(busy.Not())
        stay_cpu, stay_gpu, enter = (m.NewBoolVar(f"{v}{r}") for v in ("scpu", "sgpu", "enter"))
        m.Add(stay_cpu <= cpu_at)
        m.Add(stay_cpu <= 1 - start)
        m.Add(stay_gpu <= gpu_at.get(d, 0))
        m.Add(stay_gpu <= start)
        m.Add(enter >= busy - stay_cpu - stay_gpu)
        # from another GPU onto this one: two hops (through the host)
        twice = m.NewBoolVar(f"twice{r}")
        m.Add(twice >= busy + start + (1 - cpu_at) - gpu_at.get(d, 0) - 2)
        n_hops += enter + twice + _walk_hops(m, mine, start, end, n_layer, f"r{r}")
        now_cpu = m.NewBoolVar(f"cpu_after{r}")
        m.Add(now_cpu == 1 - end).OnlyEnforceIf(busy)
        m.Add(now_cpu == cpu_at).OnlyEnforceIf(busy.Not())
        now_gpu = {}
        for g in gpus:
            v = m.NewBoolVar(f"gpu{g}_after{r}")
            m.Add(v == (end if g == d else 0)).OnlyEnforceIf(busy)
            m.Add(v == gpu_at.get(g, 0)).OnlyEnforceIf(busy.Not())
            now_gpu[g] = v
        cpu_at, gpu_at = now_cpu, now_gpu
    matches = []
    for y, o in head_counts:
        z = m.NewBoolVar(f"head_in_place_{len(matches)}")
        m.Add(z <= y)
        m.Add(z <= (gpu_at[o.device] if o.last_on else cpu_at))
        matches.append(z)
    head_hop = m.NewBoolVar("head_hop")
    m.Add(head_hop >= 1 - sum(matches))
    for i, (y, o) in enumerate(head_counts):
        if o.last_on:  # onto the head's GPU from another: the second hop
            twice = m.NewBoolVar(f"head_twice{i}")
            m.Add(twice >= y + (1 - cpu_at) - gpu_at[o.device] - 1)
            n_hops += twice
    return n_hops + head_hop, starts, nonempty


def _walk_hops(m, layer_counts, start, end, n_layer: int, name: str):
    """(5) The fewest residual hops for layers that can be ordered freely, walking from device
    `start` to `end` (1: the GPU): each GPU->CPU layer (gc) or CPU->GPU layer (cg) crosses once,
    so |start - end - gc + cg| hops make up the imbalance, and a device some layer stays on but
    the walk never visits costs two more."""

    def typed(first: bool, last: bool):
        return sum(x for x, o in layer_counts if o.first_on == first and o.last_on == last)

    gc, cg = typed(True, False), typed(False, True)
    imbalance = m.NewIntVar(0, n_layer + 2, f"imbalance_{name}")
    # exactly |.|: a walk's hops have its parity, so a larger imbalance must not buy a visit
    m.AddAbsEquality(imbalance, start - end - gc + cg)
    extra = []
    for dev, stays, ends in (
        ("gpu", typed(True, True), start + end),
        ("cpu", typed(False, False), 2 - start - end),
    ):
        needed, visited = m.NewBoolVar(f"need_{dev}_{name}"), m.NewBoolVar(f"visit_{dev}_{name}")
        m.Add(stays <= n_layer * needed)
        m.Add(visited <= ends + gc + cg + imbalance)
        e = m.NewBoolVar(f"extra_{dev}_{name}")
        m.Add(e >= needed - visited)
        extra.append(e)
    return imbalance + 2 * sum(extra)


def _arrange(
    classes: dict[tuple, list[int]],
    taken: dict[tuple, list[Option]],
    begin: dict[int, bool],
    n_layer: int,
    llama: bool,
) -> list[Option]:
    """Give each layer one of its class's chosen options: the layers split into ranges in order
    (llama.cpp: those with KV on the CPU, then on the GPU; ours: by device), and within a range,
    from where the program's walk enters it (`begin`: on its GPU or not), walking the layers in
    order, the option that stays where the residual stream is, else one that crosses — as few
    hops as the program counted (exactly that few when one class holds every layer)."""
    key_of = {il: key for key, layers in classes.items() for il in layers}
    if llama:
        part = lambda o: 0 if not o.kv.on_gpu else o.device + 1  # noqa: E731
    else:
        part = lambda o: o.device  # noqa: E731
    left = {key: list(opts) for key, opts in taken.items()}
    sizes: dict[int, int] = {}
    for opts in taken.values():
        for o in opts:
            sizes[part(o)] = sizes.get(part(o), 0) + 1
    at = [r for r in sorted(sizes) for _ in range(sizes[r])]  # the range of each position
    out = []
    for il in range(n_layer):
        if il == 0 or at[il] != at[il - 1]:
            on = begin[at[il]]
        pool = [o for o in left[key_of[il]] if part(o) == at[il]]
        o = min(pool, key=lambda o: walk_rank(o.first_on, o.last_on, on))
        left[key_of[il]].remove(o)
        out.append(o)
        on = o.last_on
    return out


def walk_rank(first_on: bool, last_on: bool, on: bool) -> int:
    """Which layer to take next where the residual stream is `on` (the GPU or not), for the
    fewest hops: one that stays here, else one that crosses over, else (a hop is due) one that
    stays over there, and last one that crosses back."""
    if first_on == on:
        return 0 if last_on == on else 1
    return 2 if last_on != on else 3


def _add_hint(m, cm: CostModel, hint: TierPlacement, classes, class_options, X, embd, head, busy):
    """Hint the warm start's option counts where its options survived the pruning."""
    is_busy = CostModel.cpu_busy(hint)
    m.AddHint(busy, is_busy)

    def option_of(options, locs, kv):
        for i, o in enumerate(options):
            if o.locs == locs and o.kv == kv and o.busy == is_busy:
                return i
        return None

    for key, layers in classes.items():
        opts = class_options[key]
        found = [
            option_of(opts, tuple(hint.groups[g.name] for g in cm.by_layer[il]), hint.kv[il])
            for il in layers
        ]
        if None in found:
            continue
        for i, x in enumerate(X[key]):
            m.AddHint(x, found.count(i))
    for (options, xs), g in zip((embd, head), cm.by_layer[None]):
        i = option_of(options, (hint.groups[g.name],), None)
        if i is not None:
            for j, x in enumerate(xs):
                m.AddHint(x, int(i == j))


def warm_starts(p: Problem) -> dict[str, dict[int, TierPlacement]]:
    """The plans the optimizer may start from: the named strategies that run on our runtime, and
    `stream_rest` (each tier's placement depends on that tier alone)."""
    makers = {n: f for n, f in STRATEGIES.items() if n != "fit"}
    makers["stream-rest"] = stream_rest
    return {name: make(p) for name, make in makers.items()}


def best_start(
    p: Problem, objective: str = "e2e", plans: dict[str, dict[int, TierPlacement]] | None = None
) -> tuple[str, dict[int, TierPlacement], float]:
    """(name, plan, seconds) of the best warm start under `evaluate`, among `plans` restricted to
    p's tiers (default: `warm_starts(p)`)."""
    seconds, name, plan = min(score_starts(p, objective, plans), key=lambda x: x[0])
    return name, plan, seconds


def score_starts(
    p: Problem, objective: str = "e2e", plans: dict[str, dict[int, TierPlacement]] | None = None
) -> list[tuple[float, str, dict[int, TierPlacement]]]:
    """(seconds under `evaluate`, name, plan) of each plan restricted to p's tiers (a plan
    covering fewer, as llama.cpp's fit does, keeps those it has)."""
    plans = warm_starts(p) if plans is None else plans
    scored = []
    for name, plan in plans.items():
        mine = {t: plan[t] for t in p.tiers if t in plan}
        scored.append(
            (evaluate(mine, p.spec, p.profile, p.workload).objective(objective), name, mine)
        )
    return scored
