"""The runtime on the stand-in device: the plan's arena in host memory, the tier's schedule run
on asynchronous queues (`standin.StandInDevice`), the compute queue's parts in exact fp32 with the
reference operations, the CPU queue's with the CPU kernels a segment at a time (`segments.py`: a
run of consecutive CPU parts goes at its first part, as on the CUDA engine, while the schedule's
hand-offs are still tracked op by op). It is the whole executor but for the GPU kernels, so
the real models run through it in CI and every removed event wait is caught."""

from __future__ import annotations

import numpy as np

from refengine.spec import ModelSpec
from solver import regions
from solver.cost import PINNED, ROUTED
from solver.groups import EXPERTS

from . import counts, program
from .executor import PlanExecutor, Tier, group_bytes, weight_steps
from .hostmath import Act, HostMath
from .hostweights import cache_ranges, routed_pack, routed_tensors_of, tensors_of
from .program import routed_experts
from .segments import SegmentRunner
from .shards import share_bytes
from .split_parts import HostShards, SplitForward, shard_maths
from .schedule import SlotKind, Unit, UnitKind
from .standin import POISON, StandInDevice
from .switch import apply_steps

FAST_DELAYS = {"copy_delay_s": (0.0, 0.0002), "compute_delay_s": (0.0, 0.0001)}


