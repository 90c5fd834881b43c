"""Tensor split (llama.cpp `-sm tensor`, seed 002): every weight matrix and every layer's KV split
evenly across the GPUs (llama.cpp ignores `-ts` under `-sm tensor`), attention split by heads, and
two all-reduces per layer — after the attention and after the FFN — each exchanging the residual
rows (tokens x n_embd x 4 bytes) between the GPUs through the host. It needs flash attention and
every layer on the GPUs. Planned and exported, not run by our runtime (CONTRACTS.md).

Per ubatch (M tokens, depth d), with the rates of the cost model (target llamacpp, so CPU-side
terms are llama.cpp's): each layer takes max over GPUs i of (sum of its groups' GPU time on i +
its attention time on i) / D, plus two all-reduces of 2 hops each (down to the host, up to the
other GPU), plus its kernel launches; the embedding is gathered on the CPU and sent up (one hop),
the head is split too and its logits gathered (one hop).
"""

from __future__ import annotations

from refengine.spec import ModelSpec

from .cost import (
    ELEMENTWISE_KERNELS_PER_LAYER,
    PINNED,
    CostModel,
    Loc,
    Prediction,
    Terms,
    Workload,
    request_shapes,
)
from .groups import EMBD, tensor_groups
from .memory import compute_nbytes, kv_layer_nbytes
from .profile import HardwareProfile
from .usage import kv_shape

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


def ubatch_terms(cm: CostModel, n_devices: int, tokens: int, depth: int, sequences: int) -> Terms:
    spec, total = cm.spec, Terms()
    hop = cm.hop_seconds(tokens, spec.hparams.n_embd)
    for il in range(spec.hparams.n_layer):
        share = max(
            sum(cm.gpu_seconds(g, tokens, d) for g in cm.by_layer[il])
            + cm.attention_seconds(il, tokens, depth, Loc(PINNED, d), sequences)
            for d in range(n_devices)
        )
        t = Terms(gpu=share / n_devices)
        t.latency = ALL_REDUCES_PER_LAYER * 2 * hop + cm.launch_seconds(
            ELEMENTWISE_KERNELS_PER_LAYER + len(cm.by_layer[il]), tokens
        )
        t.total = t.gpu + t.latency
        total.add(t)
    embd, head = cm.by_layer[None]
    t = Terms(cpu=cm.cpu_seconds(embd, tokens))
    t.gpu = max(cm.gpu_seconds(head, tokens, d) for d in range(n_devices)) / n_devices
    t.latency = 2 * hop  # the embedding up, the logits gathered
    t.total = t.cpu + t.gpu + t.latency
    total.add(t)
    return total


def evaluate_tensor_split(
    spec: ModelSpec, profile: HardwareProfile, w: Workload, tiers: list[int], n_devices: int
) -> Prediction:
    """TTFT, decode time and TPS of the workload under tensor split, as `cost.evaluate` prices a
    plan (one static placement: no plan switch)."""
    cm = CostModel(spec, profile, w, "llamacpp")
    shapes, _, _ = request_shapes(cm, sorted(tiers))
    ttft = decode = 0.0
    per_tier: dict[int, dict[int, Terms]] = {}
    for s in shapes:
        t = ubatch_terms(cm, n_devices, s.tokens, s.depth, s.sequences)
        per_tier.setdefault(s.tier, {})[s.depth] = t
        if s.part == "prefill":
            ttft += s.weight * t.total
        else:
            decode += s.weight * t.total
    ttft, decode = float(ttft), float(decode)
    tps = w.users * w.gen_tokens / decode if decode > 0 else 0.0
    return Prediction(ttft, decode, tps, ttft + decode, per_tier, 0.0)
