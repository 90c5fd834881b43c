"""The forward pass of one ubatch under a tensor split (llama.cpp #19378): its parts on every
device's compute queue and the host's, their schedule, and each part's body, written once over a
math adapter: the CUDA engine's (`device_shards.DeviceShards`: devicemath's kernels over each
device's shares, the sums in pinned host memory) and the stand-in's (`HostShards` below: the
reference operations over each device's `shards.shard_spec`, every share checked byte for byte
against the file's cut, as gpt-fast's tensor parallelism cuts the weights and keeps the forward
pass).

In order: `embed` (the host: the token rows); per layer, `blk.i.attn@d` on each device that takes
part (the residual's update by the previous sum, the attention norm, its query heads' Q, its KV
heads' K and V into its KV share, the attention, its columns of the output projection), the host's
`blk.i.attn_sum` (the first all-reduce: the partial outputs summed on the host, then read by every
device), `blk.i.ffn@d` (the sum taken in, the FFN norm, its rows of gate and up, its columns of
down) and `blk.i.ffn_sum` (the second); then `output@d` (its vocabulary rows of the logits) and the
host's `logits`, which gathers them. Every device keeps its own copy of the residual; a device part
takes in the host's latest sum as the layer-split program does after a whole product (the bias
added after a sum, the post-norm, the residual add), and a device without a share of a part's
dimension adds nothing to its sum.

The schedule hands each part's output to the queues that read it through events only: a part
waits for the parts it reads on other queues, and a part read elsewhere records its event. The
validator (`schedule.validate`) proves each read ordered after its write and before the next
write of the same queue's hand-off slot, so removing any wait is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver import regions
from solver.groups import FFN_ORDER
from solver.shares import Shares

from .hostmath import Act, HostMath
from .hostweights import tensors_of
from .kernels import cpu_ops
from .schedule import (
    HOST, Compute, EventId, Op, QueueId, Record, Signal, SlotId, SlotKind, Unit, UnitKind, Wait,
    compute_queue, drop_implied_waits,
)
from .shards import CutReference, shard_spec, share_layout

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


class SplitForward:
    """Each part's body over `math`: what it takes in from the host's sum, which weights it
    reads, and what it adds to the next sum."""

    def __init__(self, spec, shares: Shares, groups, math):
        self.spec, self.shares, self.groups, self.m = spec, shares, groups, math
        moe = spec.arch.moe
        self.down = "ffn_down_exps" if moe else "ffn_down"  # holds the FFN's post-norm
        self.ffn_rows = shares.ff_exp if moe else shares.ff  # each expert's, under a MoE model

    def run(self, part: SplitPart) -> None:
        getattr(self, part.kind)(part)

    def embed(self, part) -> None:
        self.m.embed()

    def attn_sum(self, part) -> None:
        self.m.sum(self._adding(self.shares.heads))

    def ffn_sum(self, part) -> None:
        self.m.sum(self._adding(self.ffn_rows))

    def logits(self, part) -> None:
        self.m.gather()

    def attn(self, part) -> None:
        m, d, il = self.m, part.device, part.layer
        if il:
            self._after_layer(d, il - 1)
        else:
            m.start(d)
        if not _holds(self.shares.heads[d]):
            return
        w = m.weights(f"blk.{il}.attn", d)
        m.qkv(d, w, il)
        m.kq(d, il)
        m.o(d, _without(w, f"blk.{il}.attn_output.bias"), il)

    def ffn(self, part) -> None:
        m, d, il = self.m, part.device, part.layer
        w = dict(m.weights(f"blk.{il}.attn", d))  # its norms (and a MoE layer's router)
        m.take_in(d, w, f"blk.{il}.attn_output.bias", f"blk.{il}.post_attention_norm.weight")
        if not _holds(self.ffn_rows[d]):
            return
        for kind in FFN_ORDER:
            if f"blk.{il}.{kind}" in self.groups:
                w.update(m.weights(f"blk.{il}.{kind}", d))
        m.ffn(d, _without(w, f"blk.{il}.ffn_down.bias"), il)

    def output(self, part) -> None:
        d = part.device
        self._after_layer(d, self.spec.hparams.n_layer - 1)
        self.m.head(d, self.m.weights("output", d))

    def _after_layer(self, d: int, il: int) -> None:
        """The host's sum of layer il's FFN into device d's residual."""
        self.m.take_in(d, self.m.weights(f"blk.{il}.{self.down}", d), f"blk.{il}.ffn_down.bias",
                       f"blk.{il}.post_ffw_norm.weight", f"blk.{il}.out")  # fmt: skip

    def _adding(self, ranges) -> list[int]:
        """The devices holding a share of a dimension, in device order (the others add
        nothing)."""
        return [d for d in self.shares.devices if _holds(ranges[d])]


