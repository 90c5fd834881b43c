"""Device memory a placement needs in one tier, under our runtime or under llama.cpp.

Ours (the arena of docs/contracts.md): pinned weights, a scratch ring of PREFETCH_DEPTH slots, each
as large as the largest unit streamed (a tensor group, or a layer's KV where pshard's scheme
streams it) — the runtime copies the next unit while the current one computes —, the workspace (the compute buffer
of memory.py) and the KV of the layers whose KV lives there. llama.cpp's: the weights it holds on
the device, the KV of those layers, its compute buffer, and — at 32 tokens and more, when it
copies CPU-held weights to the GPU (op-offload) — room for the largest such weight.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.spec import ModelSpec

from .cost import CPU, OP_OFFLOAD_MIN_TOKENS, PINNED, ROUTED, STREAMED, TierPlacement, Workload
from .groups import (
    ATTN_SIDE,
    EMBD,
    EXPERTS,
    Group,
    cache_nbytes,
    routed_slot_nbytes,
    tensor_groups,
)
from .memory import PIPELINE_COPIES, KVShape, compute_nbytes, kv_layer_nbytes
from .targets import traits

PREFETCH_DEPTH = 2


@dataclass(frozen=True)
class Usage:
    weights: int
    scratch: int
    kv: int
    compute: int

    @property
    def total(self) -> int:
        return self.weights + self.scratch + self.kv + self.compute

    def as_dict(self) -> dict[str, int]:
        return {
            "weights": self.weights,
            "scratch": self.scratch,
            "kv": self.kv,
            "compute": self.compute,
            "total": self.total,
        }


def kv_shape(w: Workload, tier: int) -> KVShape:
    return KVShape(n_ctx=w.n_ctx, users=w.users, kv_type=w.kv_type, n_ubatch=max(tier, 1))


def device_usage(
    spec: ModelSpec,
    groups: list[Group],
    place: TierPlacement,
    tier: int,
    w: Workload,
    target: str,
    device: int = 0,
    op_offload: bool | None = None,
) -> Usage:
    """`op_offload`: whether llama.cpp's first device computes CPU-held weights of ubatches of 32
    tokens and more (a GPU does; an RPC server does not); None: as the workload says."""
    op_offload = w.op_offload if op_offload is None else op_offload
    runner = traits(target)
    mine = {g.name: place.groups[g.name] for g in groups}
    here = lambda loc: loc.kind != CPU and loc.device == device  # noqa: E731
    weights = sum(g.nbytes for g in groups if here(mine[g.name]) and mine[g.name].kind == PINNED)
    routed = [g for g in groups if here(mine[g.name]) and mine[g.name].kind == ROUTED]
    weights += sum(cache_nbytes(spec, g, mine[g.name].cache) for g in routed)  # resident experts
    kv = kv_shape(w, tier)
    # the ring streams one group (or one layer's KV) per slot: its largest such unit sizes it
    streamed_units = [
        g.nbytes for g in groups if here(mine[g.name]) and mine[g.name].kind == STREAMED
    ] + [routed_slot_nbytes(spec, g, tier, mine[g.name].cache) for g in routed]
    kv_bytes = 0
    for il, loc in place.kv.items():
        if here(loc) and loc.kind == PINNED:
            kv_bytes += kv_layer_nbytes(spec, il, kv)
        elif here(loc) and loc.kind == STREAMED:
            streamed_units.append(kv_layer_nbytes(spec, il, kv))
    rows = 0
    if here(mine["output"]):
        rows = tier if runner.ggml_memory else min(tier, w.users)
    # a workspace on every device that computes something (llama.cpp #14484: a device holding a
    # layer holds a compute buffer too); llama.cpp's op-offload computes on the first GPU
    holds = any(here(loc) for loc in mine.values()) or any(here(loc) for loc in place.kv.values())
    offloads = (
        op_offload and runner.op_offload and device == 0 and tier >= OP_OFFLOAD_MIN_TOKENS
    )
    # llama.cpp pipelines ubatches over several devices when every layer is offloaded whole
    layers = [mine[g.name] for g in groups if g.kind != EMBD]
    pipelined = (
        runner.ggml_memory
        and all(loc.kind != CPU for loc in layers)
        and len({loc.device for loc in layers}) > 1
    )
    copies = PIPELINE_COPIES if pipelined else 1
    # (unpipelined, a device holding any of a layer's groups reserves for a whole layer; one
    # holding the head alone, for the head)
    attends = any(here(mine[g.name]) for g in groups if g.layer is not None
                  and (g.kind == ATTN_SIDE or not pipelined))  # fmt: skip
    holds_masks = pipelined and here(mine["blk.0.attn"])  # the first layer's device makes them
    # routed experts held on the CPU and computed there: their device only mixes their outputs
    on_cpu = runner.ggml_memory and not (op_offload and tier >= OP_OFFLOAD_MIN_TOKENS)
    cpu_experts = {g.layer for g in groups if g.kind == EXPERTS and mine[g.name].kind == CPU}
    mine_layers = {g.layer for g in groups if g.kind == ATTN_SIDE and here(mine[g.name])}
    mixes = on_cpu and bool(mine_layers) and mine_layers <= cpu_experts
    first = min(mine_layers, default=spec.hparams.n_layer if here(mine["output"]) else None)
    mixes_before = (
        on_cpu and (mixes or not mine_layers) and first is not None and first - 1 in cpu_experts
    )
    mixed = tuple(sorted(mine_layers & cpu_experts)) if on_cpu else ()
    compute = (
        compute_nbytes(spec, tier, w.n_ctx, w.flash_attn, rows, target, copies, attends,
                       holds_masks, mixes, mixes_before, mixed,
                       len({g.layer for g in groups if g.layer is not None
                            and here(mine[g.name])}) == 1)  # fmt: skip
        if holds or offloads
        else 0
    )
    if not runner.ggml_memory:
        scratch = PREFETCH_DEPTH * max(streamed_units, default=0)
    else:  # llama.cpp copies one CPU-held weight at a time into its compute buffer
        biggest = max(
            (g.nbytes for g in groups if mine[g.name].kind == CPU and g.kind != EMBD), default=0
        )
        scratch = biggest if offloads else 0
    return Usage(weights, scratch, kv_bytes, compute)


def fits_budgets(
    spec: ModelSpec, w: Workload, place: TierPlacement, tier: int, budgets, target="refengine"
) -> bool:
    """Whether a tier's placement fits every GPU's budget."""
    groups = tensor_groups(spec)
    return all(
        device_usage(spec, groups, place, tier, w, target, d).total <= b
        for d, b in enumerate(budgets)
    )
