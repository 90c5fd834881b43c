"""Schedules: the operations the executor issues for one tier, on named queues, ordered only by
the queue they are on and by events — and a validator that proves, without running anything,
that the ordering is enough.

A schedule is a list of operations in host issue order:
- `Copy(queue, tensor, slot, reads)`: the tensor's bytes into a ring slot (H2D of a streamed
  weight); a routed copy reads the router's choice (`reads`) to know which rows to copy;
- `Compute(queue, name, reads, writes)`: a kernel (or a CPU op, on the `HOST` queue) that reads
  tensors from slots and writes others into slots, each ((tensor, slot), ...) — the ring slots of
  streamed weights, and the activation hand-off between the compute and CPU queues;
- `Record(queue, event)`: the event completes when the queue's earlier work has;
- `Wait(queue, event)`: the queue's later work starts after the event's most recent record.

As on CUDA streams, two operations are ordered only if they are on one queue, or a chain of
record -> wait links one to the other (`happens_before`, computed with vector clocks). The
validator checks, for every read of a slot: the slot's latest write (a copy or a compute's, in
issue order, before the reading operation) is of that tensor and happens before the read, and
the slot's next write happens after it (a slot is reused only once its readers are done); that every tensor fits its slot and no two slots overlap; and
that no queue waits on an event never recorded.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from enum import Enum


class Lane(str, Enum):
    COMPUTE = "compute"  # a device's kernels
    COPY = "copy"  # a device's copies from pinned host memory
    HOST = "cpu"  # the host's own parts (one queue, whatever the devices)


HOST_DEVICE = -1


@dataclass(frozen=True)
class QueueId:
    lane: Lane
    device: int = 0

    def __str__(self) -> str:
        # the first device's are plain, so a one-device schedule names them as it always did
        return self.lane.value if self.device <= 0 else f"{self.lane.value}@{self.device}"

    @property
    def on_host(self) -> bool:
        return self.lane is Lane.HOST


HOST = QueueId(Lane.HOST, HOST_DEVICE)


class Signal(str, Enum):
    DONE = "done"  # a step's output is written (a hand-off to another queue)
    READ = "read"  # a unit's last reader is done: its slot may take the next unit
    LOADED = "loaded"  # a unit's copy landed
    ROUTED = "routed"  # a router's choice is written
    PREDICTED = "predicted"  # a router's predicted choice is written


@dataclass(frozen=True)
class EventId:
    signal: Signal
    of: str  # the step or unit it signals

    def __str__(self) -> str:
        return f"{self.signal.value}:{self.of}"


def compute_queue(device: int = 0) -> QueueId:
    return QueueId(Lane.COMPUTE, device)


def copy_queue(device: int = 0) -> QueueId:
    return QueueId(Lane.COPY, device)


class UnitKind(str, Enum):
    GROUP = "group"  # a weight group (key: its name)
    KV = "kv"  # a layer's KV (key: the layer)
    PREFETCH = "prefetch"  # a routed group's predicted experts, into its cache (key: the group)
    IDS = "ids"  # a router's choice (key: its step)
    PRED = "pred"  # a router's predicted choice (key: its step)
    ACT = "act"  # a step's output activations (key: the step)
    FIELD = "field"  # an activation field (key: its name), as its writer (a step) left it


@dataclass(frozen=True)
class Unit:
    """A tensor a slot holds: what a copy brings or a step writes."""

    kind: UnitKind
    key: str | int
    writer: str = ""  # a field's: the step that wrote this version of it

    def __str__(self) -> str:
        if self.kind is UnitKind.GROUP:
            return str(self.key)
        if self.kind is UnitKind.KV:
            return f"kv:{self.key}"
        if self.kind is UnitKind.PREFETCH:
            return f"{self.key}@prefetch"
        if self.kind is UnitKind.FIELD:
            return f"{self.key}@{self.writer}"
        return f"{self.kind.value}@{self.key}"


def group_unit(group: str) -> Unit:
    return Unit(UnitKind.GROUP, group)


def kv_unit(layer: int) -> Unit:
    return Unit(UnitKind.KV, layer)


class SlotKind(str, Enum):
    RING = "slot"  # a device's ring slot (key: its index)
    CACHE = "cache"  # a routed group's expert cache (key: the group)
    ACT = "act"  # an activation hand-off (key: the queue whose parts write it, if several)
    IDS = "ids"  # a router's choice (key: its step)
    PRED = "pred"  # a router's predicted choice (key: its step)
    FIELD = "field"  # an activation field where a place holds it (key: its name): a device's
    # workspace, or the host's (HOST_DEVICE) pinned rows; tracked, never allocated from the arena


@dataclass(frozen=True)
class SlotId:
    kind: SlotKind
    key: int | str | QueueId | None = None
    device: int = 0

    def __str__(self) -> str:
        if self.kind is SlotKind.FIELD:
            return f"{self.key}@{'host' if self.device == HOST_DEVICE else self.device}"
        if self.kind is SlotKind.RING and self.device:
            return f"slot@{self.device}:{self.key}"
        return self.kind.value if self.key is None else f"{self.kind.value}:{self.key}"


@dataclass(frozen=True)
class Slot:
    id: SlotId
    offset_bytes: int
    nbytes: int
    device: int = 0  # whose arena (several devices: each its own)


@dataclass(frozen=True)
class Copy:
    queue: QueueId
    tensor: Unit
    slot: SlotId
    reads: tuple[tuple[Unit, SlotId], ...] = ()
    cache: SlotId | None = None  # a routed copy's expert cache, which it writes too (the misses
    # it keeps)


@dataclass(frozen=True)
class Compute:
    queue: QueueId
    name: str
    reads: tuple[tuple[Unit, SlotId], ...] = ()
    writes: tuple[tuple[Unit, SlotId], ...] = ()


@dataclass(frozen=True)
class Record:
    queue: QueueId
    event: EventId


@dataclass(frozen=True)
class Wait:
    queue: QueueId
    event: EventId


Op = Copy | Compute | Record | Wait


def handed(op: Copy) -> bool:
    """Whether a copy hands an activation field between places (`handoffs`), rather than
    bringing weights or KV into the arena."""
    return getattr(op.tensor, "kind", None) is UnitKind.FIELD


def clocks(ops: list[Op]) -> tuple[list[dict[QueueId, int]], list[str]]:
    """Per operation, its vector clock (queue -> how many of that queue's operations happen
    before or at it), and the errors of waits on events not yet recorded."""
    queue_clock: dict[QueueId, dict[QueueId, int]] = {}
    recorded: dict[EventId, dict[QueueId, int]] = {}
    out, errors = [], []
    for i, op in enumerate(ops):
        clock = dict(queue_clock.get(op.queue, {}))
        clock[op.queue] = clock.get(op.queue, 0) + 1
        if isinstance(op, Wait):
            if op.event not in recorded:
                errors.append(f"op {i}: {op.queue} waits on {str(op.event)!r}, never recorded "
                              "before")  # fmt: skip
            else:
                for q, n in recorded[op.event].items():
                    clock[q] = max(clock.get(q, 0), n)
        elif isinstance(op, Record):
            recorded[op.event] = dict(clock)
        queue_clock[op.queue] = clock
        out.append(clock)
    return out, errors


def happens_before(ops: list[Op], vclocks: list[dict[QueueId, int]], a: int, b: int) -> bool:
    """Operation a completes before operation b starts."""
    return a != b and vclocks[b].get(ops[a].queue, 0) >= vclocks[a][ops[a].queue]


def validate(ops: list[Op], slots: dict[str, Slot], tensor_nbytes: dict[str, int]) -> list[str]:
    """Everything wrong with the schedule, one line each (empty: it is safe)."""
    errors = _layout_errors(ops, slots, tensor_nbytes)
    vclocks, wait_errors = clocks(ops)
    errors += wait_errors
    writers: dict[str, list[tuple[int, str]]] = {}  # slot -> (op index, tensor), issue order
    for i, op in enumerate(ops):
        if isinstance(op, Copy):
            writers.setdefault(op.slot, []).append((i, op.tensor))
            if op.cache:
                writers.setdefault(op.cache, []).append((i, op.tensor))
        elif isinstance(op, Compute):
            for tensor, slot in op.writes:
                writers.setdefault(slot, []).append((i, tensor))
    at = {slot: [w[0] for w in ws] for slot, ws in writers.items()}  # their ops' indices
    for i, op in enumerate(ops):
        if isinstance(op, (Compute, Copy)):
            errors += _read_errors(ops, vclocks, writers, at, i, op)
    return errors


def _read_errors(ops, vclocks, writers, at, i: int, op: Compute | Copy) -> list[str]:
    errors = []
    name = op.name if isinstance(op, Compute) else f"copy of {op.tensor}"
    for tensor, slot in op.reads:
        written, ats = writers.get(slot, []), at.get(slot, [])
        k = bisect_left(ats, i)  # the writes before op i: written[:k]
        if not k or written[k - 1][1] != tensor:
            errors.append(f"op {i} ({name}) reads {tensor} from {slot}, which does not hold it")
            continue
        if not happens_before(ops, vclocks, written[k - 1][0], i):
            errors.append(
                f"op {i} ({name}) reads {tensor} from {slot} before its write (op "
                f"{written[k - 1][0]}) is ordered to complete"
            )
        nxt = bisect_right(ats, i)  # the first write after op i
        if nxt < len(written) and not happens_before(ops, vclocks, i, written[nxt][0]):
            errors.append(
                f"op {written[nxt][0]} overwrites {slot} with {written[nxt][1]} before op {i} "
                f"({name}) is ordered to finish reading {tensor}"
            )
    return errors


def _layout_errors(ops, slots, tensor_nbytes) -> list[str]:
    errors = []
    ordered = sorted(slots.values(), key=lambda s: (s.device, s.offset_bytes))
    for a, b in zip(ordered, ordered[1:]):
        if a.device == b.device and a.offset_bytes + a.nbytes > b.offset_bytes:
            errors.append(f"slots {a.id} and {b.id} overlap")
    for i, op in enumerate(ops):
        if isinstance(op, Copy) and not handed(op):
            if op.cache and op.cache not in slots:
                errors.append(f"op {i}: copy into unknown cache {op.cache}")
            if op.slot not in slots:
                errors.append(f"op {i}: copy into unknown slot {op.slot}")
            elif tensor_nbytes[op.tensor] > slots[op.slot].nbytes:
                errors.append(
                    f"op {i}: {op.tensor} ({tensor_nbytes[op.tensor]} B) does not fit "
                    f"{op.slot} ({slots[op.slot].nbytes} B)"
                )
    return errors


@dataclass(frozen=True)
class Step:
    """One operation of the forward pass: its name, its queue (a device's compute queue, or the
    host's), the streamed units (weight groups, or a layer's KV) it reads from ring slots, the
    step whose router chooses which rows of them are copied (routed streaming), if any, whether
    they have an expert cache (`cache_of`), and the step whose prediction of that choice
    prefetches into it."""

    name: str
    queue: QueueId
    units: tuple[Unit, ...] = ()
    routed_by: str = ""
    cached: bool = False
    predicted_by: str = ""


# the activation hand-off: each step reads its predecessor's output, writes its own
ACT = SlotId(SlotKind.ACT)


def act_of(step: str) -> tuple[Unit, SlotId]:
    return Unit(UnitKind.ACT, step), ACT


def ids_of(step: str) -> tuple[Unit, SlotId]:
    """(tensor, slot) of the router's choice a step writes for the routed copies after it."""
    return Unit(UnitKind.IDS, step), SlotId(SlotKind.IDS, step)


