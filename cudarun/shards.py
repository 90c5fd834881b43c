"""A device's share of a weight group under a tensor split (`solver.shares`): its layout (the
group's tensors in their order, each cut to the device's rows or columns) and its bytes, cut from
the file's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from refengine.quants import qtype
from refengine.spec import ModelSpec, TensorInfo
from solver.groups import Group
from solver.shares import Cut, Shares, cut_nbytes, cut_of, cut_shape

from .hostweights import Placed, group_layout


def cut_raw(raw: np.ndarray, info: TensorInfo, cut: Cut | None) -> np.ndarray:
    """The cut of a tensor's raw bytes ([..., row bytes], as `GGUFWeights.raw` gives them)."""
    if cut is None:
        return raw
    if cut.axis < len(info.shape) - 1:
        return raw[(slice(None),) * cut.axis + (slice(cut.lo, cut.hi),)]
    q = qtype(info.qtype)  # the contiguous axis: whole blocks of each row
    return raw[..., q.row_nbytes(cut.lo) : q.row_nbytes(cut.hi)]


def cut_dense(dense: np.ndarray, cut: Cut | None) -> np.ndarray:
    if cut is None:
        return dense
    return dense[(slice(None),) * cut.axis + (slice(cut.lo, cut.hi),)]


def share_layout(spec: ModelSpec, group: Group, shares: Shares, d: int) -> list[Placed]:
    out, offset = [], 0
    for p in group_layout(spec, group):
        cut = cut_of(spec, p.info.name, shares, d)
        info = replace(p.info, shape=cut_shape(p.info, cut), nbytes=cut_nbytes(p.info, cut))
        out.append(Placed(info, offset))
        offset += info.nbytes
    return out


def share_bytes(spec: ModelSpec, group: Group, shares: Shares, d: int, raw_of) -> np.ndarray:
    """Device d's bytes of a group in its share layout; `raw_of(name)`: the tensor's raw bytes."""
    layout = share_layout(spec, group, shares, d)
    out = np.empty(sum(p.info.nbytes for p in layout), np.uint8)
    for p in layout:
        full = spec.by_name[p.info.name]
        piece = cut_raw(raw_of(full.name), full, cut_of(spec, full.name, shares, d))
        out[p.offset : p.offset + p.info.nbytes] = np.ascontiguousarray(piece).reshape(-1)
    return out


def shard_spec(spec: ModelSpec, shares: Shares, d: int) -> ModelSpec:
    """The model as device d's kernels see it: each tensor cut to its share, and as many query
    heads, KV heads (at least one, so the workspace's layout stays defined), hidden rows and
    vocabulary rows as it holds."""
    tensors = []
    for t in spec.tensors:
        cut = cut_of(spec, t.name, shares, d)
        tensors.append(replace(t, shape=cut_shape(t, cut), nbytes=cut_nbytes(t, cut)))
    span = lambda r: r[1] - r[0]  # noqa: E731
    hp = replace(spec.hparams, n_head=span(shares.heads[d]),
                 n_head_kv=max(span(shares.kv_heads(spec, d)), 1), n_ff=span(shares.ff[d]),
                 n_ff_exp=span(shares.ff_exp[d]), n_vocab=span(shares.vocab[d]))  # fmt: skip
    return replace(spec, hparams=hp, tensors=tuple(tensors))


class CutReference:
    """Device d's cut of the file's tensors, as `GGUFWeights` gives whole ones (`raw`, `dense`):
    what the reference operations over its shard spec check its shares against."""

    def __init__(self, reference, spec: ModelSpec, shares: Shares, d: int):
        self.reference, self.spec, self.shares, self.d = reference, spec, shares, d

    def raw(self, name: str) -> np.ndarray:
        info = self.spec.by_name[name]
        return np.ascontiguousarray(cut_raw(self.reference.raw(name), info, self._cut(name)))

    def dense(self, name: str) -> np.ndarray:
        return cut_dense(self.reference.dense(name), self._cut(name))

    def _cut(self, name: str) -> Cut | None:
        return cut_of(self.spec, name, self.shares, self.d)