class HostShards:
    """The stand-in's math of a tensor-split ubatch `st`: each device its own activations (an
    `Act`) and the reference operations over its shard spec (`HostMath`, exact), the host's sum
    in `st.total`."""

    def __init__(self, engine, tier, st: Act):
        spec, shares = engine.spec, engine.shares
        self.e, self.tier, self.st = engine, tier, st
        self.maths = engine.shard_maths
        self.acts = {d: _act_like(st) for d in shares.devices}
        self.partials: dict[int, np.ndarray] = {}
        self.post_norms = spec.arch.post_norms

    def weights(self, group: str, d: int) -> dict:
        e = self.e
        region = e.region(self.tier, regions.weights(group, d))
        return tensors_of(share_layout(e.spec, e.groups[group], e.shares, d), region)

    def embed(self) -> None:
        e = self.e
        e.math["cpu"].run("embed", None, self.st, e.host.tensors("token_embd"))
        self.st.total = self.st.x

    def sum(self, adding: list[int]) -> None:
        total = self.partials[adding[0]].copy()
        for d in adding[1:]:
            total += self.partials[d]
        self.st.total = total

    def gather(self) -> None:
        acts = [self.acts[d] for d in self.e.shares.devices]
        self.st.logits = np.concatenate([a.logits for a in acts], axis=1)
        self.st.record.update(acts[0].record)

    def start(self, d: int) -> None:
        self.acts[d].x = self.st.total.copy()

    def take_in(self, d: int, w: dict, bias: str, post_norm: str, layer_out: str | None = None):
        act = self.acts[d]
        f = self.st.total + w[bias] if bias in w else self.st.total
        if self.post_norms:
            f = self.maths[d].norm(f, w, post_norm)
        act.x = act.x + f
        if layer_out:
            act.record[layer_out] = act.x

    def qkv(self, d: int, w: dict, il: int) -> None:
        self.maths[d].qkv(self.acts[d], w, il)

    def kq(self, d: int, il: int) -> None:
        """Device d's KV heads of the ubatch into its KV share (and the heads it owns into the
        host's copy, written through), then its query heads' attention over them."""
        e, act, st = self.e, self.acts[d], self.st
        spec, shares, mirror = e.spec, e.shares, e.mirror
        lo, hi = shares.kv_heads(spec, d)
        k16, v16 = act.k.astype(np.float16), act.v.astype(np.float16)
        for h in range(lo, hi):
            if shares.kv_owner(spec, h) == d:
                mirror.k[il][st.cells.write, h] = k16[:, h - lo]
                mirror.v[il][st.cells.write, h] = v16[:, h - lo]
        buf = e.region(self.tier, regions.kv(il, d))
        k, v = mirror.views(buf, self.tier.kv_cells[il], (lo, hi))
        dc = st.device
        write, keys = (dc.write_swa, dc.keys_swa) if spec.is_swa(il) else (dc.write, dc.keys)
        k[write], v[write] = k16, v16
        act.a = np.empty((*act.q.shape[:2], v.shape[2]), np.float32)
        m, window = self.maths[d], e.attention_window(il)
        for t0, t1, c0, c1 in e.attention_ranges(st, il):
            act.a[t0:t1] = m.attention(act.q[t0:t1], dc.q_keys[t0:t1], il, k[c0:c1], v[c0:c1],
                                       keys[c0:c1], window)  # fmt: skip

    def o(self, d: int, w: dict, il: int) -> None:
        act = self.acts[d]
        a = act.a.reshape(act.a.shape[0], -1)
        self.partials[d] = self.maths[d].mm(a, w, f"blk.{il}.attn_output.weight")

    def ffn(self, d: int, w: dict, il: int) -> None:
        """Its rows of the FFN (a MoE layer's router on the whole input: each device routes the
        tokens itself)."""
        m, act, p = self.maths[d], self.acts[d], f"blk.{il}."
        act.h = m.norm(act.x, w, p + "ffn_norm.weight")
        if self.e.spec.arch.moe:
            logits = m.mm(act.h, w, p + "ffn_gate_inp.weight")
            act.ids, act.gates = cpu_ops.route(logits, m.hp.n_expert_used,
                                               m.tr.expert_weights_norm)  # fmt: skip
            m.ffn_gate_exps(act, w, il)
            m.ffn_up_exps(act, w, il)
            self.partials[d] = m.down_exps(act, w, il)
        else:
            m.ffn_gate(act, w, il)
            m.ffn_up(act, w, il)
            self.partials[d] = m.down(act, w, il)

    def head(self, d: int, w: dict) -> None:
        self.maths[d].output(self.acts[d], w, None)


def shard_maths(spec, shares: Shares, reference) -> dict[int, HostMath]:
    """Each device's reference operations over its shard spec, checked against the file's cut
    of `reference` (a GGUFWeights)."""
    return {d: HostMath(shard_spec(spec, shares, d), exact=True,
                        reference=CutReference(reference, spec, shares, d))
            for d in shares.devices}  # fmt: skip


def _act_like(st: Act) -> Act:
    act = Act(st.tokens, st.pos, st.all_logits)
    act.logit_rows = st.logit_rows
    return act


def _holds(share: tuple[int, int]) -> bool:
    return share[1] > share[0]


def _without(w: dict, name: str) -> dict:
    """A device's tensors less a bias: added once, after the sum, not to each partial."""
    return {k: v for k, v in w.items() if k != name}
