"""The runtime: executes a solver plan through the Engine API of docs/contracts.md.

Per ubatch it takes the smallest tier covering its tokens, switches the arena to that tier's
memory map when the tier changes, and issues the tier's schedule (`pipeline_schedule` over the
parts of `program`, proved by `schedule.validate` when the tier is prepared): streamed groups and
KV copied into the ring slots ahead of the parts that read them, CPU parts on the CPU queue with
the activations handed over through events. This module holds what does not depend on the device;
`StandInEngine` runs it on the stand-in device (host memory, asynchronous queues, reference ops),
the CUDA engine on a GPU.

The arena is one allocation of the budget, laid out exactly as the plan's memory map of the tier:
pinned weights, expert caches, the scratch ring, the workspace, and the KV of device-resident
layers packed from the right; a plan over several devices has an arena, a ring and queues per
device (docs/runtime.md, Several devices). Host memory holds the groups some tier streams, computes on the CPU or pins only in some
tiers, and the fp16 KV of every layer (`kvstore.KVMirror`).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from refengine.agreement import PATHS
from refengine.engine import SequenceCalls, keep_all
from refengine.sequences import Sequences, Ubatch, one_sequence
from refengine.spec import ModelSpec, require_runnable
from solver.cost import PINNED, ROUTED, TierPlacement
from solver.groups import cache_nbytes, routed_slot_nbytes, tensor_groups
from solver.memory import kv_cell_nbytes, kv_layer_nbytes
from solver.plan import Plan
from solver.regions import Region, RegionId, RegionKind
from solver.usage import kv_shape

from . import program, split_parts
from .plan_check import check_plan, check_users
from .kvstore import SEQ_WINDOW, KVCells, SwaPool, device_cells
from .counts import schedule_operations
from .expert_cache import Admission, ExpertCache
from .handoffs import handoffs
from .schedule import (
    Slot, Unit, cache_of, group_unit, kv_unit, pipeline_schedule, prefetch_of, ring_slot, validate,
)
from .segments import cpu_segments, ends_with_sync
from .switch import switch_steps
from .split_parts import SUMS


# parts whose arithmetic is exact on every queue: the token rows, the attention over the fp16 KV,
# a tensor split's sums and gather
EXACT_PARTS = ("embed", "kq", *SUMS, "logits")


class Tier:
    """What the runtime prepares for one tier of the plan."""

    def __init__(self, engine: "PlanExecutor", tier: int, place: TierPlacement,
                 maps: dict[int, list[Region]]):  # fmt: skip
        self.tier, self.place = tier, place
        self.map = maps  # device -> its memory map
        self.regions = {r.id: r for m in maps.values() for r in m}  # every device's
        if engine.shares is not None:  # a tensor split: every device's parts and the sums
            self.parts = split_parts.parts(engine.spec.hparams.n_layer, engine.shares)
            self.schedule = split_parts.schedule(self.parts)
            self.segments, self.final_sync = [], True
        else:
            self.parts = program.parts(engine.spec, place)
            ops = pipeline_schedule([p.step for p in self.parts], engine.n_slots)
            self.schedule = handoffs(ops, {p.name: p.kind for p in self.parts},
                                     engine.spec.arch.moe)  # fmt: skip
            # consecutive CPU parts run as one segment between two hand-offs (segments.py)
            self.segments = cpu_segments(self.parts, engine.spec.arch.moe)
            self.final_sync = ends_with_sync(self.parts, self.segments)
        self.slots, self.slot_region = {}, {}  # ring slot -> its scratch region
        for d, m in maps.items():
            ring = [r for r in m if r.kind is RegionKind.SCRATCH]
            for i, r in enumerate(ring):
                sid = ring_slot(d, i)
                self.slots[sid] = Slot(sid, r.offset_bytes, r.nbytes, d)
                self.slot_region[sid] = r.id
            for r in m:  # the expert caches, which routed copies and prefetches write
                if r.kind is RegionKind.CACHE:
                    sid = cache_of(r.id.key)
                    self.slots[sid] = Slot(sid, r.offset_bytes, r.nbytes, d)
        # layer -> the expert cache its routed stacks share (slots), if any
        self.cache_slots = {
            g.layer: place.groups[g.name].cache
            for g in engine.groups.values()
            if place.groups[g.name].kind == ROUTED and place.groups[g.name].cache
        }
        self.kv_cells = {
            il: kv_layer_nbytes(engine.spec, il, kv_shape(engine.workload, tier))
            // engine.cell_nbytes
            for il in range(engine.spec.hparams.n_layer)
        }
        swa = [c for il, c in self.kv_cells.items() if engine.spec.is_swa(il)]
        self.pool_cells = swa[0] if swa else 0  # every sliding-window layer's device cells
        sums = frozenset(p.name for p in self.parts if p.kind in SUMS)
        self.operations = schedule_operations(self.schedule, sums)  # what each ubatch moves
        errors = validate(self.schedule, self.slots, engine.unit_nbytes(self))
        if errors:  # the schedule builder is wrong: a bug, never a user error
            raise AssertionError(f"tier {tier}: invalid schedule: {errors[:3]}")


class PlanExecutor(SequenceCalls):
    """The device-independent half of the runtime: plan, tiers, host memory, the Engine API (of
    `n_seq` sequences, docs/sequences.md)."""

    def __init__(self, spec: ModelSpec, plan: dict, progress: bool = False, n_seq: int = 1,
                 unified: bool = False):  # fmt: skip
        from .hostweights import HostWeights
        from .kvstore import KVMirror

        check_plan(plan, spec)
        check_users(plan, n_seq)
        require_runnable(spec, self.name)
        self.spec = spec
        self.plan = plan = Plan.from_json(plan, spec)
        self.workload, self.n_ctx = plan.workload, plan.workload.n_ctx
        self.budgets = plan.budgets  # one arena per device
        self.budget_bytes = self.budgets[0]
        self.cell_nbytes = kv_cell_nbytes(spec, "f16")
        self.groups = {g.name: g for g in tensor_groups(spec)}
        self.shares = plan.shares  # a tensor split: each device's shares of every layer
        self.placements = {t: tp.place for t, tp in plan.tiers.items()}
        self.maps = {t: tp.maps for t, tp in plan.tiers.items()}
        self.n_slots = max(
            (sum(r.kind is RegionKind.SCRATCH for r in m)
             for maps in self.maps.values()
             for m in maps.values()),
            default=0,
        )  # fmt: skip
        self.tier_sizes = sorted(self.placements)
        self.ubatch_tokens = self.tier_sizes[-1]
        everywhere = {
            n
            for n in self.groups
            if all(p.groups[n].kind == PINNED for p in self.placements.values())
        }
        self.host = HostWeights(spec, set(self.groups) - everywhere, self.host_alloc, progress)
        self.mirror = KVMirror(spec, self.n_ctx, self.host_alloc)
        self.seqs = Sequences(self.n_ctx, n_seq, unified)
        self.cells = KVCells(self.seqs, spec.hparams.n_swa)
        self.tiers = {t: Tier(self, t, p, self.maps[t]) for t, p in self.placements.items()}
        self.current: Tier | None = None
        self.pool: SwaPool | None = None  # the current tier's sliding-window device cells
        self.trace_events: list | None = None  # a list: record (lane, op, start s, end s)
        self.expert_copied_nbytes = 0  # bytes of expert stacks copied up, whole or routed
        self.caches: dict[int, ExpertCache] = {}  # layer -> its expert cache, in this tier
        self.admitted: dict[tuple[int, bool], Admission] = {}  # this ubatch's, (layer, prefetch)
        # of the experts routed layers with a cache chose: how many, how many were resident
        # when the router chose, how many the prefetch had predicted
        self.expert_lookups = Counter()

    host_alloc = None  # pinned host memory on a GPU

    def part_path(self, tier: Tier, part) -> str:
        """The named path (docs/contracts.md, Tolerances) of one part's arithmetic in a tier: a
        matmul on the CPU quantizes its activations to 8 bits ("int8"); the token rows and the
        attention over the fp16 KV are exact anywhere, and so is the stand-in device (reference
        ops)."""
        if part.kind in EXACT_PARTS:
            return "fp32"
        return "int8" if part.queue.on_host else self.device_path(tier.tier, part.kind)

    def device_path(self, tier: int, kind: str) -> str:
        """The named path of a device matmul part in a tier of this many tokens: the stand-in's
        exact reference ops; the CUDA engine names its own kernels."""
        return "fp32"

    @property
    def path(self) -> str:
        """The plan's named path: the least exact arithmetic of any part in any tier — "int8",
        then "fp16" (tensor-core GEMM), else "fp32"."""
        names = {self.part_path(t, p) for t in self.tiers.values() for p in t.parts}
        return next((n for n in ("int8", "fp16") if n in names), "fp32")

    @property
    def tolerance(self) -> float:
        """docs/contracts.md's end-to-end logits tolerance of this plan's path."""
        return PATHS[self.path].normwise

    def region(self, tier: Tier, rid: RegionId):
        """A region of the tier's memory map, as a view of its device's arena (host or device
        bytes)."""
        r = tier.regions[rid]
        return self.arenas[rid.device][r.offset_bytes : r.offset_bytes + r.nbytes]

    def unit_nbytes(self, tier: Tier) -> dict[Unit, int]:
        """What each unit a tier copies measures at most (a routed stack: the experts its largest
        ubatch can route to)."""
        out = {}
        for name, g in self.groups.items():
            loc = tier.place.groups[name]
            out[group_unit(name)] = g.nbytes
            if loc.kind == ROUTED:
                out[group_unit(name)] = routed_slot_nbytes(self.spec, g, tier.tier, loc.cache)
                out[prefetch_of(name)] = cache_nbytes(self.spec, g, loc.cache)
        for il, cells in tier.kv_cells.items():
            out[kv_unit(il)] = cells * self.cell_nbytes
        return out

    def admit(self, tier: Tier, il: int, ids, prefetch: bool = False) -> Admission:
        """Where layer il's experts chosen by `ids` (or predicted, for a `prefetch`) are in its
        expert cache, decided once a ubatch for all of the layer's routed stacks."""
        key = (il, prefetch)
        if key not in self.admitted:
            cache = self.caches.setdefault(il, ExpertCache(tier.cache_slots[il]))
            experts = program.routed_experts(ids)
            if not prefetch:
                guess = self.admitted.get((il, True))
                named = set(guess.resident) | set(guess.overflow) if guess else set()
                self.expert_lookups.update(
                    chosen=len(experts),
                    resident=sum(e in cache.where for e in experts),
                    predicted=len(named & set(experts)),
                )
            self.admitted[key] = cache.admit(experts)
        return self.admitted[key]

    def attention_window(self, il: int) -> int:
        """The window device attention masks layer il with, over `kvstore.device_keys`."""
        return self.spec.hparams.n_swa if self.spec.is_swa(il) else SEQ_WINDOW

    def attention_ranges(self, st, il: int) -> list[tuple[int, int, int, int]]:
        """(first token, end token, first cell, end cell) of each device attention call of layer
        il: with per-sequence streams, each sequence over its own stream of a full-context
        layer; else every token over every cell in use, the keys masking the others."""
        d, n = st.device, st.tokens.size
        if self.spec.is_swa(il):
            return [(0, n, 0, d.keys_swa.size)]
        if self.seqs.unified or self.seqs.n_seq == 1:
            return [(0, n, 0, d.keys.size)]
        c = st.cells
        return [(first, first + count, int(c.lo[first]), int(c.hi[first + count - 1]))
                for _, first, count in c.segments]  # fmt: skip

    # -- Engine API (prefill, decode and the calls of several sequences: SequenceCalls) ---------

    def reset(self) -> None:
        self.caches = {}  # a run after a reset copies what the same run did before
        self.seqs.reset()
        self.cells.reset()
        if self.pool is not None:
            self.pool.refill()

    def _removed(self, seq: int) -> None:
        self.cells.free(seq)

    def tier_for(self, n_tokens: int) -> Tier:
        return self.tiers[next((t for t in self.tier_sizes if t >= n_tokens), self.tier_sizes[-1])]

    def _forward(self, ub: Ubatch, all_logits: bool, rec, record) -> np.ndarray:
        st = self._run(self.tier_for(ub.size), ub, all_logits)
        keep_all(rec, record, st.record)
        # a row too many shifts every later ubatch's rows: the call would return another token's
        if st.logits.shape[0] != ub.logit_rows.size:
            raise AssertionError(f"{st.logits.shape[0]} logit rows for a ubatch that wants "
                                 f"{ub.logit_rows.size}")  # fmt: skip
        return st.logits

    def _run(self, tier: Tier, ub: Ubatch, all_logits: bool):
        from .hostmath import Act

        if tier is not self.current:
            self.switch(tier)
            self.caches = {}  # the new memory map's caches start empty
        self.admitted = {}
        st = Act(ub.tokens, ub.pos, all_logits)
        st.cells, st.logit_rows = self.cells.place(ub), ub.logit_rows
        st.device = device_cells(self.cells, st.cells, self.pool)
        self.execute(tier, st)
        return st

    def kv_rows(self, il: int):
        """(device cells, host cells) of layer il's keys in the current tier's device layout
        (`kvstore`): a full-context layer's cells in use as they are; the held cells of the
        sliding-window pool."""
        if not self.spec.is_swa(il):
            return slice(0, self.cells.n_used), slice(0, self.cells.n_used)
        held = np.flatnonzero(self.pool.host >= 0)
        return held, self.pool.host[held]

    def new_pool(self, tier: Tier) -> SwaPool | None:
        """A tier's sliding-window device cells, holding every key a query may still read (the
        device engine lays them out from the mirror at the switch)."""
        return SwaPool(tier.pool_cells, self.cells) if tier.pool_cells else None

    def memory_report(self) -> list[str]:
        """What the arena holds per tier, against the budget (the device engine adds what it
        measured)."""
        out = []
        for t, maps in sorted(self.maps.items()):
            for d, m in sorted(maps.items()):
                used = max((r.offset_bytes + r.nbytes for r in m if r.kind is not RegionKind.KV),
                           default=0)  # fmt: skip
                kv = sum(r.nbytes for r in m if r.kind is RegionKind.KV)
                device = f" device {d}:" if len(maps) > 1 else ""
                out.append(f"tier {t}:{device} arena {used / 2**20:.1f} MiB from the left + KV "
                           f"{kv / 2**20:.1f} MiB from the right, of a budget of "
                           f"{self.budgets[d] / 2**20:.1f} MiB")  # fmt: skip
        return out

    def launch_report(self, launch_seconds: float) -> list[str]:
        """Launches per token and what they cost (the device engine reports its graphs)."""
        return []

    def warm_up(self) -> None:
        """Compile every kernel and prepare every tier before the first token: a ubatch through
        each tier's schedule (largest first, so the smallest is current after), then reset."""
        for size in reversed(self.tier_sizes):
            n = self.warm_up_tokens(size)
            self._run(self.tiers[size], one_sequence(np.zeros(n, np.int64), np.arange(n)), False)
        self.reset()

    def warm_up_tokens(self, tier: int) -> int:
        """Tokens of a tier's warm-up ubatch: one, where every size of ubatch runs the same code."""
        return 1

    # -- device-specific -----------------------------------------------------------------------

    def switch(self, tier: Tier) -> None:
        raise NotImplementedError

    def execute(self, tier: Tier, st) -> None:
        raise NotImplementedError


def group_bytes(engine: "PlanExecutor", group: str) -> np.ndarray:
    """A group's bytes in its layout: from host memory, or assembled from the memory-mapped file
    for a group pinned in every tier (uploaded once, at warm-up)."""
    if group in engine.host.offsets:
        return engine.host.group(group)
    out = np.empty(engine.groups[group].nbytes, np.uint8)
    source = np.memmap(engine.spec.path, dtype=np.uint8, mode="r")
    for p in engine.host.layouts[group]:
        out[p.offset : p.offset + p.info.nbytes] = source[
            p.info.offset : p.info.offset + p.info.nbytes
        ]
    return out


def weight_steps(before: list[Region] | None, after: list[Region]):
    """The switch steps of the weight regions (the KV is laid out again from the host mirror)."""
    keep = [r for r in after if r.kind is RegionKind.WEIGHTS]
    if before is None:
        return switch_steps([], keep)
    return switch_steps([r for r in before if r.kind is RegionKind.WEIGHTS], keep)
