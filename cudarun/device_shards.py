"""A tensor split on the CUDA engine (llama.cpp #19378): each device (a virtual device of one GPU,
or a real one) holds its shares of every layer and of the head in its arena and runs its parts of a
ubatch (`tensor_program`) on its compute stream, with the kernels of `devicemath` over the shapes of
its shares (`shards.shard_spec`); the host sums the partial outputs in pinned memory.

A device part begins by taking in the host's latest sum (the embedding's rows for the first
layer): the sum goes up on the part's stream, then the bias added after a sum, the post-norm and
the residual add, on the device's own copy of the residual. It ends with its partial output (its
query heads' columns of the output projection; its hidden rows' of down) going down on the same
stream into a pinned buffer of the device's own, which an event marks. The host's sum waits for
each device's event (a counted sync) and adds the partials in device order, as the stand-in does
(`split_kernels`). One pinned sum serves every all-reduce: the host writes the next one only after
waiting for every device's next partial, which each stream orders after its upload of this one.
The head's vocabulary rows come down alike and are gathered into the logits. The ubatch ends at
the host's gather, every stream's work waited for; no CUDA graph is captured.
"""

from __future__ import annotations

import numpy as np

from solver import regions
from solver.groups import FFN_ORDER

from . import counts
from .devicemath import device_tensors
from .kernels import THREADS, glue
from .kvstore import host_runs
from .cuda_device import new_event
from .issue import issue
from .schedule import HOST, Compute, Copy, Record, Wait
from .shards import share_layout


