"""A tensor split on the CUDA engine (llama.cpp #19378): each device (a virtual device of one GPU,
or a real one) holds its shares of every layer and of the head in its arena and runs its parts of a
ubatch (`split_parts`, whose `SplitForward` sequences each part over this class's math) on its
compute stream, with the kernels of `devicemath` over the shapes of its shares
(`shards.shard_spec`); the host sums the partial outputs in pinned memory.

A device part begins by taking in the host's latest sum (the embedding's rows for the first
layer): the sum goes up on the part's stream, then the bias added after a sum, the post-norm and
the residual add, on the device's own copy of the residual. It ends with its partial output (its
query heads' columns of the output projection; its hidden rows' of down) going down on the same
stream into a pinned buffer of the device's own, which an event marks. The host's sum waits for
each device's event (a counted sync) and adds the partials in device order, as the stand-in does.
One pinned sum serves every all-reduce: the host writes the next one only after waiting for every
device's next partial, which each stream orders after its upload of this one. The head's
vocabulary rows come down alike and are gathered into the logits. The ubatch ends at the host's
gather, every stream's work waited for; no CUDA graph is captured.
"""

from __future__ import annotations

import numpy as np

from solver import regions

from . import counts
from .cuda_device import new_event
from .devicemath import device_tensors
from .issue import issue
from .kernels import THREADS, glue
from .kvstore import host_runs
from .schedule import HOST, Compute, Copy, Record, Wait
from .shards import share_layout
from .split_parts import SplitForward


