"""Hand-offs: every activation field a step reads, brought to the place the step runs on by a
`Copy` of the schedule, so that `schedule.validate` proves each hand-off as it proves a weight's
copy (docs/runtime.md, Several devices).

A field (`segments.FIELDS`: x, h, q, k, v, a, gate, up, ids, gates) is written by one step and read
by later ones. Where a reader runs on another place than every holder of the field's current
version (a device, or the host), the field is handed over:
- device -> host: a copy down on the holder's compute queue, issued before the last `done` record
  of that queue, which the reader's chain of waits already orders it after;
- host -> device: a copy up on the reader's compute queue, right before the reader (after its
  wait for the host's step);
- device -> device: down on the holder's queue (as above), then up on the reader's.
Each step reads and writes its fields in its place's slots (`SlotKind.FIELD`, tracked, never in
the arena), so a reader of a field never brought, a hand-off issued before its write, and the
host's rows of a field overwritten before a copy up has read them are each an error of `validate`,
without the coarse chain of whole activations (`schedule.ACT`) the steps also read and write.
Places depend only on the plan, never on the data: the pass runs once, when a tier is prepared.
"""

from __future__ import annotations

from dataclasses import replace

from .schedule import (
    HOST_DEVICE, Compute, Copy, Op, Record, Signal, SlotId, SlotKind, Unit, UnitKind,
    compute_queue,
)
from .segments import fields


def field_slot(field: str, place: int) -> SlotId:
    return SlotId(SlotKind.FIELD, field, place)


def handoffs(ops: list[Op], kinds: dict[str, str], moe: bool) -> list[Op]:
    """`ops` (a tier's `pipeline_schedule`) with each step reading and writing its fields at its
    place, the fields handed over from their holders first. `kinds`: step -> its part's kind."""
    holders: dict[str, tuple[Unit, set[int]]] = {}  # field -> (its version, places holding it)
    out: list[Op] = []
    for op in ops:
        if not isinstance(op, Compute) or op.name not in kinds:
            out.append(op)
            continue
        place = op.queue.device
        reads, writes = fields(kinds[op.name], moe)
        for f in reads:
            if f in holders and place not in holders[f][1]:
                _bring(out, f, *holders[f], place)
        read = tuple((holders[f][0], field_slot(f, place)) for f in reads if f in holders)
        wrote = tuple((Unit(UnitKind.FIELD, f, op.name), field_slot(f, place)) for f in writes)
        out.append(replace(op, reads=op.reads + read, writes=op.writes + wrote))
        holders.update((f, (u, {place})) for f, (u, _) in zip(writes, wrote))
    return out


def _bring(out: list[Op], f: str, version: Unit, held: set[int], place: int) -> None:
    host = field_slot(f, HOST_DEVICE)
    if HOST_DEVICE not in held:  # down from a device that holds it, before its last hand-off
        src = compute_queue(min(held))
        at = next(i for i in range(len(out) - 1, -1, -1) if isinstance(out[i], Record)
                  and out[i].queue == src and out[i].event.signal is Signal.DONE)  # fmt: skip
        out.insert(at, Copy(src, version, host, ((version, field_slot(f, src.device)),)))
        held.add(HOST_DEVICE)
    if place != HOST_DEVICE:
        out.append(Copy(compute_queue(place), version, field_slot(f, place), ((version, host),)))
    held.add(place)