class DeviceShards:
    """A tensor split's ubatches (`issue.Device`): each part a method of its kind."""

    def __init__(self, engine):
        self.e, self.shares = engine, engine.shares
        self.devices = self.shares.devices
        self.weight_views: dict[tuple, dict] = {}  # (tier, group, device) -> its tensors
        self.pending: dict[int, tuple[int, int]] = {}  # device -> its last logits chunk's rows
        self.events: dict = {}

    def execute(self, tier, st) -> None:
        e, n = self.e, st.tokens.size
        stage = e.staging(tier)
        self.tier, self.st = tier, st
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
        part = self.parts[op.name]
        getattr(self, part.kind)(self.tier, part, self.st, self.wss)

    # -- the host's parts ------------------------------------------------------------------------

    def embed(self, tier, part, st, wss) -> None:
        e = self.e
        e.cpu_math.run("embed", None, st, e.host.tensors("token_embd"))
        self.e.pinned_rows(tier, ("sum",), "f")[: st.tokens.size] = st.x
        st.logits = np.empty((st.logit_rows.size, e.spec.hparams.n_vocab), np.float32)

    def attn_sum(self, tier, part, st, wss) -> None:
        self._sum(tier, st.tokens.size, self.shares.heads)

    def ffn_sum(self, tier, part, st, wss) -> None:
        self._sum(tier, st.tokens.size, self._ffn_rows)

    def _sum(self, tier, n: int, ranges) -> None:
        """The partial outputs of the devices holding a share of the dimension, in device
        order (the others added nothing)."""
        total = self.e.pinned_rows(tier, ("sum",), "f")[:n]
        adding = [d for d in self.devices if ranges[d][1] > ranges[d][0]]
        np.copyto(total, self.e.pinned_rows(tier, ("partial", adding[0]), "f")[:n])
        for d in adding[1:]:
            total += self.e.pinned_rows(tier, ("partial", d), "f")[:n]

    def logits(self, tier, part, st, wss) -> None:
        for d, (first, count) in self.pending.items():
            lo, hi = self.shares.vocab[d]
            st.logits[first : first + count, lo:hi] = self._logit_rows(tier, d)[:count]
        self.pending = {}

    # -- each device's parts ---------------------------------------------------------------------

    def attn(self, tier, part, st, wss) -> None:
        e, d, il, n = self.e, part.device, part.layer, st.tokens.size
        ws, s, dm = wss[d], e.devices[d].compute, e.devices[d].math
        w = self._weights(tier, f"blk.{il}.attn", d)
        if il:
            self._take_in(tier, d, ws, n, st, self._weights(tier, f"blk.{il - 1}.{self._down}", d),
                          f"blk.{il - 1}.ffn_down.bias", f"blk.{il - 1}.post_ffw_norm.weight",
                          f"blk.{il - 1}.out", s)  # fmt: skip
        else:
            ws["x"][:n].copy_to_device(self.e.pinned_rows(tier, ("sum",), "f")[:n], stream=s)
            e.counter.uploads += 1
        if not _holds(self.shares.heads[d]):
            return
        dm.qkv(ws, n, w, il, s)
        cells, swa = tier.kv_cells[il], e.spec.is_swa(il)
        k, v = self._kv(tier, il, d, cells)
        dm.kq(ws, n, il, k, v, ws["k_pos_swa" if swa else "k_pos"][:cells],
              ws["write_swa" if swa else "write"][:n], e.attention_window(il),
              e.attention_ranges(st, il), s)  # fmt: skip
        o = f"blk.{il}.attn_output"
        dm.mm(ws["a"][:n].reshape(n, -1), _without(w, o + ".bias"), o + ".weight", ws["f"][:n],
              ws, s)  # fmt: skip
        self._down_partial(tier, d, ws, n, s)

    def ffn(self, tier, part, st, wss) -> None:
        e, d, il, n = self.e, part.device, part.layer, st.tokens.size
        ws, s, dm = wss[d], e.devices[d].compute, e.devices[d].math
        w_attn = self._weights(tier, f"blk.{il}.attn", d)  # its norms (and a MoE router)
        self._take_in(tier, d, ws, n, st, w_attn, f"blk.{il}.attn_output.bias",
                      f"blk.{il}.post_attention_norm.weight", None, s)  # fmt: skip
        if not _holds(self._ffn_rows[d]):
            return
        w = dict(w_attn)
        for kind in FFN_ORDER:
            if f"blk.{il}.{kind}" in e.groups:
                w.update(self._weights(tier, f"blk.{il}.{kind}", d))
        dm.ffn_input(ws, n, w, il, s)
        if e.spec.arch.moe:
            dm.ffn_gate_exps(ws, n, w, il, s)
            dm.ffn_up_exps(ws, n, w, il, s)
            dm.down_exps(ws, n, w, il, s)
        else:  # the up product gates in its epilogue (every layer is in glu_layers)
            dm.ffn_gate(ws, n, w, il, s)
            dm.ffn_up(ws, n, w, il, s)
            dm.down(ws, n, _without(w, f"blk.{il}.ffn_down.bias"), il, s)
        self._down_partial(tier, d, ws, n, s)

    def output(self, tier, part, st, wss) -> None:
        e, d, n = self.e, part.device, st.tokens.size
        ws, s, dm = wss[d], e.devices[d].compute, e.devices[d].math
        last = e.spec.hparams.n_layer - 1
        self._take_in(tier, d, ws, n, st, self._weights(tier, f"blk.{last}.{self._down}", d),
                      f"blk.{last}.ffn_down.bias", f"blk.{last}.post_ffw_norm.weight",
                      f"blk.{last}.out", s)  # fmt: skip
        w = self._weights(tier, "output", d)
        dm.output(ws, n, w, None, s)
        if d == self.devices[0]:
            e.record_activation(st, "output_norm", ws["h"][:n], s)
        if not _holds(self.shares.vocab[d]):
            return
        rows, staged = ws["logits"].shape[0], self._logit_rows(tier, d)
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

    def _take_in(self, tier, d: int, ws, n: int, st, w: dict, bias: str, post_norm: str,
                 layer_out: str | None, s) -> None:  # fmt: skip
        """The host's sum into device d's residual: its bias, its post-norm, the residual add."""
        e, f = self.e, ws["f"][:n]
        f.copy_to_device(self.e.pinned_rows(tier, ("sum",), "f")[:n], stream=s)
        e.counter.uploads += 1
        if bias in w:
            glue.add_bias[n, THREADS, s](f, w[bias])
        e.devices[d].math.residual(ws, n, f, w, post_norm if e.spec.arch.post_norms else None, s)
        if layer_out and d == self.devices[0]:
            e.record_activation(st, layer_out, ws["x"][:n], s)

    def _down_partial(self, tier, d: int, ws, n: int, s) -> None:
        ws["f"][:n].copy_to_host(self.e.pinned_rows(tier, ("partial", d), "f")[:n], stream=s)
        self.e.counter.downloads += 1

    def _logit_rows(self, tier, d: int):
        """Device d's logits' rows, down in pinned memory."""
        return self.e.pinned_rows(tier, ("logits", d), "logits", d)

    def _weights(self, tier, group: str, d: int) -> dict:
        key = (tier.tier, group, d)
        if key not in self.weight_views:
            e = self.e
            region = e.region(tier, regions.weights(group, d))
            self.weight_views[key] = device_tensors(
                share_layout(e.spec, e.groups[group], self.shares, d), region
            )
        return self.weight_views[key]

    def _kv(self, tier, il: int, d: int, cells: int):
        buf = self.e.region(tier, regions.kv(il, d))
        return self.e.mirror.views(buf, cells, self.shares.kv_heads(self.e.spec, d))

    @property
    def _ffn_rows(self):
        """Each device's FFN rows: each expert's under a MoE model."""
        return self.shares.ff_exp if self.e.spec.arch.moe else self.shares.ff

    @property
    def _down(self) -> str:
        """The group holding the FFN's post-norm and the bias added after its sum."""
        return "ffn_down_exps" if self.e.spec.arch.moe else "ffn_down"


def _holds(share: tuple[int, int]) -> bool:
    return share[1] > share[0]


def _without(w: dict, name: str) -> dict:
    """A device's tensors less a bias: added once, after the sum, not to each partial."""
    return {k: v for k, v in w.items() if k != name}