class StandInEngine(PlanExecutor):
    name = "standin"

    def __init__(self, spec: ModelSpec, plan: dict, seed: int = 0, threads: int = 0,
                 progress: bool = False, delays: dict | None = None, reference=None,
                 n_seq: int = 1, unified: bool = False):  # fmt: skip
        """`reference`: a GGUFWeights whose dequantized tensors the compute queue may share (a
        NumPy engine's `w`)."""
        super().__init__(spec, plan, progress, n_seq, unified)
        # one allocation a device: its budget
        self.arenas = [np.full(b, POISON, np.uint8) for b in self.budgets]
        self.math = {
            "compute": HostMath(spec, exact=True, reference=reference),
            "cpu": HostMath(spec, False, threads),
        }
        self.runner = SegmentRunner(spec, self.math["cpu"], self.host, self.mirror)
        self.tally = counts.Tally()  # segments per (tier, tokens); no launches to count here
        self.counted = ("segments",)
        self.seed, self.ubatches = seed, 0
        self.delays = FAST_DELAYS if delays is None else delays
        if self.shares is not None:  # each device's reference operations over its shares
            self.shard_maths = shard_maths(spec, self.shares, self.math["compute"].reference)

    # -- tier switch -----------------------------------------------------------------------------

    def switch(self, tier: Tier) -> None:
        for d, arena in enumerate(self.arenas):
            before = self.current.map.get(d, []) if self.current else None
            apply_steps(arena, weight_steps(before, tier.map.get(d, [])), _GroupBytes(self, d))
        self.pool = self.new_pool(tier)  # the mirror is written through: nothing to fetch first
        if self.shares is not None:  # each device its KV heads of every layer
            for d in self.shares.devices:
                for il in tier.kv_cells:
                    self._lay_kv(il, self.region(tier, regions.kv(il, d)),
                                 tier.kv_cells[il], self.shares.kv_heads(self.spec, d))  # fmt: skip
        else:
            for il, loc in tier.place.kv.items():
                if loc.kind == PINNED:
                    self._lay_kv(il, self.region(tier, regions.kv(il, loc.device)),
                                 tier.kv_cells[il])  # fmt: skip
        self.current = tier

    def _lay_kv(self, il: int, buf: np.ndarray, cells: int, heads=None) -> np.ndarray:
        """The mirror's keys and values of layer il (of KV `heads` [lo, hi) only, under a tensor
        split) in the device layout (`kvstore`)."""
        buf[:] = 0  # cells never written must not hold NaN (0 x NaN in the masked sum)
        lo, hi = heads or (0, self.mirror.k_shape[0])
        k, v = self.mirror.views(buf, cells, heads)
        dev, host = self.kv_rows(il)
        k[dev], v[dev] = self.mirror.k[il][host, lo:hi], self.mirror.v[il][host, lo:hi]
        return buf

    def _host_bytes(self, tier: Tier, unit: Unit, st: Act | None = None) -> np.ndarray:
        """A unit's bytes as a copy reads them: a routed stack's, of the experts `st`'s router
        chose."""
        if unit.kind is UnitKind.FIELD:  # a hand-off: tracked, the activations are the host's
            return np.empty(0, np.uint8)
        if unit.kind is UnitKind.KV:
            il = unit.key
            return self._lay_kv(il, np.empty(tier.kv_cells[il] * self.cell_nbytes, np.uint8),
                                tier.kv_cells[il])  # fmt: skip
        group = unit.key
        if unit.kind is UnitKind.PREFETCH:  # the predicted experts into the cache
            self._fill_cache(tier, group, self.admit(tier, self.groups[group].layer, st.pred,
                                                     True))  # fmt: skip
            return np.empty(0, np.uint8)
        if tier.place.groups[group].kind == ROUTED:  # the copy runs after the router chose
            experts = routed_experts(st.ids)
            if tier.place.groups[group].cache:
                admission = self.admit(tier, self.groups[group].layer, st.ids)
                self._fill_cache(tier, group, admission)
                experts = admission.overflow
            data = routed_pack(self.host.layouts[group], self.host.group(group), experts)
        else:
            data = self.host.group(group)
        if self.groups[group].kind == EXPERTS:
            self.expert_copied_nbytes += data.size
        return data

    def _fill_cache(self, tier: Tier, group: str, admission) -> None:
        """The experts a copy keeps (`admission.inserted`) into the group's cache region."""
        loc = tier.place.groups[group]
        cache, src = self.region(tier, regions.cache(group, loc.device)), self.host.group(group)
        slots = loc.cache
        for e, slot in admission.inserted.items():
            for lo, at, nbytes in cache_ranges(self.host.layouts[group], slots, e, slot):
                cache[at : at + nbytes] = src[lo : lo + nbytes]
                self.expert_copied_nbytes += nbytes

    # -- one ubatch ------------------------------------------------------------------------------

    def execute(self, tier: Tier, st: Act) -> None:
        memory = {name: self.region(tier, region) for name, region in tier.slot_region.items()}
        device = StandInDevice(tier.slots, lambda u: self._host_bytes(tier, u, st),
                               self.seed + self.ubatches, memory, **self.delays)  # fmt: skip
        self.ubatches += 1
        if self.shares is not None:
            forward = SplitForward(self.spec, self.shares, self.groups, HostShards(self, tier, st))
            kernels = {p.name: (lambda views, p=p: forward.run(p)) for p in tier.parts}
        else:
            starts = {seg.first: seg for seg in tier.segments}
            kernels = {p.name: self._kernel(tier, i, p, st, starts)
                       for i, p in enumerate(tier.parts)}  # fmt: skip
        before = self.runner.calls
        try:
            violations = device.execute(tier.schedule, kernels)
        finally:
            device.close()
        self.tally.add(tier.tier, st.tokens.size, False,
                       counts.Counts(segments=self.runner.calls - before))  # fmt: skip
        if self.trace_events is not None:
            self.trace_events.extend(device.trace)
        if violations:  # the schedule or the executor is wrong: a bug, never a user error
            raise AssertionError(f"tier {tier.tier}: {violations[:3]}")

    def _kernel(self, tier: Tier, i: int, part, st: Act, starts: dict):
        def kernel(views):
            if part.queue.on_host:  # the segment's other parts run with its first
                if i in starts:
                    self.runner.run(starts[i], tier.parts, st, self.requested)
            elif part.kind == "kq":
                self._kq(tier, part.layer, st, views)
            else:
                w = self._weights(tier, part.group, views, st)
                self.math["compute"].run(part.kind, part.layer, st, w)
                if program.predicts(tier.parts, i):
                    self.math["compute"].predict(st, w, part.layer)

        return kernel

    def _weights(self, tier: Tier, group: str, views, st: Act) -> dict:
        """A device part's weights: its arena region when pinned, else its ring slot (a routed
        copy's: the experts the router chose)."""
        loc = tier.place.groups[group]
        kind = loc.kind
        if kind == PINNED:
            return tensors_of(self.host.layouts[group],
                              self.region(tier, regions.weights(group, loc.device)))  # fmt: skip
        (buf,) = (v for sid, v in views.items() if sid.kind is SlotKind.RING)
        if kind == ROUTED:
            layout = self.host.layouts[group]
            if not loc.cache:
                return routed_tensors_of(layout, buf, routed_experts(st.ids))
            got = self.admitted[(self.groups[group].layer, False)]
            cache = regions.cache(group, loc.device)
            return routed_tensors_of(layout, buf, got.overflow, self.region(tier, cache),
                                     got.resident)  # fmt: skip
        return tensors_of(self.host.layouts[group], buf)

    def _kq(self, tier: Tier, il: int, st: Act, views) -> None:
        loc, d = tier.place.kv[il], st.device
        k16, v16 = st.k.astype(np.float16), st.v.astype(np.float16)
        self.mirror.k[il][st.cells.write] = k16  # the host copy, written through
        self.mirror.v[il][st.cells.write] = v16
        buf = (self.region(tier, regions.kv(il, loc.device)) if loc.kind == PINNED
               else next(iter(views.values())))  # fmt: skip
        k, v = self.mirror.views(buf, tier.kv_cells[il])
        swa = self.spec.is_swa(il)
        write, keys = (d.write_swa, d.keys_swa) if swa else (d.write, d.keys)
        k[write], v[write] = k16, v16
        st.a = np.empty((st.tokens.size, self.spec.hparams.n_head, v.shape[2]), np.float32)
        for t0, t1, lo, hi in self.attention_ranges(st, il):
            st.a[t0:t1] = self.math["compute"].attention(
                st.q[t0:t1], d.q_keys[t0:t1], il, k[lo:hi], v[lo:hi], keys[lo:hi],
                self.attention_window(il),
            )  # fmt: skip


class _GroupBytes:
    """A weights region -> its group's bytes (device d's share under a tensor split), for
    `apply_steps`."""

    def __init__(self, engine: StandInEngine, d: int):
        self.engine, self.d = engine, d

    def __getitem__(self, rid: regions.RegionId) -> np.ndarray:
        e, group = self.engine, rid.key
        if e.shares is not None:
            return share_bytes(e.spec, e.groups[group], e.shares, self.d,
                               e.math["compute"].reference.raw)  # fmt: skip
        return group_bytes(e, group)
