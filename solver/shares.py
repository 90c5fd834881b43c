"""Shares of a tensor split in our runtime (llama.cpp #19378): which part of each matrix, of each
layer's KV and of the head a device holds, by the plan's (possibly uneven) ratios.

Three dimensions are cut, each into contiguous ranges, one a device:
- `heads`: the query heads, whole KV groups of them. A device holds their rows of Q, the rows of K
  and V of the KV heads they read, their KV cells, and their columns of the output projection (a
  model with one KV head, as Gemma-3-270M, is cut by query heads: each device holds the KV head);
- `ff`: the FFN's hidden rows: rows of gate and up, columns of down;
- `ff_exp`: each expert's hidden rows, alike (a MoE layer's router is held whole by each device,
  which routes its tokens itself);
- `vocab`: the head's rows (its logits are gathered).
A column cut of a quantized matrix falls on whole blocks: the ranges are multiples of a unit (the
least common multiple of the blocks of the column-cut matrices of every layer). Norms and the
biases added after a sum are held whole by every device; the embedding stays on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from refengine.quants import qtype
from refengine.spec import ModelSpec, TensorInfo

HEADS, FF, FF_EXP, VOCAB = "heads", "ff", "ff_exp", "vocab"
DIMS = (HEADS, FF, FF_EXP, VOCAB)

# the tensor's base name -> (dimension, axis it cuts; the last is the contiguous one, cut on
# whole quantized blocks)
_CUTS = {
    "attn_q.weight": (HEADS, 0),
    "attn_q.bias": (HEADS, 0),
    "attn_k.weight": ("kv", 0),
    "attn_k.bias": ("kv", 0),
    "attn_v.weight": ("kv", 0),
    "attn_v.bias": ("kv", 0),
    "attn_output.weight": (HEADS, 1),
    "ffn_gate.weight": (FF, 0),
    "ffn_gate.bias": (FF, 0),
    "ffn_up.weight": (FF, 0),
    "ffn_up.bias": (FF, 0),
    "ffn_down.weight": (FF, 1),
    "ffn_gate_exps.weight": (FF_EXP, 1),
    "ffn_up_exps.weight": (FF_EXP, 1),
    "ffn_down_exps.weight": (FF_EXP, 2),
    "output.weight": (VOCAB, 0),
    "token_embd.weight": (VOCAB, 0),  # as the tied head (the embedding itself is on the CPU)
}


@dataclass(frozen=True)
class Cut:
    axis: int  # of the tensor's shape; the last is its contiguous one
    lo: int  # elements of that axis
    hi: int


@dataclass(frozen=True)
class Shares:
    """Per dimension, each device's range [lo, hi) in its elements (heads, hidden rows, vocab
    rows); a device with every range empty takes no part."""

    heads: tuple[tuple[int, int], ...]
    ff: tuple[tuple[int, int], ...]
    ff_exp: tuple[tuple[int, int], ...]
    vocab: tuple[tuple[int, int], ...]

    @property
    def n_devices(self) -> int:
        return len(self.heads)

    def takes_part(self, d: int) -> bool:
        return any(hi > lo for dim in DIMS for lo, hi in (getattr(self, dim)[d],))

    @property
    def devices(self) -> list[int]:
        return [d for d in range(self.n_devices) if self.takes_part(d)]

    def kv_heads(self, spec: ModelSpec, d: int) -> tuple[int, int]:
        """The KV heads device d's query heads read."""
        lo, hi = self.heads[d]
        if hi <= lo:
            return 0, 0
        group = spec.hparams.n_head // spec.hparams.n_head_kv
        return lo // group, -(-hi // group)

    def kv_owner(self, spec: ModelSpec, head: int) -> int:
        """The device that writes KV head `head` into the host's copy (the first that holds it)."""
        return next(d for d in self.devices if self.kv_heads(spec, d)[0] <= head
                    < self.kv_heads(spec, d)[1])  # fmt: skip

    def fraction(self, dim: str, d: int) -> float:
        ranges = getattr(self, dim)
        total = ranges[-1][1] - ranges[0][0]
        lo, hi = ranges[d]
        return (hi - lo) / total if total else 0.0

    def to_json(self) -> dict:
        return {dim: [list(r) for r in getattr(self, dim)] for dim in DIMS}

    @classmethod
    def from_json(cls, d: dict) -> "Shares":
        return cls(*(tuple(tuple(r) for r in d[dim]) for dim in DIMS))


