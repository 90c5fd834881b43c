"""The parts of a tensor-split ubatch (`tensor_program`) on one device's shares, in the exact
reference operations of the stand-in (each matrix share checked byte for byte against the file's
cut of it, as `HostMath` checks whole tensors).

Every device keeps its own copy of the residual (`Shard.x`). A device part begins by taking in the
host's sum of the previous parts' partial outputs (the embedding's rows for the first layer) as
the layer-split program does after a whole product: the bias added after a sum, the post-norm, the
residual add. It ends with its partial output, which the host sums: the attention's (its query
heads' columns of the output projection) and the FFN's (its hidden rows' columns of down); the
head gives its vocabulary rows, which the host gathers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refengine import reference as ref
from refengine.spec import ModelSpec
from solver.shares import Shares, cut_of

from .hostmath import HostMath
from .shards import cut_dense, cut_raw


@dataclass
class Shard:
    """One device's activations of a ubatch."""

    x: np.ndarray | None = None  # its copy of the residual [T, d]
    q: np.ndarray | None = None  # its query heads [T, h, D]
    k: np.ndarray | None = None  # its KV heads
    v: np.ndarray | None = None
    a: np.ndarray | None = None  # its heads' attention output [T, h, Dv]
    partial: np.ndarray | None = None  # what it adds to the host's sum (or its logits' rows)
    record: dict = field(default_factory=dict)


class ShardMath:
    def __init__(self, spec: ModelSpec, shares: Shares, math: HostMath):
        assert math.exact, "the shares run on the stand-in's reference operations"
        self.spec, self.shares, self.m = spec, shares, math
        self.hp, self.tr = spec.hparams, spec.arch

    def dense(self, w: dict, name: str, d: int) -> np.ndarray:
        """Device d's cut of a tensor, dense, once the bytes it was handed are checked to be the
        file's cut."""
        info, cut = self.spec.by_name[name], cut_of(self.spec, name, self.shares, d)
        want = np.ascontiguousarray(cut_raw(self.m.reference.raw(name), info, cut))
        if not np.array_equal(w[name].reshape(-1).view(np.uint8), want.reshape(-1)):
            raise ValueError(f"{name}: the bytes handed to device {d} are not its share")
        return cut_dense(self.m.reference.dense(name), cut)

    def mm(self, x: np.ndarray, w: dict, name: str, d: int) -> np.ndarray:
        """x times device d's cut of a matrix (and of its bias, cut with its rows)."""
        y = ref.matmul(x, self.dense(w, name, d))
        bias = name.replace(".weight", ".bias")
        if bias in w and cut_of(self.spec, bias, self.shares, d) is not None:
            y = y + w[bias]
        return y

    def take_in(self, sh: Shard, total: np.ndarray, w: dict, bias: str, post_norm: str,
                layer_out: str | None) -> None:  # fmt: skip
        """The host's sum of a product's partial outputs into the residual: its bias, its
        post-norm (gemma3), the residual add; the embedding's rows for the first layer."""
        if sh.x is None:
            sh.x = total.copy()
            return
        f = total + w[bias] if bias in w else total
        if self.tr.post_norms:
            f = self.m.norm(f, w, post_norm)
        sh.x = sh.x + f
        if layer_out:
            sh.record[layer_out] = sh.x

    def qkv(self, sh: Shard, w: dict, il: int, pos: np.ndarray, d: int) -> None:
        p, n, hp = f"blk.{il}.", sh.x.shape[0], self.hp
        h = self.m.norm(sh.x, w, p + "attn_norm.weight")
        q = self.mm(h, w, p + "attn_q.weight", d).reshape(n, -1, hp.head_dim)
        k = self.mm(h, w, p + "attn_k.weight", d).reshape(n, -1, hp.head_dim)
        v = self.mm(h, w, p + "attn_v.weight", d).reshape(n, -1, hp.head_dim_v)
        if self.tr.qk_norm:
            q = self.m.norm(q, w, p + "attn_q_norm.weight")
            k = self.m.norm(k, w, p + "attn_k_norm.weight")
        sh.q, sh.k, sh.v = self.m.rope(q, pos, il), self.m.rope(k, pos, il), v

    def head_map(self, d: int) -> np.ndarray:
        """Per query head of device d, the index of the KV head it reads among the device's."""
        lo, hi = self.shares.heads[d]
        group = self.hp.n_head // self.hp.n_head_kv
        return np.arange(lo, hi) // group - self.shares.kv_heads(self.spec, d)[0]

    def attention(self, q, q_pos, il: int, k, v, k_pos, window: int, d: int):
        """Device d's query heads q over its KV heads (k, v [S, h_kv, D], fp16): each head's
        keys and values laid out as its own (a KV head read by several is repeated)."""
        heads = self.head_map(d)
        return self.m.attention(q, q_pos, il, k[:, heads], v[:, heads], k_pos, window)

    def o(self, sh: Shard, w: dict, il: int, d: int) -> None:
        n = sh.x.shape[0]
        sh.partial = self.mm(sh.a.reshape(n, -1), w, f"blk.{il}.attn_output.weight", d)

    def ffn(self, sh: Shard, w: dict, il: int, d: int) -> None:
        p = f"blk.{il}."
        h = self.m.norm(sh.x, w, p + "ffn_norm.weight")
        gate = self.mm(h, w, p + "ffn_gate.weight", d)
        up = self.mm(h, w, p + "ffn_up.weight", d)
        sh.partial = self.mm(self.m.gated(gate, up), w, p + "ffn_down.weight", d)

    def moe_ffn(self, sh: Shard, w: dict, il: int, d: int) -> None:
        """The layer's router on the whole FFN input (each device routes the tokens itself),
        then each chosen expert's product on the device's rows of it, weighted and summed."""
        p = f"blk.{il}."
        h = self.m.norm(sh.x, w, p + "ffn_norm.weight")
        ids, gates = ref.moe_route(self.m.mm(h, w, p + "ffn_gate_inp.weight"),
                                   self.hp.n_expert_used, self.tr.expert_weights_norm)  # fmt: skip
        gate_w, up_w, down_w = (self.dense(w, p + f"ffn_{m}_exps.weight", d)
                                for m in ("gate", "up", "down"))  # fmt: skip
        sh.partial = np.zeros_like(sh.x)
        for e in np.unique(ids):  # the reference's order of summation
            rows, slot = np.nonzero(ids == e)
            act = self.m.gated(ref.matmul(h[rows], gate_w[e]), ref.matmul(h[rows], up_w[e]))
            sh.partial[rows] += gates[rows, slot][:, None] * ref.matmul(act, down_w[e])

    def head(self, sh: Shard, w: dict, rows, all_logits: bool, d: int) -> None:
        """Device d's rows of the logits of the wanted tokens."""
        x = self.m.norm(sh.x, w, "output_norm.weight")
        sh.record["output_norm"] = x
        x = x if all_logits else x[-1:] if rows is None else x[rows]
        name = "token_embd.weight" if self.spec.tied_output else "output.weight"
        sh.partial = self.mm(x, w, name, d)
