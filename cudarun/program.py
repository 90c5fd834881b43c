"""The forward pass of one ubatch as parts, each run where the plan puts what it reads.

A part reads one weight group (or, for the attention core, one layer's KV) and runs on the queue
of its location: a device's compute queue when the group is pinned or streamed there, the host's
when it is on the CPU. The parts, in order:
- `embed` (group token_embd): the token rows, scaled for gemma3;
- per layer: `qkv` (group blk.i.attn): the attention norm, Q/K/V with biases, Q/K norms, RoPE;
  `kq` (the layer's KV): K and V stored at their positions, the attention over the cache — it runs
  where the KV lives (docs/contracts.md); `o` (group blk.i.attn): the output projection, the
  post-norm, the residual add, the FFN norm and, for MoE, the router; then one part per FFN group
  (`ffn_gate`, `ffn_up`, `ffn_down`, or their `_exps` stacks): the gate and up products, then the
  gated activation, the down product, the post-norm and the residual add;
- `output` (group output): the final norm and the head.

Streamed units are the groups themselves and, for a layer whose KV is streamed, its KV. A routed
expert stack is a unit copied after the layer's `o` part, whose router chose the experts: only
theirs (`routed_experts`), less those its expert cache holds. With prefetch, the layer's `qkv`
part also applies the layer's router to the layer's input (`predict`), and the experts it names
are copied into the cache while the attention runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refengine.spec import ModelSpec
from solver.cost import CPU, ROUTED, STREAMED, Loc, TierPlacement
from solver.groups import FFN_ORDER

from .schedule import HOST, QueueId, Step, Unit, compute_queue, group_unit, kv_unit


@dataclass(frozen=True)
class Part:
    name: str  # "blk.3.qkv"
    kind: str  # "embed", "qkv", "kq", "o", "ffn_gate", "ffn_up_exps", ..., "output"
    layer: int | None
    group: str | None  # the weight group it reads; None for `kq`
    queue: QueueId  # a device's compute queue, or the host's
    units: tuple[Unit, ...]  # what it reads from ring slots
    routed_by: str = ""  # the part whose router chooses the rows of its units (routed streaming)
    cached: bool = False  # its routed units keep an expert cache
    predicted_by: str = ""  # the part that predicts the router's choice (prefetch)

    @property
    def step(self) -> Step:
        return Step(self.name, self.queue, self.units, self.routed_by, self.cached,
                    self.predicted_by)  # fmt: skip


def _part(name, kind, layer, group, loc: Loc, unit: Unit) -> Part:
    queue = HOST if loc.kind == CPU else compute_queue(loc.device)
    streamed = loc.kind in (STREAMED, ROUTED)
    routed = loc.kind == ROUTED
    routed_by = f"blk.{layer}.o" if routed else ""
    predicted_by = f"blk.{layer}.qkv" if routed and loc.prefetch else ""
    return Part(name, kind, layer, group, queue, (unit,) if streamed else (), routed_by,
                routed and loc.cache > 0, predicted_by)  # fmt: skip


def predicts(parts: list[Part], index: int) -> bool:
    """Whether part `index` (a layer's `qkv`) predicts its router's choice for a prefetch."""
    return any(p.predicted_by == parts[index].name for p in parts)




def parts(spec: ModelSpec, place: TierPlacement) -> list[Part]:
    """The parts of one ubatch under a tier's placement, in execution order."""
    g = place.groups
    out = [_part("embed", "embed", None, "token_embd", g["token_embd"], group_unit("token_embd"))]
    for il in range(spec.hparams.n_layer):
        p, attn = f"blk.{il}.", f"blk.{il}.attn"
        out.append(_part(p + "qkv", "qkv", il, attn, g[attn], group_unit(attn)))
        out.append(_part(p + "kq", "kq", il, None, place.kv[il], kv_unit(il)))
        out.append(_part(p + "o", "o", il, attn, g[attn], group_unit(attn)))
        for kind in FFN_ORDER:
            if p + kind in g:
                out.append(_part(p + kind, kind, il, p + kind, g[p + kind], group_unit(p + kind)))
    out.append(_part("output", "output", None, "output", g["output"], group_unit("output")))
    return out


def routed_experts(ids) -> list[int]:
    """The experts a ubatch's router chose (ids [T, k]), in the order a routed copy packs them."""
    return np.unique(ids).tolist()
