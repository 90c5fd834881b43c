"""A stand-in device for running schedules without a GPU: host memory as device memory, and one
worker thread per queue, so copy and compute queues really run asynchronously.

- A copy's data lands only when it completes, after a seeded random delay; until then the slot
  holds 0xFF bytes, NaN in fp16 and fp32 (its old contents are gone the moment the copy starts).
- A compute reads its slots at the start and again after its own random delay: a copy landing
  in between is seen.
- Work on one queue waits for another only through events: a `Wait` blocks its worker until the
  most recent `Record` of that event issued before it has executed.
- The stand-in tracks every slot write and read with vector clocks carried by the events, so a
  read that is not ordered after its copy, or a copy not ordered after the slot's last readers,
  is reported even when the timing happened to work out (`violations`).

It executes `schedule` operations (`issue.Device`); a `Compute` may carry a kernel (`kernels[name]`) that receives
the slots' byte arrays by name. A slot without memory (the activation hand-off, whose data the
kernels keep themselves) is tracked all the same.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .issue import issue
from .schedule import Compute, Copy, Op, Record, Slot, SlotId, SlotKind, Unit, Wait


@dataclass
class _Recorded:
    done: threading.Event = field(default_factory=threading.Event)
    clock: dict[str, int] = field(default_factory=dict)


@dataclass
class _SlotState:
    tensor: str | None = None
    landed: bool = False
    written_at: tuple[str, int] | None = None  # (queue, sequence) of the copy
    nbytes: int = 0  # what the write left there
    readers: list[tuple[str, int]] = field(default_factory=list)


POISON = 0xFF


class StandInDevice:
    def __init__(self, slots: dict[SlotId, Slot], host, seed: int, memory=None,
                 copy_delay_s=(0.0005, 0.003), compute_delay_s=(0.0002, 0.001)):  # fmt: skip
        # tensor name -> its bytes (uint8), as pinned host memory: a dict, or a function
        self.host = host if callable(host) else lambda name: host[name].view(np.uint8)
        # slot name -> its device bytes (views into an arena, or allocated here); an expert cache
        # (written in place by its copies' host side, never poisoned) is tracked only
        self.memory = memory or {
            s.id: np.empty(s.nbytes, np.uint8)
            for s in slots.values()
            if s.id.kind is not SlotKind.CACHE
        }
        for m in self.memory.values():
            m[:] = POISON
        self.state: dict[SlotId, _SlotState] = {}
        self.rng = random.Random(seed)
        self.copy_delay_s, self.compute_delay_s = copy_delay_s, compute_delay_s
        self.violations: list[str] = []
        self.trace: list[tuple[str, str, float, float]] = []  # (queue, op, start s, end s)
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue] = {}
        self._workers: dict[str, threading.Thread] = {}
        self._clocks: dict[str, dict[str, int]] = {}
        self._latest: dict[str, _Recorded] = {}
        self.kernels: dict = {}  # part -> its kernel (`execute`)

    # -- issuing (the host side) ------------------------------------------------------------

    def execute(self, ops: list[Op], kernels: dict | None = None) -> list[str]:
        """Issue every operation in order, wait for all queues, return the violations."""
        self.kernels = kernels or {}
        issue(ops, self)
        self.synchronize()
        return self.violations

    def record(self, op: Record) -> None:
        rec = _Recorded()
        self._latest[op.event] = rec  # later waits see this record, earlier ones do not
        self._queue(op.queue).put((op, rec, None))

    def wait(self, op: Wait) -> None:
        # never recorded: CUDA waits on nothing
        self._queue(op.queue).put((op, self._latest.get(op.event), None))

    def copy(self, op: Copy) -> None:
        self._queue(op.queue).put((op, self.rng.uniform(*self.copy_delay_s), None))

    def compute(self, op: Compute) -> None:
        delay = self.rng.uniform(*self.compute_delay_s)
        self._queue(op.queue).put((op, delay, self.kernels.get(op.name)))

    def synchronize(self) -> None:
        for q in self._queues.values():
            q.join()

    def close(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for w in self._workers.values():
            w.join()

    def _queue(self, name: str) -> queue.Queue:
        if name not in self._queues:
            self._queues[name] = queue.Queue()
            self._clocks[name] = {}
            worker = threading.Thread(target=self._run, args=(name,), daemon=True)
            self._workers[name] = worker
            worker.start()
        return self._queues[name]

    # -- executing (the device side) --------------------------------------------------------

    def _run(self, name: str) -> None:
        q = self._queues[name]
        while (item := q.get()) is not None:
            op, arg, kernel = item
            clock = self._clocks[name]
            clock[name] = clock.get(name, 0) + 1
            if isinstance(op, Record):
                arg.clock = dict(clock)
                arg.done.set()
            elif isinstance(op, Wait) and arg is not None:
                arg.done.wait()
                for k, v in arg.clock.items():
                    clock[k] = max(clock.get(k, 0), v)
            elif isinstance(op, (Copy, Compute)):
                start = time.perf_counter()
                try:
                    if isinstance(op, Copy):
                        self._copy(op, arg, name, clock)
                    else:
                        self._compute(op, arg, kernel, name, clock)
                except Exception as e:  # reported; a dead worker would hang `synchronize`
                    with self._lock:
                        self._violate(f"{op} raised {e!r}")
                label = f"copy {op.tensor}" if isinstance(op, Copy) else op.name
                self.trace.append((str(name), label, start, time.perf_counter()))
            q.task_done()
        q.task_done()

    def _ordered(self, clock: dict[str, int], at: tuple[str, int]) -> bool:
        return clock.get(at[0], 0) >= at[1]

    def _begin_write(self, slot_name: SlotId, tensor: Unit, what: str, clock: dict[str, int]):
        slot = self.state.setdefault(slot_name, _SlotState())
        for reader in slot.readers:
            if not self._ordered(clock, reader):
                self._violate(f"{what} overwrites {slot.tensor} in {slot_name} before its read "
                              f"on {reader[0]} is ordered to finish")  # fmt: skip
        slot.tensor, slot.landed, slot.readers = tensor, False, []
        if slot_name in self.memory:
            self.memory[slot_name][:] = POISON  # the old contents are gone
        return slot

    def _copy(self, op: Copy, delay: float, name: str, clock: dict[str, int]) -> None:
        for tensor, slot in op.reads:  # a routed copy's choice of rows
            self._read(f"copy of {op.tensor}", tensor, slot, name, clock)
        with self._lock:
            slots = [self._begin_write(s, op.tensor, f"copy of {op.tensor}", clock)
                     for s in (op.slot, op.cache) if s]  # fmt: skip
        time.sleep(delay)
        data = self.host(op.tensor)  # once: a routed copy's host side places its experts
        with self._lock:
            for slot_name, slot in zip((op.slot, op.cache), slots):
                if slot.tensor == op.tensor:
                    if slot_name == op.slot and op.slot in self.memory:
                        self.memory[op.slot][: data.size] = data
                        slot.nbytes = data.size
                    slot.landed, slot.written_at = True, (name, clock[name])

    def _compute(self, op: Compute, delay: float, kernel, name: str, clock: dict[str, int]) -> None:
        seen = [self._read(op.name, tensor, slot, name, clock) for tensor, slot in op.reads]
        with self._lock:
            written = [self._begin_write(s, t, op.name, clock) for t, s in op.writes]
        time.sleep(delay)
        for (tensor, slot), before in zip(op.reads, seen):
            if slot in self.memory and before is not None:
                if not np.array_equal(before, self.memory[slot]):
                    self._violate(f"{op.name}: {slot} changed while it read {tensor}")
        if kernel is not None and all(s is not None for s in seen):
            try:
                kernel({slot: self.memory[slot] for _, slot in op.reads if slot in self.memory})
            except Exception as e:  # a kernel fed the wrong data: reported, the queue goes on
                with self._lock:
                    self._violate(f"{op.name} raised {e!r}")
        with self._lock:
            for slot in written:
                slot.landed, slot.written_at = True, (name, clock[name])

    def _read(self, label: str, tensor: Unit, slot_name: SlotId, name: str,
              clock: dict[str, int]):
        slot = self.state.setdefault(slot_name, _SlotState())
        with self._lock:
            if slot.tensor != tensor or not slot.landed:
                self._violate(f"{label} read {slot_name} holding {slot.tensor} "
                              f"({'landed' if slot.landed else 'in flight'}), wanted {tensor}")  # fmt: skip
                return None
            if not self._ordered(clock, slot.written_at):
                self._violate(f"{label} read {tensor} in {slot_name}, not ordered after its write")
            slot.readers.append((name, clock[name]))
            if slot_name not in self.memory:
                return True
            view = self.memory[slot_name]
            if slot.nbytes and (view[: slot.nbytes] == POISON).all():
                self._violate(f"{label} read poison from {slot_name}")
            return view.copy()

    def _violate(self, what: str) -> None:
        self.violations.append(what)
