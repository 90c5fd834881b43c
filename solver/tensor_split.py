"""Tensor split (llama.cpp `-sm tensor`, llama.cpp #19378): every weight matrix and every layer's KV
split evenly across the GPUs (llama.cpp ignores `-ts` under `-sm tensor`), attention split by heads,
and two all-reduces per layer — after the attention and after the FFN — each exchanging the residual
rows (tokens x n_embd x 4 bytes) between the GPUs through the host. It needs flash attention and
every layer on the GPUs. Planned, exported, and run by our runtime (docs/runtime.md).

Per ubatch (M tokens, depth d), with the rates of the cost model (target llamacpp, so CPU-side
terms are llama.cpp's): each layer takes max over GPUs i of (sum of its groups' GPU time on i +
its attention time on i) / D, plus two all-reduces of 2 hops each (down to the host, up to the
other GPU), plus its kernel launches; the embedding is gathered on the CPU and sent up (one hop),
the head is split too and its logits gathered (one hop).

Our runtime executes tensor splits too (target refengine): by the plan's shares (`solver.shares`),
uneven where the budgets are, every layer split and held on the GPUs, the sums over pinned host
memory; `refengine_split` chooses the shares and lays out each device's memory.
"""

from __future__ import annotations

from refengine.spec import ModelSpec

from .cost import (
    ELEMENTWISE_KERNELS_PER_LAYER,
    PINNED,
    CostModel,
    Loc,
    Operations,
    Prediction,
    Terms,
    Workload,
    request_shapes,
)
from .groups import EMBD, EXPERTS, tensor_groups
from .memory import compute_nbytes, kv_cells, kv_layer_nbytes
from .profile import HardwareProfile
from . import regions as region_ids
from .regions import Region
from .shares import DIMS, FF, FF_EXP, HEADS, VOCAB, Shares, group_share_nbytes
from .shares import kv_share_cell_nbytes, shares_for
from .shares import units
from .usage import kv_shape
from .workspace import ALIGN, align_up, map_padding_nbytes

ALL_REDUCES_PER_LAYER = 2


