"""The placement program (OR-Tools CP-SAT), for one GPU.

Data: groups g (solver.groups), layers l, tiers t, and the request's ubatch shapes s (each a tier,
token count, depth and weight w_s, from cost.request_shapes); every coefficient below is the
cost model's own time or byte count (CostModel), in integer units of 100 ns and bytes.

Variables, per tier t:
  p[g,t], s[g,t], c[g,t] in {0,1}  group g pinned / streamed / on the CPU
  kp[l,t], ks[l,t] in {0,1}        layer l's KV pinned on the GPU, or streamed with the layer
                                   (uploaded before it, new cells back after: pshard's scheme),
                                   else on the CPU; k = kp + ks (attention on the GPU)
  busy[t] in {0,1}                 the tier computes something on the CPU
  q[g,t] in {0,1}                  g streamed while the CPU is busy (slower copies)
  hop[.,t], any[l,t] in {0,1}      device changes along a layer, any GPU work in a layer
  ring[t] >= 0                     bytes of the largest streamed unit (a ring slot)
  T[l,s] >= 0                      a layer's overlapped GPU/copy time in shape s (and for the
                                   two global groups)

Constraints:
  (1) p + s + c = 1 for each group and tier; the embedding is never streamed.
  (2) busy[t] >= c[g,t] (g not the embedding) and busy[t] >= 1 - k[l,t]; q[g,t] >= s[g,t] + busy[t] - 1 (and the
      same for streamed KV).
  (3) hop >= |on(a) - on(b)| for consecutive ops a, b (embedding, then per layer its attention
      side, attention, attention side, FFN matrices, then the head), on(g) = p + s;
      any[l,t] >= on(g), any[l,t] >= k[l,t].
  (4) ring[t] >= nbytes[g] * s[g,t] for each group, and >= kv_bytes[l] * ks[l,t]: one slot
      holds the largest unit streamed.
  (5) memory: sum nbytes * p + PREFETCH_DEPTH * ring + sum kv_bytes * kp + compute(t)
      + logits bytes * on(output) <= budget - reserve.
  (6) T[l,s] >= GPU work of layer l in shape s; T[l,s] >= its copies (our runtime overlaps them).
Objective (e2e by default; ttft or tps keep only the prefill or decode shapes):
  minimize sum_s w_s * (sum_l T[l,s] + CPU work + hop and launch latency).
Tiers share no variable, so each tier is its own program (solved in turn, each with an equal
share of the time limit); the plan-switch cost between the last prefill tier and the decode tier
(re-pinned bytes / h2d) is then added as evaluate charges it — the joint program with that
coupling did not converge in 10 s on an 80-layer model.
This is `cost.evaluate` of the resulting plan, up to the rounding of each term to 100 ns (a test
checks it). Tiers the request does not use get a shape of their own (a full ubatch at half the
context, weight 0.5), so they are planned too.
Deterministic: one worker, a fixed seed and a deterministic time limit; warm-started from the best
named strategy or from `stream_rest`, whichever evaluates better.

CP-SAT, not a MIP, by measurement (qwen3moe-30b-a3b shape, 16K context, 15 GiB on the RTX 5080
profile, warm start at 22.38 s end to end): SCIP through pywraplp, single-threaded, 10 s: 22.38 s
(no better than the start, its root LP unfinished); CP-SAT, one worker, deterministic time 5:
4.92 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ortools.sat.python import cp_model

from refengine.defaults import SOLVER_SECONDS
from refengine.errors import UserError

from .cost import (
    CPU,
    PINNED,
    STREAMED,
    ELEMENTWISE_KERNELS_PER_LAYER,
    CostModel,
    Loc,
    Shape,
    TierPlacement,
    evaluate,
    request_shapes,
)
from .groups import EMBD
from .memory import compute_nbytes, kv_layer_nbytes
from .strategies import STRATEGIES, Problem, stream_rest
from .usage import PREFETCH_DEPTH, kv_shape


class _CpSat:
    """CP-SAT: integer coefficients, so time counts in units of 100 ns and weights double."""

    TIME_UNIT, WEIGHT_SCALE = 1e7, 2

    def __init__(self):
        self.m = cp_model.CpModel()
        self.solver = cp_model.CpSolver()

    def bool(self, name):
        return self.m.NewBoolVar(name)

    def num(self, ub, name):
        return self.m.NewIntVar(0, int(ub), name)

    def add(self, c):
        self.m.Add(c)

    def coef(self, seconds: float) -> int:
        return int(round(seconds * self.TIME_UNIT))

    def weight(self, w: float) -> int:
        return int(round(w * self.WEIGHT_SCALE))

    def hint(self, var, value: bool):
        self.m.AddHint(var, bool(value))

    def solve(self, objective, limit_seconds: float) -> tuple[str, float, float]:
        self.m.Minimize(objective)
        p = self.solver.parameters
        p.num_workers, p.random_seed, p.max_deterministic_time = 1, 0, limit_seconds
        p.repair_hint = True
        st = self.solver.Solve(self.m)
        if st not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return self.solver.StatusName(st), 0.0, 0.0
        denom = self.TIME_UNIT * self.WEIGHT_SCALE
        return (
            self.solver.StatusName(st),
            self.solver.ObjectiveValue() / denom,
            self.solver.BestObjectiveBound() / denom,
        )

    def value(self, var) -> float:
        return self.solver.Value(var)


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
) -> Solution:
    start = time.perf_counter()
    cm = CostModel(p.spec, p.profile, p.workload)
    tiers = sorted(p.tiers)
    shapes, last_prefill, decode_tier = request_shapes(cm, tiers)
    if objective == "ttft":
        shapes = [s for s in shapes if s.part == "prefill"]
    elif objective == "tps":
        shapes = [s for s in shapes if s.part == "decode"]
    used = {s.tier for s in shapes}
    for t in tiers:
        if t not in used:
            shapes.append(Shape(t, t, p.workload.n_ctx // 2, 1, 0.5, "other"))
    # One program per tier: they share nothing but the plan-switch cost, which is small next to
    # a request and is charged by evaluate (solving them jointly did not converge in 10 s on an
    # 80-layer model).
    out, bound, statuses, check = {}, 0.0, set(), {}
    for t in tiers:
        mine = [sh for sh in shapes if sh.tier == t]
        placed, v, b, st = _program(p, cm, t, mine, time_limit_seconds / len(tiers), hint)
        if placed is None:  # no solution within the time limit: the warm start stands
            if not (hint and t in hint):
                raise UserError(
                    f"tier {t}: no placement found within the time limit; raise --time-limit"
                )
            placed, v, st = hint[t], _tier_seconds(cm, hint[t], mine), "FEASIBLE"
        seconds = _tier_seconds(cm, placed, mine)
        check[t] = (v, seconds)
        if hint and t in hint and _tier_seconds(cm, hint[t], mine) < seconds:
            placed, seconds = hint[t], _tier_seconds(cm, hint[t], mine)  # never worse than it
            del check[t]
        out[t] = placed
        workload_part = sum(sh.weight for sh in mine if sh.part != "other")
        if workload_part:  # bounds of tiers the request uses; the others it does not pay for
            bound += min(b, seconds)
        statuses.add(st)
    value = evaluate(out, p.spec, p.profile, p.workload).objective(objective)
    status = "OPTIMAL" if statuses == {"OPTIMAL"} else "FEASIBLE"
    return Solution(out, value, min(bound, value), status, time.perf_counter() - start, check)


def _tier_seconds(cm: CostModel, place: TierPlacement, shapes: list[Shape]) -> float:
    """What evaluate charges a tier's placement for these shapes."""
    return sum(
        sh.weight * cm.ubatch_terms(place, sh.tokens, sh.depth, sh.sequences).total for sh in shapes
    )


