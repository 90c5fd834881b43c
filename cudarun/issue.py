"""The one loop that issues a schedule (`schedule.Op`s, in host issue order) onto a `Device`.

A `Device` is what ggml-backend calls a backend, at the grain of our schedules: it records and
waits for events on its queues, copies units into its slots, and runs parts. Each engine issues
every mode through `issue`: the stand-in device (`standin.StandInDevice`, every queue a worker
thread), and on a GPU one ubatch of the layer split or of one device (`cuda_ubatch.CudaUbatch`,
over the engine's `cuda_device.CudaDevice`s) or of the tensor split (`device_shards`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from .schedule import Compute, Copy, Op, Record, Wait


class Device(Protocol):
    def record(self, op: Record) -> None:
        """The event completes when the queue's work issued so far has."""

    def wait(self, op: Wait) -> None:
        """The queue's later work starts after the event's most recent record."""

    def copy(self, op: Copy) -> None:
        """A unit's bytes (weights, KV, an activation field) into a slot, on the op's queue."""

    def compute(self, op: Compute) -> None:
        """A part, on the op's queue."""


def issue(ops: Iterable[Op], device: Device) -> None:
    for op in ops:
        if isinstance(op, Record):
            device.record(op)
        elif isinstance(op, Wait):
            device.wait(op)
        elif isinstance(op, Copy):
            device.copy(op)
        else:
            device.compute(op)
