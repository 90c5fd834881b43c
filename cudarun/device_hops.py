"""A layer split on the CUDA engine: several devices, each with its arena, workspace, compute and
copy streams (virtual devices of one GPU, or real ones), the activations handed between them
through pinned host memory.

Where a single device hands activations only to and from the host at the CPU segments' edges
(`segments.py`), several devices also hand them to each other, so each ubatch tracks where every
activation field (`segments.FIELDS`: x, h, q, k, v, a, gate, up, ids, gates) is current: on which
devices, and on the host. Before a part runs, each field it reads that its place does not hold
is brought there — from the host by an upload on the part's stream; from another device by a
download on that device's compute stream into a pinned buffer of its own, an event, and an upload
on the part's stream after it (a hop through the host) — and a CPU segment downloads what it reads
and waits for it. A part's writes make its place the field's only holder. The schedule's events
between the devices' streams are issued as they are, so the copies and the parts stay ordered as
the validator proved them; the hops add their own events. The ubatch ends with every stream
synchronized; no CUDA graph is captured.
"""

from __future__ import annotations

import numpy as np


from . import counts
from .hostmath import Act
from .schedule import Compute, Copy, Record, SlotKind, UnitKind, Wait, compute_queue, handed
from .segments import fields

HOST = "host"


class DeviceHops:
    def __init__(self, engine):
        self.e = engine

    def execute(self, tier, st: Act) -> None:
        e, n = self.e, st.tokens.size
        stage = e.staging(tier)
        host = st.for_host()  # the CPU segments' activations
        devices = sorted({p.queue.device for p in tier.parts if not p.queue.on_host})
        wss = {d: e.workspace(tier, d) for d in devices}
        glu = _glu_layers(tier.parts)
        for d in devices:
            e.dmaths[d].glu_layers = glu
        e.counter = counter = counts.Counter()
        with counts.counting(counter):
            for d in devices:
                e._upload_inputs(tier, st, wss[d], stage, d)
            self._issue(tier, st, wss, stage, host)
            for stream in e.queues.values():
                e._sync(stream)
        if e.pending_logits is not None:
            e.pending_logits[:] = stage["logits"][: e.pending_logits.shape[0]]
            e.pending_logits = None
        e.counter = None
        e.tally.add(tier.tier, n, False, counter.counts())

    def _issue(self, tier, st: Act, wss: dict, stage: dict, host: Act) -> None:
        e, moe = self.e, self.e.spec.arch.moe
        events: dict[str, object] = {}
        routed: dict = {}  # (router part, prefetch) -> (admission, ids)
        placed: set = set()  # (router part, device): the experts' places are in its workspace
        index = {p.name: i for i, p in enumerate(tier.parts)}
        starts = {seg.first: seg for seg in tier.segments}
        recorded_on = {op.event: op.queue for op in tier.schedule if isinstance(op, Record)}
        holders: dict[str, set] = {}
        for op in tier.schedule:
            if isinstance(op, Record):
                if not op.queue.on_host:  # the host's work is done when it issues the next op
                    events[op.event] = ev = e._event()
                    ev.record(e.queues[op.queue])
            elif isinstance(op, Wait):
                if not op.queue.on_host and not recorded_on[op.event].on_host:
                    events[op.event].wait(e.queues[op.queue])
            elif isinstance(op, Copy) and not handed(op):  # (`_bring` hands fields over)
                copy, d = e.queues[op.queue], op.queue.device
                if op.reads:  # routed or prefetched: the router's choice (or guess) first
                    by = op.reads[0][0].key  # the router's step
                    prefetch = op.tensor.kind is UnitKind.PREFETCH
                    part = tier.parts[index[by]]
                    if (by, prefetch) not in routed:
                        ws = wss.get(part.queue.device) if not part.queue.on_host else None
                        routed[by, prefetch] = e._route(tier, part, events, st, host, ws,
                                                        prefetch)  # fmt: skip
                    admission, ids = routed[by, prefetch]
                    if not prefetch and (by, d) not in placed:  # each device's expert products
                        e._place_experts(tier, part.layer, admission, ids, wss[d], copy)
                        placed.add((by, d))
                    e._copy_routed(tier, op.tensor.key, op.slot, admission, prefetch, copy)
                else:
                    e._copy_unit(tier, op.tensor, op.slot, copy)
            elif isinstance(op, Compute):
                i = index[op.name]
                part = tier.parts[i]
                if part.queue.on_host:
                    if i in starts:  # the segment's other parts run with it
                        self._segment(tier, starts[i], st, host, wss, holders)
                    continue
                d = part.queue.device
                reads, writes = fields(part.kind, moe)
                for f in reads:
                    if d not in holders.get(f, ()):
                        self._bring(tier, f, d, host, wss, holders, st.tokens.size)
                slot = next((s for _, s in op.reads if s.kind is SlotKind.RING), None)
                e._device_part(tier, part, st, wss[d], stage, slot)
                holders.update({f: {d} for f in writes})

    def _segment(self, tier, seg, st: Act, host: Act, wss: dict, holders: dict) -> None:
        """A CPU segment: what its parts read before writing it, down from where it is current
        (a wait each device), its parts on the host, the host the holder of what they wrote."""
        e, moe = self.e, self.e.spec.arch.moe
        e.counter.segments += 1
        reads, written = [], set()
        for p in tier.parts[seg.first : seg.stop]:
            r, w = fields(p.kind, moe)
            reads += [f for f in r if f not in written and f not in reads]
            written |= set(w)
        self._bring_host(tier, reads, host, wss, holders, st)
        e.runner.run(seg, tier.parts, host, e.requested)
        holders.update({f: {HOST} for f in written})
        if tier.parts[seg.stop - 1].kind == "output":
            st.logits = host.logits

    def _bring_host(self, tier, names, host: Act, wss: dict, holders: dict, st: Act) -> None:
        """The fields a CPU segment reads, down from the devices that hold them: every copy
        issued, then one wait per source stream, then the reads (a field read before its own
        copy landed would be stale on a GPU, though the simulator copies at once)."""
        e, n, down, streams = self.e, st.tokens.size, [], {}
        for f in names:
            if HOST in holders.get(f, {HOST}):  # current on the host (or never written)
                continue
            src, rows = min(holders[f]), e._row_count(f, n)
            buf = e.pinned_rows(tier, ("down", f), f)
            streams[src] = e.queues[compute_queue(src)]
            wss[src][f][:rows].copy_to_host(buf[:rows], stream=streams[src])
            down.append((f, buf))
        for stream in streams.values():
            e._sync(stream)
        for f, buf in down:
            setattr(host, f, e._host_value(f, {f: buf}, n).copy())
            holders[f].add(HOST)
        e.counter.downloads += bool(streams)

    def _bring(self, tier, f: str, d: int, host: Act, wss: dict, holders: dict, n: int) -> None:
        """Field f onto device d: from the host, or from another device through the host."""
        e = self.e
        if f not in holders:  # never written this ubatch
            return
        to, count = e.queues[compute_queue(d)], e._row_count(f, n)
        dst = wss[d][f][:count]
        if HOST in holders[f]:
            rows = e.pinned_rows(tier, ("up", f, d), f)[:count]
            rows[...] = np.reshape(getattr(host, f), rows.shape)
            dst.copy_to_device(rows, stream=to)
            e.counter.uploads += 1
        else:
            src = min(holders[f])
            frm = e.queues[compute_queue(src)]
            rows = e.pinned_rows(tier, ("hop", f, src, d), f)[:count]
            wss[src][f][:count].copy_to_host(rows, stream=frm)
            ev = e._event()
            ev.record(frm)
            ev.wait(to)
            dst.copy_to_device(rows, stream=to)
        holders[f].add(d)


def _glu_layers(parts) -> frozenset[int]:
    """The layers whose gate, up and down products all run on one device: there the up product's
    epilogue gates (`DeviceMath.ffn_up`), and its output never crosses a device."""
    where = {(p.layer, p.kind): p.queue for p in parts}
    return frozenset(
        il for (il, kind), q in where.items()
        if kind == "ffn_gate" and not q.on_host and where.get((il, "ffn_up")) == q
        and where.get((il, "ffn_down")) == q
    )  # fmt: skip