class DeviceShards:
    """A tensor split's ubatches: the schedule issued onto it (`issue.Device`), each part's body
    run by `SplitForward` over its math."""

    def __init__(self, engine):
        self.e, self.shares = engine, engine.shares
        self.devices = self.shares.devices
        self.forward = SplitForward(engine.spec, self.shares, engine.groups, self)
        self.weight_views: dict[tuple, dict] = {}  # (tier, group, device) -> its tensors
        self.pending: dict[int, tuple[int, int]] = {}  # device -> its last logits chunk's rows
        self.events: dict = {}

    def execute(self, tier, st) -> None:
        e, n = self.e, st.tokens.size
        stage = e.staging(tier)
        self.tier, self.st, self.n = tier, st, n
        self.wss = {d: e.workspace(tier, d) for d in self.devices}
        self.parts, self.events = {p.name: p for p in tier.parts}, {}
        e.counter = counter = counts.Counter()
        with counts.counting(counter):
            for d in self.devices:
                e._upload_inputs(tier, st, self.wss[d], stage, d)
            issue(tier.schedule, self)
        e.counter = None
        e.tally.add(tier.tier, n, False, counter.counts())

    def record(self, op: Record) -> None:
        if op.queue != HOST:  # the host's sums are done when it issues the next op
            self.events[op.event] = ev = new_event(self.e.cuda)
            ev.record(self.e.devices[op.queue.device].stream(op.queue.lane))

    def wait(self, op: Wait) -> None:
        if op.queue == HOST:  # a partial output (or logits' rows) is down
            self.e.sync(self.events[op.event])

    def copy(self, op: Copy) -> None:
        raise AssertionError(f"a tensor split copies nothing: {op}")

    def compute(self, op: Compute) -> None:
        self.forward.run(self.parts[op.name])

    # -- the host's math ---------------------------------------------------------------------------

    def embed(self) -> None:
        e, st = self.e, self.st
        e.cpu_math.run("embed", None, st, e.host.tensors("token_embd"))
        self._sum_rows()[...] = st.x
        st.logits = np.empty((st.logit_rows.size, e.spec.hparams.n_vocab), np.float32)

    def sum(self, adding: list[int]) -> None:
        total = self._sum_rows()
        np.copyto(total, self._partial_rows(adding[0]))
        for d in adding[1:]:
            total += self._partial_rows(d)

    def gather(self) -> None:
        for d, (first, count) in self.pending.items():
            lo, hi = self.shares.vocab[d]
            self.st.logits[first : first + count, lo:hi] = self._logit_rows(d)[:count]
        self.pending = {}

    # -- each device's math ------------------------------------------------------------------------

    def weights(self, group: str, d: int) -> dict:
        key = (self.tier.tier, group, d)
        if key not in self.weight_views:
            e = self.e
            region = e.region(self.tier, regions.weights(group, d))
            self.weight_views[key] = device_tensors(
                share_layout(e.spec, e.groups[group], self.shares, d), region
            )
        return self.weight_views[key]

    def start(self, d: int) -> None:
        """The embedding's rows into device d's residual."""
        x = self.wss[d]["x"][: self.n]
        x.copy_to_device(self._sum_rows(), stream=self.e.devices[d].compute)
        self.e.counter.uploads += 1

    def take_in(self, d: int, w: dict, bias: str, post_norm: str, layer_out: str | None = None):
        """The host's sum into device d's residual: its bias, its post-norm, the residual add."""
        e, n, ws, s = self.e, self.n, self.wss[d], self.e.devices[d].compute
        f = ws["f"][:n]
        f.copy_to_device(self._sum_rows(), stream=s)
        e.counter.uploads += 1
        if bias in w:
            glue.add_bias[n, THREADS, s](f, w[bias])
        e.devices[d].math.residual(ws, n, f, w, post_norm if e.spec.arch.post_norms else None, s)
        if layer_out and d == self.devices[0]:
            e.record_activation(self.st, layer_out, ws["x"][:n], s)

    def qkv(self, d: int, w: dict, il: int) -> None:
        dev = self.e.devices[d]
        dev.math.qkv(self.wss[d], self.n, w, il, dev.compute)

    def kq(self, d: int, il: int) -> None:
        e, n, ws, dev = self.e, self.n, self.wss[d], self.e.devices[d]
        cells, swa = self.tier.kv_cells[il], e.spec.is_swa(il)
        buf = e.region(self.tier, regions.kv(il, d))
        k, v = e.mirror.views(buf, cells, self.shares.kv_heads(e.spec, d))
        dev.math.kq(ws, n, il, k, v, ws["k_pos_swa" if swa else "k_pos"][:cells],
                    ws["write_swa" if swa else "write"][:n], e.attention_window(il),
                    e.attention_ranges(self.st, il), dev.compute)  # fmt: skip

    def o(self, d: int, w: dict, il: int) -> None:
        n, ws, dev = self.n, self.wss[d], self.e.devices[d]
        dev.math.mm(ws["a"][:n].reshape(n, -1), w, f"blk.{il}.attn_output.weight", ws["f"][:n],
                    ws, dev.compute)  # fmt: skip
        self._down_partial(d)

    def ffn(self, d: int, w: dict, il: int) -> None:
        n, ws, dev = self.n, self.wss[d], self.e.devices[d]
        dm, s = dev.math, dev.compute
        dm.ffn_input(ws, n, w, il, s)
        if self.e.spec.arch.moe:
            dm.ffn_gate_exps(ws, n, w, il, s)
            dm.ffn_up_exps(ws, n, w, il, s)
            dm.down_exps(ws, n, w, il, s)
        else:  # the up product gates in its epilogue (every layer is in glu_layers)
            dm.ffn_gate(ws, n, w, il, s)
            dm.ffn_up(ws, n, w, il, s)
            dm.down(ws, n, w, il, s)
        self._down_partial(d)

    def head(self, d: int, w: dict) -> None:
        e, n, st, ws, dev = self.e, self.n, self.st, self.wss[d], self.e.devices[d]
        dm, s = dev.math, dev.compute
        dm.output(ws, n, w, None, s)
        if d == self.devices[0]:
            e.record_activation(st, "output_norm", ws["h"][:n], s)
        if self.shares.vocab[d][1] <= self.shares.vocab[d][0]:
            return
        rows, staged = ws["logits"].shape[0], self._logit_rows(d)
        lo, hi = self.shares.vocab[d]
        chunks = [(t + i, c + i, min(rows, count - i)) for t, c, count in host_runs(st.logit_rows)
                  for i in range(0, count, rows)]  # fmt: skip
        for j, (first, row, count) in enumerate(chunks):
            dm.head(ws, w, row, count, s)
            ws["logits"][:count].copy_to_host(staged[:count], stream=s)
            if j + 1 < len(chunks):  # the staging rows are needed again: read them now
                e.sync(s)
                st.logits[first : first + count, lo:hi] = staged[:count]
        if chunks:  # (a prompt's ubatch before its last wants none)
            self.pending[d] = chunks[-1][0], chunks[-1][2]
            e.counter.downloads += 1

    # -- between a device and the host -----------------------------------------------------------

    def _down_partial(self, d: int) -> None:
        self.wss[d]["f"][: self.n].copy_to_host(self._partial_rows(d),
                                                stream=self.e.devices[d].compute)  # fmt: skip
        self.e.counter.downloads += 1

    def _sum_rows(self):
        return self.e.pinned_rows(self.tier, ("sum",), "f")[: self.n]

    def _partial_rows(self, d: int):
        return self.e.pinned_rows(self.tier, ("partial", d), "f")[: self.n]

    def _logit_rows(self, d: int):
        """Device d's logits' rows, down in pinned memory."""
        return self.e.pinned_rows(self.tier, ("logits", d), "logits", d)
