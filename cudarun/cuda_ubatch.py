"""One ubatch of a tier's schedule on the CUDA engine's devices (an `issue.Device`): copies on
each device's copy stream, device parts on its compute stream, each CPU segment on this thread at
its first part, the schedule's events between the streams.

The activation fields (`segments.FIELDS`) move as the schedule's hand-off copies say
(`handoffs`), each on a device's compute stream through the tier's pinned staging rows: down after
the part that wrote the field, up before the part that reads it (after the host's rows are filled
from its activations, where the host wrote it), device to device as a copy down then a copy up,
ordered by the schedule's events. The host waits only at a CPU segment's start, once per device
whose copies down it is about to read or whose stream may still read staging (an upload since the
last wait: the staging rows are written again only after it), so that copies down are batched in
one wait (`segments.Segment.sync` counts it on one device) and uploads need none.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from solver import regions
from solver.cost import PINNED, ROUTED
from solver.groups import EXPERTS

from . import program
from .cuda_device import new_event, simulated
from .devicemath import CACHE_SLOTS, CACHED, ROUTED_IDS, device_tensors
from .expert_cache import Admission
from .hostweights import cache_ranges, cache_stacks, routed_ranges
from .kvstore import host_runs
from .program import routed_experts
from .schedule import (
    HOST_DEVICE, Compute, Copy, EventId, Record, Signal, SlotId, SlotKind, Unit, UnitKind, Wait,
    handed,
)
from .segments import Segment


class CudaUbatch:
    def __init__(self, engine, tier, st, capturing: bool = False):
        e = self.e = engine
        self.tier, self.st, self.capturing = tier, st, capturing
        self.n, self.moe = st.tokens.size, e.spec.arch.moe
        used = sorted({p.queue.device for p in tier.parts if not p.queue.on_host})
        self.wss = {d: e.workspace(tier, d) for d in used}
        self.stage = None if capturing else e.staging(tier)
        self.host = None if capturing else st.for_host()  # the CPU segments' activations
        self.events: dict[EventId, object] = {}
        self.routed: dict[tuple[str, bool], tuple] = {}  # (router, prefetch) -> admission, ids
        self.placed: set[tuple[str, int]] = set()  # (router, device): experts' places written
        self.down: dict[str, int] = {}  # field -> the device copying it down, since a wait
        self.uploading: set[int] = set()  # devices whose compute streams may read staging
        self.uploaded = False  # since the last segment (a batch of uploads, counted once)
        self.staged: dict[str, Unit] = {}  # field -> the version its staging rows hold
        self.index = {p.name: i for i, p in enumerate(tier.parts)}
        self.starts = {seg.first: seg for seg in tier.segments}
        self.timer = _Timer(e) if e.trace_events is not None and not capturing else None

    def finish(self) -> None:
        """Every traced span timed (the streams waited for)."""
        if self.timer is not None:
            for dev in self.e.devices:
                self.e.sync(dev.compute)
                self.e.sync(dev.copy)
            self.e.trace_events.extend(self.timer.events())

    # -- the Device protocol ----------------------------------------------------------------------

    def record(self, op: Record) -> None:
        if op.queue.on_host:
            # the host's work is done when it issues the next op. On one device it is recorded
            # on the compute stream: a routed copy after a CPU router then follows the device's
            # earlier expert products, whose expert places it rewrites (on several devices the
            # router's segment waited for the device that ran them: it reads their x)
            if len(self.e.devices) > 1:
                return
            stream = self.e.devices[0].compute
        else:
            stream = self.e.devices[op.queue.device].stream(op.queue.lane)
        ev = self.events[op.event] = new_event(self.e.cuda)
        ev.record(stream)

    def wait(self, op: Wait) -> None:
        # the host's waits are its segments' (`_segment`)
        if not op.queue.on_host and op.event in self.events:
            self.events[op.event].wait(self.e.devices[op.queue.device].stream(op.queue.lane))

    def copy(self, op: Copy) -> None:
        if handed(op):
            self._hand_off(op)
            return
        d = op.queue.device
        stream = self.e.devices[d].stream(op.queue.lane)
        with _span(self.timer, "copy", f"copy {op.tensor}", stream):
            if not op.reads:
                self._copy_unit(op.tensor, op.slot, stream)
                return
            # routed or prefetched: the router's choice (or guess) first
            by = op.reads[0][0].key  # the router's step
            prefetch = op.tensor.kind is UnitKind.PREFETCH
            part = self.tier.parts[self.index[by]]
            if (by, prefetch) not in self.routed:
                self.routed[by, prefetch] = self._route(part, prefetch)
            admission, ids = self.routed[by, prefetch]
            if not prefetch and (by, d) not in self.placed:  # each device's expert products
                self._place_experts(part.layer, admission, ids, self.wss[d], stream)
                self.placed.add((by, d))
            self._copy_routed(op.tensor.key, op.slot, admission, prefetch, stream)

    def compute(self, op: Compute) -> None:
        i = self.index[op.name]
        part = self.tier.parts[i]
        if part.queue.on_host:
            if i in self.starts:  # the segment's other parts run with it
                seg = self.starts[i]
                with _span(self.timer, "cpu", _segment_name(self.tier, seg), None):
                    self._segment(seg)
            return
        slot = next((s for _, s in op.reads if s.kind is SlotKind.RING), None)
        with _span(self.timer, "compute", op.name, self.e.devices[part.queue.device].compute):
            self._device_part(part, slot)

    # -- hand-offs ---------------------------------------------------------------------------------

    def _hand_off(self, op: Copy) -> None:
        """A field's version between a device's workspace and its staging rows, on the device's
        compute stream where the schedule puts it: down after the part that wrote it; up before
        the part that reads it (from the host's activations first, where the host wrote it)."""
        f, version, d = op.tensor.key, op.tensor, op.queue.device
        rows, staged = self._rows(self.wss[d], f)
        stream = self.e.devices[d].compute
        if op.slot.device == HOST_DEVICE:
            rows.copy_to_host(staged, stream=stream)
            self.down[f] = d
        else:
            if self.tier.parts[self.index[version.writer]].queue.on_host:
                if self.staged.get(f) != version:
                    staged[...] = np.reshape(getattr(self.host, f), staged.shape)
                self.e.counter.uploads += not self.uploaded
                self.uploaded = True
            rows.copy_to_device(staged, stream=stream)
            self.uploading.add(d)
        self.staged[f] = version

    def _segment(self, seg: Segment) -> None:
        """A CPU segment: a wait per device whose copies down it reads or whose stream may still
        read staging (an earlier upload), its parts on the host."""
        e, host, counter = self.e, self.host, self.e.counter
        counter.segments += 1
        for d in sorted(self.uploading | set(self.down.values())):
            e.sync(e.devices[d].compute)
        for f in self.down:  # fresh views: HostMath keys its quantized inputs by identity
            setattr(host, f, self._host_value(f))
        counter.downloads += bool(self.down)
        self.down, self.uploading, self.uploaded = {}, set(), False
        e.runner.run(seg, self.tier.parts, host, e.requested)
        if self.tier.parts[seg.stop - 1].kind == "output":
            self.st.logits = host.logits

    def _row_count(self, f: str) -> int:
        """Rows of a field (MoE's gate and up: a row per chosen expert on the device)."""
        return self.n * self.e.spec.hparams.n_expert_used if self._per_slot(f) else self.n

    def _per_slot(self, f: str) -> bool:
        return f in ("gate", "up") and self.moe

    def _rows(self, ws: dict, f: str):
        """The device rows and the staging rows of a field."""
        rows = self._row_count(f)
        return ws[f][:rows], self.stage[f][:rows]

    def _host_value(self, f: str) -> np.ndarray:
        """A field as the CPU kernels take it (int64 ids), viewing the staging rows."""
        staged = self.stage[f][: self._row_count(f)]
        if self._per_slot(f):
            return staged.reshape(self.n, self.e.spec.hparams.n_expert_used, -1)
        return staged.astype(np.int64) if f == "ids" else staged

    # -- copies ------------------------------------------------------------------------------------

    def _slot(self, slot: SlotId):
        return self.e.region(self.tier, self.tier.slot_region[slot])

    def _copy_unit(self, unit: Unit, slot: SlotId, stream) -> None:
        e, buf = self.e, self._slot(slot)
        if unit.kind is UnitKind.KV:
            e.kv.upload(unit.key, buf, self.tier.kv_cells[unit.key], stream)
            return
        data = e.host.group(unit.key)
        buf[: data.size].copy_to_device(data, stream=stream)
        if e.groups[unit.key].kind == EXPERTS:
            e.expert_copied_nbytes += data.size

    def _route(self, part, prefetch: bool) -> tuple[Admission, np.ndarray]:
        """The experts a router chose (or, for a prefetch, is predicted to choose: `part` is the
        layer's `qkv`), read back from its workspace (a sync: the copies depend on them, as under
        llama.cpp's op-offload), and where each goes (`Admission`: its expert cache, else the
        routed copy); with the ids [T, k]."""
        e, il = self.e, part.layer
        if part.queue.on_host:
            ids = self.host.ids
        else:
            e.sync(self.events[EventId(Signal.PREDICTED if prefetch else Signal.ROUTED, part.name)])
            ws = self.wss[part.queue.device]
            ids = ws["pred" if prefetch else "ids"][: self.n].copy_to_host()
        if il in self.tier.cache_slots:
            return e.admit(self.tier, il, ids, prefetch), ids
        return Admission(overflow=routed_experts(ids)), ids

    def _place_experts(self, il: int, admission: Admission, ids, ws: dict, stream) -> None:
        """Each chosen expert's place (its expert cache slot, else its place in the routed copy)
        into the workspace the expert products read it from, on the copy stream before the
        copies' events, which the products wait for."""
        slots = self.tier.cache_slots.get(il, 0)
        places = np.vectorize(lambda x: admission.place(int(x), slots), otypes=[np.int32])
        ws["slot_ids"][: ids.shape[0]].copy_to_device(places(ids), stream=stream)

    def _copy_routed(self, unit: str, slot: SlotId, admission: Admission, prefetch: bool,
                     stream) -> None:  # fmt: skip
        """A routed stack's experts from pinned host memory: those its expert cache keeps
        (`admission.inserted`) into their cache slots, the others chosen into its ring slot, one
        copy per run of consecutive experts (`routed_ranges`); a prefetch fills the cache only."""
        e, tier = self.e, self.tier
        src, layout, at = e.host.group(unit), e.host.layouts[unit], 0
        if admission.inserted:
            loc = tier.place.groups[unit]
            cache, slots = e.region(tier, regions.cache(unit, loc.device)), loc.cache
            for x, place in admission.inserted.items():
                for lo, to, nbytes in cache_ranges(layout, slots, x, place):
                    cache[to : to + nbytes].copy_to_device(src[lo : lo + nbytes], stream=stream)
                    e.expert_copied_nbytes += nbytes
        if prefetch:
            return
        buf = self._slot(slot)
        for lo, nbytes in routed_ranges(layout, admission.overflow):
            buf[at : at + nbytes].copy_to_device(src[lo : lo + nbytes], stream=stream)
            at += nbytes
        e.routed_held[unit] = len(admission.overflow)
        e.expert_copied_nbytes += at

    # -- device parts ------------------------------------------------------------------------------

    def _weights(self, group: str, slot: SlotId | None, ws: dict) -> dict:
        e, tier = self.e, self.tier
        loc = tier.place.groups[group]
        if loc.kind == ROUTED:  # as many experts as the router chose, in their places
            layout = e.host.layouts[group]
            w = device_tensors(layout, self._slot(slot), e.routed_held[group])
            w[ROUTED_IDS] = ws["slot_ids"]
            if loc.cache:  # each stack's cached experts, before the copy's
                cache = e.region(tier, regions.cache(group, loc.device))
                for p, at, nbytes in cache_stacks(layout, loc.cache):
                    w[p.info.name + CACHED] = cache[at : at + nbytes]
                w[CACHE_SLOTS] = loc.cache
            return w
        buf = (e.region(tier, regions.weights(group, loc.device)) if loc.kind == PINNED
               else self._slot(slot))  # fmt: skip
        return device_tensors(e.host.layouts[group], buf[: e.groups[group].nbytes])

    def _device_part(self, part, slot: SlotId | None) -> None:
        e, tier, st, n = self.e, self.tier, self.st, self.n
        dev = e.devices[part.queue.device]
        ws, s, dmath = self.wss[dev.index], dev.compute, dev.math
        if part.kind == "kq":
            il = part.layer
            loc = tier.place.kv[il]
            buf = (e.region(tier, regions.kv(il, loc.device)) if loc.kind == PINNED
                   else self._slot(slot))  # fmt: skip
            cells = tier.kv_cells[il]
            k, v = e.mirror.views(buf, cells)
            swa = e.spec.is_swa(il)
            k_pos = ws["k_pos_swa" if swa else "k_pos"][:cells]
            # a graph replays with other cells in use: over every cell, EMPTY ones masked
            ranges = [(0, n, 0, cells)] if self.capturing else e.attention_ranges(st, il)
            dmath.kq(ws, n, il, k, v, k_pos, ws["write_swa" if swa else "write"][:n],
                     e.attention_window(il), ranges, s)  # fmt: skip
            if loc.kind == PINNED:  # the buffer stays; the mirror catches up at the next switch
                return
            for t, cell, count in host_runs(st.cells.write):  # streamed: new rows to the host
                for stage, mirror in (("k_stage", e.mirror.k), ("v_stage", e.mirror.v)):
                    ws[stage][t : t + count].copy_to_host(
                        mirror[il][cell : cell + count].reshape(count, -1), stream=s
                    )
            return
        w = self._weights(part.group, slot, ws)
        getattr(dmath, part.kind)(ws, n, w, part.layer, s)
        if part.kind == "qkv" and program.predicts(tier.parts, tier.parts.index(part)):
            dmath.predict(ws, n, w, part.layer, s)
        if part.kind.startswith("ffn_down"):
            e.record_activation(st, f"blk.{part.layer}.out", ws["x"][:n], s)
        elif part.kind == "output" and self.capturing:
            dmath.head(ws, w, n - 1, 1, s)  # the logits are read after the replay
        elif part.kind == "output":
            self._logits(ws, w, dmath, s)

    def _logits(self, ws: dict, w: dict, dmath, s) -> None:
        e, st = self.e, self.st
        e.record_activation(st, "output_norm", ws["h"][: self.n], s)
        rows = ws["logits"].shape[0]
        chunks = [(t + i, c + i, min(rows, count - i)) for t, c, count in
                  host_runs(st.logit_rows) for i in range(0, count, rows)]  # fmt: skip
        st.logits = np.empty((st.logit_rows.size, e.spec.hparams.n_vocab), np.float32)
        for j, (first, row, count) in enumerate(chunks):
            # consecutive rows at once; staged, the last read after the end's wait
            dmath.head(ws, w, row, count, s)
            ws["logits"][:count].copy_to_host(self.stage["logits"][:count], stream=s)
            if j + 1 < len(chunks):
                e.sync(s)
                st.logits[first : first + count] = self.stage["logits"][:count]
        if chunks:  # (a prompt's ubatch before its last wants none)
            first, _, count = chunks[-1]
            e.pending_logits = st.logits[first : first + count]


def _segment_name(tier, seg: Segment) -> str:
    first, last = tier.parts[seg.first].name, tier.parts[seg.stop - 1].name
    return first if first == last else f"{first} .. {last}"


class _Timer:
    """Spans of a traced ubatch: device work timed by CUDA events on its stream (against one
    event recorded, and waited for, when the host clock is read), CPU parts by the host clock.
    Under the simulator, whose streams run as they are issued, the host clock times everything."""

    def __init__(self, engine):
        self.cuda, self.spans = engine.cuda, []
        if not simulated():
            self.base = engine.cuda.event()
            self.base.record(engine.devices[0].compute)
            engine.sync(self.base)
        self.host0 = time.perf_counter()

    def events(self) -> list[tuple[str, str, float, float]]:
        out = []
        for lane, name, a, b in self.spans:
            if isinstance(a, float):
                out.append((lane, name, a, b))
            else:
                at = (self.host0 + self.cuda.event_elapsed_time(self.base, x) / 1e3 for x in (a, b))
                out.append((lane, name, *at))
        return out


@contextmanager
def _span(timer: _Timer | None, lane: str, name: str, stream):
    if timer is None:
        yield
        return
    if stream is None or simulated():
        start = time.perf_counter()
        yield
        timer.spans.append((lane, name, start, time.perf_counter()))
        return
    a, b = timer.cuda.event(), timer.cuda.event()
    a.record(stream)
    yield
    b.record(stream)
    timer.spans.append((lane, name, a, b))
