"""Schedules: the operations the executor issues for one tier, on named queues, ordered only by
the queue they are on and by events — and a validator that proves, without running anything,
that the ordering is enough.

A schedule is a list of operations in host issue order:
- `Copy(queue, tensor, slot)`: the tensor's bytes into a ring slot (H2D of a streamed weight);
- `Compute(queue, name, reads)`: a kernel (or a CPU op, on the "cpu" queue) that reads tensors
  from slots, `reads` = ((tensor, slot), ...);
- `Record(queue, event)`: the event completes when the queue's earlier work has;
- `Wait(queue, event)`: the queue's later work starts after the event's most recent record.

As on CUDA streams, two operations are ordered only if they are on one queue, or a chain of
record -> wait links one to the other (`happens_before`, computed with vector clocks). The
validator checks, for every read of a slot: the slot's latest copy (in issue order) is of that
tensor and happens before the read, and the slot's next copy happens after it (a slot is reused
only once its readers are done); that every tensor fits its slot and no two slots overlap; and
that no queue waits on an event never recorded.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Slot:
    name: str
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class Copy:
    queue: str
    tensor: str
    slot: str


@dataclass(frozen=True)
class Compute:
    queue: str
    name: str
    reads: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Record:
    queue: str
    event: str


@dataclass(frozen=True)
class Wait:
    queue: str
    event: str


Op = Copy | Compute | Record | Wait


def clocks(ops: list[Op]) -> tuple[list[dict[str, int]], list[str]]:
    """Per operation, its vector clock (queue -> how many of that queue's operations happen
    before or at it), and the errors of waits on events not yet recorded."""
    queue_clock: dict[str, dict[str, int]] = {}
    recorded: dict[str, dict[str, int]] = {}
    out, errors = [], []
    for i, op in enumerate(ops):
        clock = dict(queue_clock.get(op.queue, {}))
        clock[op.queue] = clock.get(op.queue, 0) + 1
        if isinstance(op, Wait):
            if op.event not in recorded:
                errors.append(f"op {i}: {op.queue} waits on {op.event!r}, never recorded before")
            else:
                for q, n in recorded[op.event].items():
                    clock[q] = max(clock.get(q, 0), n)
        elif isinstance(op, Record):
            recorded[op.event] = dict(clock)
        queue_clock[op.queue] = clock
        out.append(clock)
    return out, errors


def happens_before(ops: list[Op], vclocks: list[dict[str, int]], a: int, b: int) -> bool:
    """Operation a completes before operation b starts."""
    return a != b and vclocks[b].get(ops[a].queue, 0) >= vclocks[a][ops[a].queue]


def validate(ops: list[Op], slots: dict[str, Slot], tensor_nbytes: dict[str, int]) -> list[str]:
    """Everything wrong with the schedule, one line each (empty: it is safe)."""
    errors = _layout_errors(ops, slots, tensor_nbytes)
    vclocks, wait_errors = clocks(ops)
    errors += wait_errors
    copies: dict[str, list[int]] = {}  # slot -> indices of its copies, in issue order
    for i, op in enumerate(ops):
        if isinstance(op, Copy):
            copies.setdefault(op.slot, []).append(i)
    for i, op in enumerate(ops):
        if not isinstance(op, Compute):
            continue
        for tensor, slot in op.reads:
            before = [c for c in copies.get(slot, []) if c < i]
            after = [c for c in copies.get(slot, []) if c > i]
            if not before or ops[before[-1]].tensor != tensor:
                errors.append(
                    f"op {i} ({op.name}) reads {tensor} from {slot}, which does not hold it"
                )
                continue
            if not happens_before(ops, vclocks, before[-1], i):
                errors.append(
                    f"op {i} ({op.name}) reads {tensor} from {slot} before its copy (op "
                    f"{before[-1]}) is ordered to complete"
                )
            if after and not happens_before(ops, vclocks, i, after[0]):
                errors.append(
                    f"op {after[0]} overwrites {slot} with {ops[after[0]].tensor} before op {i} "
                    f"({op.name}) is ordered to finish reading {tensor}"
                )
    return errors


def _layout_errors(ops, slots, tensor_nbytes) -> list[str]:
    errors = []
    ordered = sorted(slots.values(), key=lambda s: s.offset_bytes)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset_bytes + a.nbytes > b.offset_bytes:
            errors.append(f"slots {a.name} and {b.name} overlap")
    for i, op in enumerate(ops):
        if isinstance(op, Copy):
            if op.slot not in slots:
                errors.append(f"op {i}: copy into unknown slot {op.slot}")
            elif tensor_nbytes[op.tensor] > slots[op.slot].nbytes:
                errors.append(
                    f"op {i}: {op.tensor} ({tensor_nbytes[op.tensor]} B) does not fit "
                    f"{op.slot} ({slots[op.slot].nbytes} B)"
                )
    return errors


def prefetch_schedule(layers: list[tuple[str, str | None]], n_slots: int) -> list[Op]:
    """The streamed-weights pipeline: layers [(compute name, streamed tensor or None)] run in order
    on the compute queue; the k-th streamed tensor is copied on the copy queue into slot
    k % n_slots, up to n_slots streamed tensors ahead. A copy waits for the event of the last
    compute that read its slot; a compute waits for its tensor's copy."""
    ops: list[Op] = []
    slot_of: dict[int, str] = {}
    last_reader: dict[str, str] = {}  # slot -> event recorded after its last reader
    streamed = [i for i, (_, tensor) in enumerate(layers) if tensor is not None]

    def issue_copy(k: int) -> None:
        i = streamed[k]
        slot = f"slot:{k % n_slots}"
        slot_of[i] = slot
        if slot in last_reader:
            ops.append(Wait("copy", last_reader[slot]))
        ops.append(Copy("copy", layers[i][1], slot))
        ops.append(Record("copy", f"loaded:{i}"))

    issued = 0
    for i, (name, tensor) in enumerate(layers):
        # every copy whose slot's previous reader is already issued goes now: up to n_slots
        # streamed tensors in flight ahead of the compute
        while issued < len(streamed) and (issued < n_slots or streamed[issued - n_slots] < i):
            issue_copy(issued)
            issued += 1
        if tensor is None:
            ops.append(Compute("compute", name))
            continue
        ops.append(Wait("compute", f"loaded:{i}"))
        ops.append(Compute("compute", name, ((tensor, slot_of[i]),)))
        ops.append(Record("compute", f"read:{i}"))
        last_reader[slot_of[i]] = f"read:{i}"
    return ops