def predicted_of(step: str) -> tuple[Unit, SlotId]:
    """(tensor, slot) of the router's predicted choice a step writes for the prefetches."""
    return Unit(UnitKind.PRED, step), SlotId(SlotKind.PRED, step)


def cache_of(group: str) -> SlotId:
    """The slot of a routed group's expert cache (its cache region)."""
    return SlotId(SlotKind.CACHE, group)


def prefetch_of(group: str) -> Unit:
    """The tensor a prefetch copy writes into a routed group's expert cache."""
    return Unit(UnitKind.PREFETCH, group)


def ring_slot(device: int, k: int) -> SlotId:
    return SlotId(SlotKind.RING, k, device)


def pipeline_schedule(steps: list[Step], n_slots: int) -> list[Op]:
    """The operations of one ubatch: the steps in order, each on its queue, reading the previous
    step's activations (slot `act`) and writing its own; a step on another queue than its
    predecessor waits for the predecessor's event (a hand-off: between the CPU and a device, or
    between two devices). Each device's streamed units are copied on its copy queue, in order of
    first use, the k-th into its ring slot k % n_slots, as far ahead as the ring allows: a copy
    waits for the event recorded after the last reader of the unit its slot held, a step for the
    copies of the units it is the first to read. A routed unit's copy also waits for the step
    whose router chose its rows (and the copies after it in the queue, with it)."""
    first, last = {}, {}
    for i, step in enumerate(steps):
        for u in step.units:
            first.setdefault(u, i)
            last[u] = i
    index = {step.name: i for i, step in enumerate(steps)}
    router = {u: index[s.routed_by] for s in steps if s.routed_by for u in s.units}
    cached = {u for s in steps if s.cached for u in s.units}
    predictor = {u: index[s.predicted_by] for s in steps if s.predicted_by for u in s.units}
    ordered = sorted(first, key=lambda u: (first[u], steps[first[u]].units.index(u)))
    rings: dict[int, list[Unit]] = {}  # device -> its units in copy order
    for u in ordered:
        rings.setdefault(steps[first[u]].queue.device, []).append(u)
    slot_of = {u: ring_slot(d, k % n_slots) for d, us in rings.items() for k, u in enumerate(us)}
    ops: list[Op] = []
    issued = dict.fromkeys(rings, 0)

    def issue_copies(done_through: int) -> None:
        # a copy goes once the last reader of its slot's previous unit has been issued, and a
        # routed one once its router has
        for d, units in rings.items():
            copy = copy_queue(d)
            while (
                (n := issued[d]) < len(units)
                and (n < n_slots or last[units[n - n_slots]] <= done_through)
                and router.get(units[n], -1) <= done_through
            ):
                u = units[n]
                if n >= n_slots:
                    ops.append(Wait(copy, EventId(Signal.READ, units[n - n_slots])))
                reads = ()
                if u in router:
                    by = steps[router[u]].name
                    ops.append(Wait(copy, EventId(Signal.ROUTED, by)))
                    reads = (ids_of(by),)
                cache = cache_of(u.key) if u in cached else None
                ops.append(Copy(copy, u, slot_of[u], reads, cache))
                ops.append(Record(copy, EventId(Signal.LOADED, u)))
                issued[d] += 1

    def prefetch(router_step: int) -> None:
        # the predicted experts into the caches once the router's step is issued (so a host
        # reading the prediction back waits while the device runs the layer's attention)
        for u in sorted((u for u, i in predictor.items() if router.get(u) == router_step), key=str):
            by, copy = steps[predictor[u]].name, copy_queue(steps[first[u]].queue.device)
            ops.append(Wait(copy, EventId(Signal.PREDICTED, by)))
            ops.append(Copy(copy, prefetch_of(u.key), cache_of(u.key), (predicted_of(by),)))

    issue_copies(-1)
    for i, step in enumerate(steps):
        if i and steps[i - 1].queue != step.queue:
            ops.append(Wait(step.queue, EventId(Signal.DONE, steps[i - 1].name)))
        for u in step.units:
            if first[u] == i:
                ops.append(Wait(step.queue, EventId(Signal.LOADED, u)))
        reads = tuple((u, slot_of[u]) for u in step.units)
        reads += tuple((u, cache_of(u.key)) for u in step.units if u in cached)
        if i:
            reads += (act_of(steps[i - 1].name),)
        routes, predicts = i in router.values(), i in predictor.values()
        writes = (act_of(step.name),) + ((ids_of(step.name),) if routes else ())
        writes += (predicted_of(step.name),) if predicts else ()
        ops.append(Compute(step.queue, step.name, reads, writes))
        if i + 1 < len(steps) and steps[i + 1].queue != step.queue:
            ops.append(Record(step.queue, EventId(Signal.DONE, step.name)))
        if predicts:
            ops.append(Record(step.queue, EventId(Signal.PREDICTED, step.name)))
        if routes:
            ops.append(Record(step.queue, EventId(Signal.ROUTED, step.name)))
            prefetch(i)
        finished = [u for u in step.units if last[u] == i]
        for u in finished:
            ops.append(Record(step.queue, EventId(Signal.READ, u)))
        if finished or routes:
            issue_copies(i)
    return drop_implied_waits(ops)


def drop_implied_waits(ops: list[Op]) -> list[Op]:
    """Without the waits whose event the queue is already ordered after (through an earlier wait
    on a later event of the same queue): each one left is needed."""
    queue_clock: dict[QueueId, dict[QueueId, int]] = {}
    recorded: dict[EventId, dict[QueueId, int]] = {}
    out = []
    for op in ops:
        clock = queue_clock.setdefault(op.queue, {})
        if isinstance(op, Wait) and op.event in recorded:
            seen = recorded[op.event]
            if all(clock.get(q, 0) >= n for q, n in seen.items()):
                continue
            for q, n in seen.items():
                clock[q] = max(clock.get(q, 0), n)
        clock[op.queue] = clock.get(op.queue, 0) + 1
        if isinstance(op, Record):
            recorded[op.event] = dict(clock)
        out.append(op)
    return out
