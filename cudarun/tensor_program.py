"""The forward pass of one ubatch under a tensor split (llama.cpp #19378), as parts on every
device's compute queue and the host's, and its schedule.

In order: `embed` (the host: the token rows); per layer, `blk.i.attn@d` on each device that takes
part (the residual's update by the previous sum, the attention norm, its query heads' Q, its KV
heads' K and V into its KV share, the attention, its columns of the output projection), the host's
`blk.i.attn_sum` (the first all-reduce: the partial outputs summed in pinned host memory, then read
by every device), `blk.i.ffn@d` (the sum taken in, the FFN norm, its rows of gate and up, its
columns of down) and `blk.i.ffn_sum` (the second); then `output@d` (its vocabulary rows of the
logits) and the host's `logits`, which gathers them.

The schedule hands each part's output to the queues that read it through events only: a part
waits for the parts it reads on other queues, and a part read elsewhere records its event. The
validator (`schedule.validate`) proves each read ordered after its write and before the next
write of the same queue's hand-off slot, so removing any wait is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

from solver.shares import Shares

from .schedule import (
    HOST, Compute, EventId, Op, QueueId, Record, Signal, SlotId, SlotKind, Unit, UnitKind, Wait,
    compute_queue, drop_implied_waits,
)

SUMS = ("attn_sum", "ffn_sum")  # the all-reduces


@dataclass(frozen=True)
class SplitPart:
    name: str  # "blk.3.attn@1", "blk.3.attn_sum"
    kind: str  # "embed", "attn", "attn_sum", "ffn", "ffn_sum", "output", "logits"
    layer: int | None
    device: int | None  # None: the host
    queue: QueueId
    after: tuple[str, ...]  # the parts on other queues whose outputs it reads


def parts(n_layer: int, shares: Shares) -> list[SplitPart]:
    devices = shares.devices
    out = [SplitPart("embed", "embed", None, None, HOST, ())]
    fan_in = ("embed",)  # what the next device parts read
    for il in range(n_layer):
        for kind in ("attn", "ffn"):
            names = tuple(f"blk.{il}.{kind}@{d}" for d in devices)
            out += [SplitPart(n, kind, il, d, compute_queue(d), fan_in)
                    for n, d in zip(names, devices)]  # fmt: skip
            out.append(SplitPart(f"blk.{il}.{kind}_sum", f"{kind}_sum", il, None, HOST, names))
            fan_in = (f"blk.{il}.{kind}_sum",)
    names = tuple(f"output@{d}" for d in devices)
    out += [SplitPart(n, "output", None, d, compute_queue(d), fan_in)
            for n, d in zip(names, devices)]  # fmt: skip
    out.append(SplitPart("logits", "logits", None, None, HOST, names))
    return out


def hand_off(queue: QueueId) -> SlotId:
    """The slot a queue's parts hand their output over in (tracked, without memory)."""
    return SlotId(SlotKind.ACT, queue)


def schedule(split_parts: list[SplitPart]) -> list[Op]:
    queue = {p.name: p.queue for p in split_parts}
    read_elsewhere = {a for p in split_parts for a in p.after if queue[a] != p.queue}
    ops: list[Op] = []
    for p in split_parts:
        ops += [Wait(p.queue, EventId(Signal.DONE, a)) for a in p.after if queue[a] != p.queue]
        reads = tuple((Unit(UnitKind.ACT, a), hand_off(queue[a])) for a in p.after)
        writes = ((Unit(UnitKind.ACT, p.name), hand_off(p.queue)),)
        ops.append(Compute(p.queue, p.name, reads, writes))
        if p.name in read_elsewhere:
            ops.append(Record(p.queue, EventId(Signal.DONE, p.name)))
    return drop_implied_waits(ops)