def _base(name: str) -> str:
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def units(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Per dimension (count of units, elements per unit): a cut between units falls on whole
    blocks of every column-cut matrix. Raises ValueError when the model cannot be cut so."""
    hp = spec.hparams
    blocks = {HEADS: [hp.head_dim_v], FF: [1], FF_EXP: [1]}
    hidden = {FF: hp.n_ff if not hp.n_expert else 0, FF_EXP: hp.n_ff_exp}
    for t in spec.tensors:
        dim, axis = _CUTS.get(_base(t.name), (None, 0))
        if dim in blocks and axis == len(t.shape) - 1 and len(t.shape) > 1:
            blocks[dim].append(qtype(t.qtype).block_elems)
        if dim in hidden and t.shape[axis] != hidden[dim]:
            raise ValueError(f"{t.name} has {t.shape[axis]} hidden rows, not the model's "
                             f"{hidden[dim]}")  # fmt: skip
    # a KV head's query heads stay together (on one device, so its KV is held once), but for a
    # single KV head, which each device then holds
    group = hp.n_head // hp.n_head_kv if hp.n_head_kv > 1 else 1
    per_head = math.lcm(math.lcm(*blocks[HEADS]) // hp.head_dim_v, group)
    out = {HEADS: (hp.n_head // per_head, per_head)}
    for dim, rows in hidden.items():
        per = math.lcm(*blocks[dim])
        if rows % per:
            raise ValueError("its hidden rows do not fall on whole quantized blocks")
        out[dim] = (rows // per, per)
    if hp.n_head % per_head:
        raise ValueError("its heads do not fall on whole quantized blocks")
    vocab = spec.by_name.get("output.weight", spec.by_name["token_embd.weight"]).shape[0]
    return out | {VOCAB: (vocab, 1)}


def shares_for(spec: ModelSpec, ratios: list[float]) -> Shares:
    """Each dimension cut by the ratios, whole units, boundaries rounded from the running sum."""
    total = sum(ratios)
    out = []
    for dim in DIMS:
        n, per = units(spec)[dim]
        bounds, run = [0], 0.0
        for r in ratios:
            run += r
            bounds.append(round(run / total * n))
        out.append(tuple((a * per, b * per) for a, b in zip(bounds, bounds[1:])))
    return Shares(*out)


def is_cut(name: str) -> bool:
    """Whether a tensor is cut among the devices (else each holds it whole)."""
    return _base(name) in _CUTS


def cut_of(spec: ModelSpec, name: str, shares: Shares, d: int) -> Cut | None:
    """Device d's cut of a tensor; None: held whole."""
    dim, axis = _CUTS.get(_base(name), (None, 0))
    if dim is None:
        return None
    hp = spec.hparams
    if dim == "kv":
        lo, hi = shares.kv_heads(spec, d)
        per = hp.head_dim if "attn_k" in name else hp.head_dim_v
        return Cut(axis, lo * per, hi * per)
    lo, hi = getattr(shares, dim)[d]
    if dim == HEADS:
        per = hp.head_dim if axis == 0 else hp.head_dim_v
        return Cut(axis, lo * per, hi * per)
    return Cut(axis, lo, hi)


def cut_shape(t: TensorInfo, cut: Cut | None) -> tuple[int, ...]:
    if cut is None:
        return t.shape
    shape = list(t.shape)
    shape[cut.axis] = cut.hi - cut.lo
    return tuple(shape)


def cut_nbytes(t: TensorInfo, cut: Cut | None) -> int:
    if cut is None:
        return t.nbytes
    if cut.axis < len(t.shape) - 1:
        return t.nbytes // t.shape[cut.axis] * (cut.hi - cut.lo)
    q = qtype(t.qtype)
    return math.prod(t.shape[:-1]) * (q.row_nbytes(cut.hi) - q.row_nbytes(cut.lo))


def group_share_nbytes(spec: ModelSpec, tensors: tuple[str, ...], shares: Shares, d: int) -> int:
    """Bytes device d holds of a group (nothing when it takes no part)."""
    if not shares.takes_part(d):
        return 0
    return sum(cut_nbytes(spec.by_name[n], cut_of(spec, n, shares, d)) for n in tensors)


def kv_share_cell_nbytes(spec: ModelSpec, shares: Shares, d: int, kv_type: str = "f16") -> int:
    """Bytes one cached token of one layer takes on device d (its KV heads)."""
    hp, q = spec.hparams, qtype(kv_type.upper())
    lo, hi = shares.kv_heads(spec, d)
    return q.row_nbytes(hp.head_dim * (hi - lo)) + q.row_nbytes(hp.head_dim_v * (hi - lo))