def _program(
    p: Problem,
    cm: CostModel,
    tier: int,
    shapes: list[Shape],
    time_limit_seconds: float,
    hint: dict[int, TierPlacement] | None,
) -> tuple[TierPlacement | None, float, float, str]:
    """The program of one tier: its placement (None when the time ran out first), objective,
    bound and status."""
    m = _CpSat()
    _ns = m.coef
    t_max = m.coef(1e5)  # no layer-ubatch takes a day
    tiers = [tier]
    groups = cm.groups
    n_layer = p.spec.hparams.n_layer
    # -- variables ---------------------------------------------------------------------------
    P, S, C, ON = {}, {}, {}, {}
    for t in tiers:
        for g in groups:
            key = (g.name, t)
            P[key], S[key], C[key] = (m.bool(f"{x}[{g.name},{t}]") for x in "psc")
            m.add(P[key] + S[key] + C[key] == 1)  # (1)
            if g.kind == EMBD:
                m.add(S[key] == 0)
            ON[key] = P[key] + S[key]
    KP, KS, K = {}, {}, {}  # KV pinned, streamed (pshard's scheme), on the GPU at all
    for il in range(n_layer):
        for t in tiers:
            KP[(il, t)] = m.bool(f"kp[{il},{t}]")
            KS[(il, t)] = m.bool(f"ks[{il},{t}]")
            m.add(KP[(il, t)] + KS[(il, t)] <= 1)
            K[(il, t)] = KP[(il, t)] + KS[(il, t)]
    busy = {t: m.bool(f"busy[{t}]") for t in tiers}
    Q, QK = {}, {}
    for t in tiers:  # (2)
        for g in groups:
            if g.kind != EMBD:
                m.add(busy[t] >= C[(g.name, t)])
            Q[(g.name, t)] = m.bool(f"q[{g.name},{t}]")
            m.add(Q[(g.name, t)] >= S[(g.name, t)] + busy[t] - 1)
        for il in range(n_layer):
            m.add(busy[t] >= 1 - K[(il, t)])
            QK[(il, t)] = m.bool(f"qk[{il},{t}]")
            m.add(QK[(il, t)] >= KS[(il, t)] + busy[t] - 1)

    def absdiff(a, b, name):
        h = m.bool(name)
        m.add(h >= a - b)
        m.add(h >= b - a)
        return h

    hops, anygpu = {}, {}
    for t in tiers:  # (3)
        for il in range(n_layer):
            lg = cm.by_layer[il]
            attn = ON[(lg[0].name, t)]
            seq = [ON[(g.name, t)] for g in lg[1:]]
            hs = [absdiff(attn, K[(il, t)], f"h_ak[{il},{t}]")] * 2
            prev = attn
            for j, x in enumerate(seq):
                hs.append(absdiff(prev, x, f"h{j}[{il},{t}]"))
                prev = x
            hops[(il, t)] = hs
            a = m.bool(f"any[{il},{t}]")
            for g in lg:
                m.add(a >= ON[(g.name, t)])
            m.add(a >= K[(il, t)])
            anygpu[(il, t)] = a
        # between layers: the previous layer's last op (the embedding before layer 0) -> the
        # attention side; after the last layer -> the head
        prev = ON[("token_embd", t)]
        for il in range(n_layer):
            hops[("in", il, t)] = absdiff(prev, ON[(cm.by_layer[il][0].name, t)], f"h_in[{il},{t}]")
            prev = ON[(cm.by_layer[il][-1].name, t)]
        hops[("head", t)] = absdiff(prev, ON[("output", t)], f"h_head[{t}]")

    # -- memory (4), (5) -------------------------------------------------------------------
    kvs = {t: kv_shape(p.workload, t) for t in tiers}
    layers_and_globals = list(range(n_layer)) + [None]
    for t in tiers:
        ring = m.num(sum(g.nbytes for g in groups) + 1, f"ring[{t}]")
        for il in layers_and_globals:
            if il is not None:
                m.add(ring >= kv_layer_nbytes(p.spec, il, kvs[t]) * KS[(il, t)])
            for g in cm.by_layer[il]:
                m.add(ring >= g.nbytes * S[(g.name, t)])
        rows = min(t, p.workload.users)
        base = compute_nbytes(p.spec, t, p.workload.n_ctx, p.workload.flash_attn, 0)
        logits = compute_nbytes(p.spec, t, p.workload.n_ctx, p.workload.flash_attn, rows) - base
        used_bytes = (
            sum(g.nbytes * P[(g.name, t)] for g in groups)
            + PREFETCH_DEPTH * ring
            + sum(kv_layer_nbytes(p.spec, il, kvs[t]) * KP[(il, t)] for il in range(n_layer))
            + base
            + logits * ON[("output", t)]
        )
        m.add(used_bytes <= p.budget_bytes)

    # -- time (6) and objective ------------------------------------------------------------
    terms = []
    for sh in shapes:
        t, n = sh.tier, sh.tokens
        w = sh.weight
        gpu_of = {g.name: _ns(cm.gpu_seconds(g, n)) * ON[(g.name, t)] for g in groups}
        copy_of = {
            g.name: _busy_aware(m, cm, g.nbytes, S[(g.name, t)], Q[(g.name, t)]) for g in groups
        }
        for il in layers_and_globals:
            lg = cm.by_layer[il]
            gpu = sum(gpu_of[g.name] for g in lg)
            copy = sum(copy_of[g.name] for g in lg)
            cpu = sum(_ns(cm.cpu_seconds(g, n)) * C[(g.name, t)] for g in lg)
            residual_hop = _ns(cm.hop_seconds(n, p.spec.hparams.n_embd))
            if il is None:
                lat = residual_hop * hops[("head", t)]
            else:
                att_gpu = _ns(cm.attention_seconds(il, n, sh.depth, Loc(PINNED), sh.sequences))
                att_cpu = _ns(cm.attention_seconds(il, n, sh.depth, Loc(CPU), sh.sequences))
                gpu = gpu + att_gpu * K[(il, t)]
                cpu = cpu + att_cpu * (1 - K[(il, t)])
                up, down = cm.kv_stream_nbytes(il, n, sh.depth, sh.sequences)
                copy = copy + _busy_aware(m, cm, up, KS[(il, t)], QK[(il, t)])
                lat_kv = _busy_aware(m, cm, down, KS[(il, t)], QK[(il, t)])
                lat = (
                    lat_kv
                    + residual_hop * hops[("in", il, t)]
                    + sum(_ns(cm.hop_seconds(n, cm.hop_width)) * h for h in hops[(il, t)])
                    + _ns(cm.launch_seconds(ELEMENTWISE_KERNELS_PER_LAYER, n)) * anygpu[(il, t)]
                    + sum(_ns(cm.launch_seconds(1, n)) * ON[(g.name, t)] for g in lg)
                )
            if il is None:  # the two global groups overlap separately, as evaluate prices them
                for g in lg:
                    T = m.num(t_max, f"T[{g.name},{t},{sh.depth}]")
                    m.add(T >= gpu_of[g.name])
                    m.add(T >= copy_of[g.name])
                    terms.append((w, T))
                terms.append((w, cpu + lat))
                continue
            T = m.num(t_max, f"T[{il},{t},{sh.depth}]")
            m.add(T >= gpu)
            m.add(T >= copy)
            terms.append((w, T + cpu + lat))
    if hint:
        for t in tiers:
            if t not in hint:
                continue
            for g in groups:
                loc = hint[t].groups[g.name]
                m.hint(P[(g.name, t)], loc.kind == PINNED)
                m.hint(S[(g.name, t)], loc.kind == STREAMED)
                m.hint(C[(g.name, t)], loc.kind == CPU)
            for il in range(n_layer):
                m.hint(KP[(il, t)], hint[t].kv[il].kind == PINNED)
                m.hint(KS[(il, t)], hint[t].kv[il].kind == STREAMED)

    status, value, bound = m.solve(sum(m.weight(w) * e for w, e in terms), time_limit_seconds)
    if status == "INFEASIBLE":
        raise UserError(f"tier {tier}: no placement fits the budget")
    if status not in ("OPTIMAL", "FEASIBLE"):
        return None, 0.0, 0.0, status

    def where(pinned, streamed) -> Loc:
        return Loc(PINNED) if m.value(pinned) else Loc(STREAMED) if m.value(streamed) else Loc(CPU)

    t = tier
    locs = {g.name: where(P[(g.name, t)], S[(g.name, t)]) for g in groups}
    kv = {il: where(KP[(il, t)], KS[(il, t)]) for il in range(n_layer)}
    return TierPlacement(locs, kv), value, bound, status


def _busy_aware(m, cm: CostModel, nbytes: float, streamed, streamed_while_busy):
    """A copy's time: standalone when the tier leaves the CPU idle, slower when it does not."""
    free = cm.copy_seconds(nbytes, 0, False)
    return (
        m.coef(free) * streamed
        + m.coef(cm.copy_seconds(nbytes, 0, True) - free) * streamed_while_busy
    )


def best_start(p: Problem, objective: str = "e2e") -> tuple[str, dict[int, TierPlacement], float]:
    """(name, plan, seconds) of the best warm start under `evaluate`: the named strategies that
    run on our runtime, and `stream_rest`."""
    candidates = {n: f for n, f in STRATEGIES.items() if n != "fit"}
    candidates["stream-rest"] = stream_rest
    scored = []
    for name, make in candidates.items():
        plan = make(p)
        scored.append(
            (evaluate(plan, p.spec, p.profile, p.workload).objective(objective), name, plan)
        )
    seconds, name, plan = min(scored, key=lambda x: x[0])
    return name, plan, seconds