def tensor_split_nbytes(spec: ModelSpec, w: Workload, tier: int, n_devices: int) -> int:
    """Bytes each GPU needs: its share of the weights (the embedding stays on the CPU) and KV,
    and a whole workspace with the logits of a full ubatch (llama.cpp reserves for it)."""
    weights = sum(g.nbytes for g in tensor_groups(spec) if g.kind != EMBD)
    kv = sum(kv_layer_nbytes(spec, il, kv_shape(w, tier)) for il in range(spec.hparams.n_layer))
    workspace = compute_nbytes(spec, tier, w.n_ctx, w.flash_attn, tier)
    return -(-(weights + kv) // n_devices) + workspace


def short_devices(spec: ModelSpec, w: Workload, tier: int, budgets: list[int]) -> dict[int, int]:
    """Devices whose budget cannot hold their share, with the bytes they lack."""
    need = tensor_split_nbytes(spec, w, tier, len(budgets))
    return {d: need - b for d, b in enumerate(budgets) if b < need}


def even_fractions(n_devices: int) -> list[dict[str, float]]:
    """llama.cpp's split: an even share of every dimension on each GPU."""
    return [dict.fromkeys(DIMS, 1 / n_devices)] * n_devices


def share_fractions(shares: Shares) -> list[dict[str, float]]:
    """Our runtime's split: each device's share of every dimension."""
    return [{dim: shares.fraction(dim, d) for dim in DIMS} for d in range(shares.n_devices)]


def ubatch_terms(cm: CostModel, fractions: list[dict[str, float]], tokens: int, depth: int,
                 sequences: int) -> Terms:  # fmt: skip
    """One ubatch; `fractions`: per device, its share of the heads, the FFN rows and the vocab
    (llama.cpp's: even)."""
    spec, total, n_devices = cm.spec, Terms(), len(fractions)
    hop = cm.hop_seconds(tokens, spec.hparams.n_embd)
    for il in range(spec.hparams.n_layer):
        attn, ffn = [g for g in cm.by_layer[il] if g.kind == "attn"], [
            g for g in cm.by_layer[il] if g.kind != "attn"
        ]
        t = Terms(gpu=max(
            f[HEADS] * (sum(cm.gpu_seconds(g, tokens, d) for g in attn)
                        + cm.attention_seconds(il, tokens, depth, Loc(PINNED, d), sequences))
            + sum(f[FF_EXP if g.kind == EXPERTS else FF] * cm.gpu_seconds(g, tokens, d)
                  for g in ffn)
            for d, f in enumerate(fractions)
        ))  # fmt: skip
        t.latency = hops_seconds(layer_operations(n_devices), n_devices, hop) + cm.launch_seconds(
            ELEMENTWISE_KERNELS_PER_LAYER + len(cm.by_layer[il]), tokens
        )
        t.total = t.gpu + t.latency
        total.add(t)
    embd, head = cm.by_layer[None]
    t = Terms(cpu=cm.cpu_seconds(embd, tokens))
    t.gpu = max(f[VOCAB] * cm.gpu_seconds(head, tokens, d) for d, f in enumerate(fractions))
    t.latency = hops_seconds(edge_operations(n_devices), n_devices, hop)
    t.total = t.cpu + t.gpu + t.latency
    total.add(t)
    return total


def evaluate_tensor_split(
    spec: ModelSpec, profile: HardwareProfile, w: Workload, tiers: list[int], n_devices: int,
    target: str = "llamacpp", shares: Shares | None = None,
) -> Prediction:  # fmt: skip
    """TTFT, decode time and TPS of the workload under tensor split, as `cost.evaluate` prices a
    plan (one static placement: no plan switch): llama.cpp's even split, or our runtime's
    `shares`."""
    cm = CostModel(spec, profile, w, target)
    fractions = even_fractions(n_devices) if shares is None else share_fractions(shares)
    shapes, _, _ = request_shapes(cm, sorted(tiers))
    ttft = decode = 0.0
    per_tier: dict[int, dict[int, Terms]] = {}
    for s in shapes:
        t = ubatch_terms(cm, fractions, s.tokens, s.depth, s.sequences)
        per_tier.setdefault(s.tier, {})[s.depth] = t
        if s.part == "prefill":
            ttft += s.weight * t.total
        else:
            decode += s.weight * t.total
    ttft, decode = float(ttft), float(decode)
    tps = w.users * w.gen_tokens / decode if decode > 0 else 0.0
    return Prediction(ttft, decode, tps, ttft + decode, per_tier, 0.0)


def layer_operations(n_devices: int) -> Operations:
    """What a layer moves: two sums, each every device's partial output down and the sum back up
    to every device."""
    return Operations(all_reduces=ALL_REDUCES_PER_LAYER,
                      hops=2 * n_devices * ALL_REDUCES_PER_LAYER)  # fmt: skip


def edge_operations(n_devices: int) -> Operations:
    """What a ubatch moves besides its layers: the embedding's rows up to every device, the
    head's rows down from every device."""
    return Operations(hops=2 * n_devices)


def hops_seconds(ops: Operations, n_devices: int, hop_seconds: float) -> float:
    """The devices make their hops at once: each of them pays for its own share, one hop's time
    a hand-off."""
    return ops.hops / n_devices * hop_seconds


def split_operations(n_layer: int, n_devices: int) -> Operations:
    """What a tensor split's ubatch moves, from the terms `ubatch_terms` prices."""
    return layer_operations(n_devices) * n_layer + edge_operations(n_devices)


# -- our runtime's tensor split ------------------------------------------------------------------


def workspace_nbytes(spec: ModelSpec, w: Workload, tier: int) -> int:
    """Each device's workspace: the whole model's for a ubatch (a device's share of it is less;
    the activations it sums are whole), with a logits row per sequence."""
    return compute_nbytes(spec, tier, w.n_ctx, w.flash_attn, min(tier, w.users), "refengine")


def device_nbytes(spec: ModelSpec, w: Workload, tier: int, shares: Shares, d: int) -> int:
    """What device d holds in a tier: its share of every layer and the head, of the KV, and a
    workspace (nothing when it takes no part)."""
    if not shares.takes_part(d):
        return 0
    weights = sum(
        group_share_nbytes(spec, g.tensors, shares, d) for g in tensor_groups(spec) if g.kind != EMBD
    )
    cell = kv_share_cell_nbytes(spec, shares, d, w.kv_type)
    kv = sum(kv_cells(spec, il, kv_shape(w, tier)) * cell for il in range(spec.hparams.n_layer))
    return weights + kv + workspace_nbytes(spec, w, tier)


def split_memory_map(spec: ModelSpec, w: Workload, tier: int, shares: Shares, budget_bytes: int,
                     d: int) -> list:  # fmt: skip
    """Device d's arena in a tier, as `plan.memory_map` lays out a layer split's: its weight
    shares from the left, the workspace, its KV share of every layer from the right."""
    if not shares.takes_part(d):
        return []
    regions, offset = [], 0
    for g in tensor_groups(spec):  # each region on an ALIGN boundary, as plan.memory_map's
        if g.kind != EMBD:
            offset = align_up(offset)
            regions.append(Region(region_ids.weights(g.name, d), offset,
                                  group_share_nbytes(spec, g.tensors, shares, d)))  # fmt: skip
            offset += regions[-1].nbytes
    offset = align_up(offset)
    regions.append(Region(region_ids.workspace(d), offset,
                          workspace_nbytes(spec, w, tier) - map_padding_nbytes(spec)))  # fmt: skip
    offset += regions[-1].nbytes
    end, cell = budget_bytes // ALIGN * ALIGN, kv_share_cell_nbytes(spec, shares, d, w.kv_type)
    for il in range(spec.hparams.n_layer):
        n = kv_cells(spec, il, kv_shape(w, tier)) * cell
        end = (end - n) // ALIGN * ALIGN
        regions.append(Region(region_ids.kv(il, d), end, n))
    if end < offset:  # the shares were chosen to fit: a bug, not a user error
        raise AssertionError(f"tier {tier}: device {d}'s map overflows its budget by {offset - end} B")
    return regions


def refengine_split(spec: ModelSpec, w: Workload, tier: int, budgets: list[int],
                    speeds: list[float] | None = None):  # fmt: skip
    """(shares, excluded devices and the bytes they lack) of our runtime's tensor split for
    ubatches up to `tier`: every layer cut in proportion to the devices' `speeds` (the slowest
    share sets the pace; None: alike) as far as the budgets allow, a device that cannot hold its
    workspace and a share of every layer left out; None for the shares when the budgets cannot
    hold the model."""
    floor, scaling = share_nbytes_line(spec, w, tier)
    excluded = {d: floor - b for d, b in enumerate(budgets) if b < floor}
    caps = [0.0 if d in excluded else (b - floor) / scaling for d, b in enumerate(budgets)]
    for _ in range(50):
        if sum(caps) < 1.0:
            return None, excluded
        ratios = _water_fill(caps, speeds or [1.0] * len(caps))
        shares = shares_for(spec, ratios)
        over = {d: device_nbytes(spec, w, tier, shares, d) - budgets[d] for d in shares.devices}
        over = {d: b for d, b in over.items() if b > 0}
        if not over:
            return shares, excluded
        for d, b in over.items():
            caps[d] = max(0.0, min(caps[d], ratios[d]) - b / scaling - 1e-6)
    return None, excluded


def share_nbytes_line(spec: ModelSpec, w: Workload, tier: int) -> tuple[int, int]:
    """(what a device taking part holds at least, what the rest of the model adds to it): its
    workspace, the tensors each holds whole and a unit of each dimension (with a single KV head,
    all the KV); a device with a share r of every dimension holds about floor + r * scaling."""
    one = Shares(*(((0, units(spec)[dim][1] if units(spec)[dim][0] else 0),) for dim in DIMS))
    floor = device_nbytes(spec, w, tier, one, 0)
    return floor, max(1, device_nbytes(spec, w, tier, shares_for(spec, [1.0]), 0) - floor)


def _water_fill(caps: list[float], speeds: list[float]) -> list[float]:
    """Ratios summing to 1, each at most its cap, the longest share (ratio over speed) as short
    as it can be: min(cap, level * speed), at the least level that adds up."""
    lo, hi = 0.0, 1.0 / min(speeds)
    for _ in range(80):
        mid = (lo + hi) / 2
        if sum(min(c, mid * v) for c, v in zip(caps, speeds)) < 1.0:
            lo = mid
        else:
            hi = mid
    return [min(c, hi * v) for c, v in zip(caps, speeds)]
