"""The named placements (docs/contracts.md): llama.cpp's `--fit` and pshard's five strategies, as
plain functions from a Problem to one TierPlacement per tier. They are the baselines the optimizer
must beat under the same cost model, and its warm starts.

- `fit` (docs/llamacpp.md): dense models get whole layers back to front (the output layer first, as
  `-ngl` counts it); MoE models first get every layer "dense-only" (experts on the CPU), back to
  front, then front to back whole layers, plus one partial layer (GATE: gate + up kept, down
  moved; else UP: up kept). token_embd stays on the CPU. The placement is static and marks
  CPU-held weights `cpu`; llama.cpp's op-offload of them at >= 32 tokens is priced by the cost
  model (target "llamacpp"), as docs/contracts.md's llamacpp plans require.
- pshard (docs/pshard.md), per tier: `pshard-fitparams` is fit filled front to back, without
  op-offload; the streaming strategies pin the first n_pinned layers (at most n_layer - 1), then
  try one partial layer (ATTN, UP, GATE, MOE in that order, keeping the last that fits), and put
  token_embd and the output head on the CPU:
  `layerpin-layerstream` streams the other layers whole; `attnpin-ffnstream` pins every attention
  side and streams the other FFNs; `ffncpu-attnstream` streams the other attention sides and
  computes their FFNs on the CPU; `attnprio` pins attention sides as far as they fit, then whole
  layers, the rest on the CPU, streaming nothing.
A layer's KV sits on the GPU with the layer when it is pinned; a streamed layer's KV too when it
fits, else it streams with the layer (pshard's host mirror, uploaded per split).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from refengine.spec import ModelSpec

from .cost import CPU, OP_OFFLOAD_MIN_TOKENS, PINNED, STREAMED, Loc, TierPlacement, Workload
from .groups import ATTN_SIDE, EMBD, EXPERTS, FFN_MATRIX, Group, tensor_groups
from .profile import HardwareProfile
from .usage import device_usage


@dataclass(frozen=True)
class Problem:
    spec: ModelSpec
    profile: HardwareProfile
    workload: Workload
    tiers: tuple[int, ...]
    budget_bytes: int  # device 0, after the reserve
    target: str = "refengine"
    more_budgets: tuple[int, ...] = ()  # devices 1, 2, ... (fit uses them; pshard's, device 0)
    expert_cache: str = "auto"  # a routed stack's expert cache: "auto", or slots ("16", "16p")

    @property
    def budgets(self) -> tuple[int, ...]:
        return (self.budget_bytes, *self.more_budgets)


class Layout:
    """A candidate placement being built: group name -> location, layer -> KV location."""

    def __init__(self, p: Problem, groups: list[Group]):
        self.p, self.groups = p, groups
        self.loc = {g.name: Loc(CPU) for g in groups}
        self.kv = {il: Loc(CPU) for il in range(p.spec.hparams.n_layer)}

    def copy(self) -> "Layout":
        c = Layout.__new__(Layout)
        c.p, c.groups, c.loc, c.kv = self.p, self.groups, dict(self.loc), dict(self.kv)
        return c

    def set(self, names, kind: str) -> "Layout":
        for n in names:
            self.loc[n] = Loc(kind)
        return self

    def placement(self) -> TierPlacement:
        return TierPlacement(dict(self.loc), dict(self.kv))

    def fits(self, tier: int) -> bool:
        u = device_usage(
            self.p.spec, self.groups, self.placement(), tier, self.p.workload, self.p.target
        )
        return u.total <= self.p.budget_bytes


def _layer(groups: list[Group], il: int, kinds=None, bases=None) -> list[str]:
    out = []
    for g in groups:
        if g.layer != il:
            continue
        if kinds is not None and g.kind not in kinds:
            continue
        if bases is not None and not any(g.name.endswith(b) for b in bases):
            continue
        out.append(g.name)
    return out


def _largest(feasible: Callable[[int], bool], hi: int) -> int:
    """Largest k in 0..hi with feasible(k), feasibility being monotone (binary search)."""
    lo = 0
    if not feasible(0):
        return -1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if feasible(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _per_tier(p: Problem, build: Callable[[int], Layout]) -> dict[int, TierPlacement]:
    return {t: build(t).placement() for t in p.tiers}


# -- llama.cpp --fit --------------------------------------------------------------------------------


def _fit_layout(p: Problem, groups: list[Group], tier: int, front_to_back: bool) -> Layout:
    n = p.spec.hparams.n_layer
    moe = p.spec.arch.moe
    order = list(range(n)) if front_to_back else list(range(n - 1, -1, -1))

    def with_layers(k: int, dense_only: bool) -> Layout:
        lay = Layout(p, groups)
        if k == 0:
            return lay
        lay.set(["output"], PINNED)  # -ngl counts the output layer first
        for il in order[: k - 1]:
            names = _layer(groups, il, kinds={ATTN_SIDE}) if dense_only else _layer(groups, il)
            lay.set(names, PINNED)
            lay.kv[il] = Loc(PINNED)
        return lay

    if not moe:
        k = _largest(lambda k: with_layers(k, False).fits(tier), n + 1)
        return with_layers(max(k, 0), False)
    k = _largest(lambda k: with_layers(k, True).fits(tier), n + 1)
    lay = with_layers(max(k, 0), True)
    if k < n + 1:
        return lay
    for il in range(n):  # front to back: dense-only -> full, then one partial layer
        full = lay.copy().set(_layer(groups, il), PINNED)
        if full.fits(tier):
            lay = full
            continue
        for keep in (("ffn_gate_exps", "ffn_up_exps"), ("ffn_up_exps",)):  # GATE, then UP
            part = lay.copy().set(_layer(groups, il, bases=keep), PINNED)
            if part.fits(tier):
                lay = part
                break
        break
    return lay


LLAMACPP_UBATCH = 512  # llama.cpp's default -ub: its largest ubatch, and what --fit sizes for


def fit(p: Problem) -> dict[int, TierPlacement]:
    """llama.cpp's --fit: one static placement, sized for its 512-token ubatch; the cost model
    prices the op-offload of CPU-held weights at >= 32 tokens (evaluate, target "llamacpp").
    On several GPUs it uses every one of them, as llama.cpp's does (`_fit_devices`)."""
    groups = tensor_groups(p.spec)
    tiers = [t for t in p.tiers if t <= LLAMACPP_UBATCH] or [min(p.tiers)]
    if len(p.budgets) > 1:
        place = _fit_devices(p, groups, LLAMACPP_UBATCH)
    else:
        place = _fit_layout(p, groups, LLAMACPP_UBATCH, front_to_back=False).placement()
    return {t: place for t in tiers}


@dataclass
class _Slice:
    """One GPU's share under llama.cpp's multi-GPU --fit (common/fit.cpp's per-device layer
    counts): `n_layer` GPU layers in order, the first `n_layer - n_part` whole, the rest partial
    (the first partial keeps `keep` of its FFN and moves the others to `spill`, each later one
    is dense-only: its experts on the CPU). The last GPU's slice ends with the output layer."""

    n_layer: int = 0
    n_part: int = 0
    keep: str = "MOE"
    spill: int = -1  # the device the first partial layer's moved tensors go to (-1: the CPU)


# what each partial-layer kind keeps on its GPU (docs/llamacpp.md; the router sits in the attention
# side here, so ATTN keeps it)
_KEEPS = {
    "MOE": lambda g: g.kind != EXPERTS,
    "GATE": lambda g: g.kind == ATTN_SIDE or not g.name.split(".")[2].startswith("ffn_down"),
    "UP": lambda g: g.kind == ATTN_SIDE or g.name.split(".")[2].startswith("ffn_up"),
    "ATTN": lambda g: g.kind == ATTN_SIDE,
}


def _devices_placement(p: Problem, groups: list[Group], slices: list[_Slice]) -> TierPlacement:
    """The placement of per-device slices: the GPU layers are the last sum(n_layer) of the
    n_layer + 1 (the output layer counting last), device 0 taking the earliest."""
    n = p.spec.hparams.n_layer
    loc = {g.name: Loc(CPU) for g in groups}
    kv = {il: Loc(CPU) for il in range(n)}
    il = n + 1 - sum(s.n_layer for s in slices)
    for d, s in enumerate(slices):
        for j in range(s.n_layer):
            if il == n:  # the output layer
                loc["output"] = Loc(PINNED, d)
            else:
                part = j - (s.n_layer - s.n_part)  # >= 0: a partial layer
                keep = _KEEPS["MOE" if part > 0 else s.keep]
                spill = Loc(PINNED, s.spill) if part == 0 and s.spill >= 0 else Loc(CPU)
                for g in groups:
                    if g.layer == il:
                        loc[g.name] = Loc(PINNED, d) if part < 0 or keep(g) else spill
                kv[il] = Loc(PINNED, d)
            il += 1
    return TierPlacement(loc, kv)


def _fit_devices(p: Problem, groups: list[Group], tier: int) -> TierPlacement:
    """llama.cpp's --fit over several GPUs (common/fit.cpp, llama_params_fit): (1) back to front,
    each GPU takes as many of the unassigned last layers as fit it (MoE: dense-only, experts on
    the CPU; the last GPU's first layer is the output layer, always whole); (2) MoE, when every
    layer found a GPU: front to back, each GPU converts dense-only layers (its own, then the next
    GPUs' from the front) into whole layers as they fit, then tries one more partial layer — UP,
    and if that fits GATE, else ATTN — whose moved tensors go to the next GPU (the last GPU's:
    the CPU). The searches are bisections over a monotone fit, where llama.cpp interpolates;
    both end at the largest count that fits."""
    n, nd = p.spec.hparams.n_layer, len(p.budgets)
    moe = p.spec.arch.moe

    def usage(slices: list[_Slice]) -> list[int]:
        place = _devices_placement(p, groups, slices)
        return [
            device_usage(p.spec, groups, place, tier, p.workload, p.target, d).total
            for d in range(nd)
        ]

    def within(slices: list[_Slice]) -> bool:
        # every GPU, not only the one taking layers: once all layers are offloaded llama.cpp
        # pipelines ubatches, which grows the compute buffer of the GPUs already filled
        return all(u <= b for u, b in zip(usage(slices), p.budgets))

    def with_count(slices: list[_Slice], d: int, k: int) -> list[_Slice]:
        out = [replace(s) for s in slices]
        out[d] = _Slice(k, (k - 1 if d == nd - 1 else k) if moe and k else 0)
        return out

    slices = [_Slice() for _ in range(nd)]
    for d in range(nd - 1, -1, -1):  # (1)
        left = n + 1 - sum(s.n_layer for s in slices[d + 1 :])
        k = _largest(lambda k: within(with_count(slices, d, k)), left)
        slices = with_count(slices, d, max(k, 0))
    if not moe or sum(s.n_layer for s in slices) < n + 1:
        return _devices_placement(p, groups, slices)

    def convert(slices: list[_Slice], d: int, start: int, k: int) -> tuple[list[_Slice], int]:
        out = [replace(s) for s in slices]
        j, moved = start, 0
        while j < nd:
            c = min(k - moved, out[j].n_part)
            out[j].n_layer -= c
            out[j].n_part -= c
            out[d].n_layer += c
            moved += c
            if out[j].n_part > 0:
                break
            j += 1
        return out, j

    start = next(d for d in range(nd) if slices[d].n_layer > 0)
    for d in range(start + 1):  # (2)
        if start >= nd:
            break
        pool = sum(s.n_part for s in slices[start:])
        k = _largest(lambda k: within(convert(slices, d, start, k)[0]), pool)
        slices, start = convert(slices, d, start, max(k, 0))
        if start >= nd or slices[start].n_layer <= (0 if d < nd - 1 else 1):
            continue
        trial = [replace(s) for s in slices]
        trial[start].n_layer -= 1
        trial[start].n_part -= 1
        trial[d].n_layer += 1
        trial[d].n_part += 1
        nxt = start + 1 if trial[start].n_part == 0 else start
        spill = d + 1 if d < nd - 1 else -1

        def fits(keep: str) -> bool:
            trial[d].keep, trial[d].spill = keep, spill
            u = usage(trial)
            return u[d] < p.budgets[d] and (spill < 0 or u[spill] < p.budgets[spill])

        for keeps in (("UP", "GATE"), ("ATTN",)):
            if fits(keeps[0]):
                best = keeps[0]
                if len(keeps) > 1 and fits(keeps[1]):
                    best = keeps[1]
                trial[d].keep = best
                slices, start = trial, nxt
                break
    return _devices_placement(p, groups, slices)


def fit_for_runtime(p: Problem, placements: dict[int, TierPlacement]) -> dict[int, TierPlacement]:
    """The `fit` placement run by our runtime as llama.cpp runs it (docs/contracts.md): the CPU-held
    weights computed on the CPU below 32 tokens and copied to the GPU per ubatch (op-offload,
    here: streamed) at 32 and above — where the ring of streamed weights fits the budget."""
    groups = tensor_groups(p.spec)
    out = {}
    for t, place in placements.items():
        if t < OP_OFFLOAD_MIN_TOKENS:
            out[t] = place
            continue
        lay = Layout(replace(p, target="refengine"), groups)
        lay.loc, lay.kv = dict(place.groups), dict(place.kv)
        held = [g.name for g in groups if place.groups[g.name].kind == CPU and g.kind != EMBD]
        streamed = lay.copy().set(held, STREAMED)
        out[t] = (streamed if streamed.fits(t) else lay).placement()
    return out


def pshard_fitparams(p: Problem) -> dict[int, TierPlacement]:
    groups = tensor_groups(p.spec)
    return _per_tier(p, lambda t: _fit_layout(p, groups, t, front_to_back=True))


# -- pshard's streaming strategies ----------------------------------------------------------------

PARTIALS = (  # pshard's overflow order; each keeps more of the boundary layer pinned
    ("ATTN", {ATTN_SIDE}, None),
    ("UP", {ATTN_SIDE}, ("ffn_up", "ffn_up_exps")),
    ("GATE", {ATTN_SIDE}, ("ffn_up", "ffn_up_exps", "ffn_gate", "ffn_gate_exps")),
)


def _streaming(
    p: Problem, tier: int, rest: Callable[[Layout, int], None], attn_everywhere: bool = False
) -> Layout:
    groups = tensor_groups(p.spec)
    n = p.spec.hparams.n_layer

    def with_pinned(k: int) -> Layout:
        lay = Layout(p, groups)
        for il in range(n):
            if il < k:
                lay.set(_layer(groups, il), PINNED)
            else:
                rest(lay, il)
                if attn_everywhere:
                    lay.set(_layer(groups, il, kinds={ATTN_SIDE}), PINNED)
            lay.kv[il] = Loc(PINNED)
        if not lay.fits(tier):  # pshard streams the KV of the non-pinned layers with them
            for il in range(k, n):
                lay.kv[il] = Loc(STREAMED)
        return lay

    k = _largest(lambda k: with_pinned(k).fits(tier), n - 1)
    if k < 0:
        return Layout(p, groups)  # nothing viable: everything on the CPU
    lay = with_pinned(k)  # k <= n - 1: layer k is the boundary
    for _, kinds, bases in PARTIALS:
        part = lay.copy().set(_layer(groups, k, kinds=kinds), PINNED)
        if bases:
            part.set(_layer(groups, k, bases=bases), PINNED)
        if not part.fits(tier):
            break
        lay = part
    if p.spec.arch.moe:  # MOE: everything but the expert stacks pinned
        part = lay.copy().set(_layer(groups, k, kinds={ATTN_SIDE, FFN_MATRIX}), PINNED)
        if part.fits(tier):
            lay = part
    return lay


def layerpin_layerstream(p: Problem) -> dict[int, TierPlacement]:
    groups = tensor_groups(p.spec)
    return _per_tier(
        p, lambda t: _streaming(p, t, lambda lay, il: lay.set(_layer(groups, il), STREAMED))
    )


def attnpin_ffnstream(p: Problem) -> dict[int, TierPlacement]:
    groups = tensor_groups(p.spec)
    return _per_tier(
        p,
        lambda t: _streaming(
            p, t, lambda lay, il: lay.set(_layer(groups, il), STREAMED), attn_everywhere=True
        ),
    )


def ffncpu_attnstream(p: Problem) -> dict[int, TierPlacement]:
    groups = tensor_groups(p.spec)
    return _per_tier(
        p,
        lambda t: _streaming(
            p, t, lambda lay, il: lay.set(_layer(groups, il, kinds={ATTN_SIDE}), STREAMED)
        ),
    )


def attnprio(p: Problem) -> dict[int, TierPlacement]:
    groups = tensor_groups(p.spec)
    n = p.spec.hparams.n_layer

    def build(tier: int) -> Layout:
        def attn_only(k: int) -> Layout:
            lay = Layout(p, groups)
            for il in range(k):
                lay.set(_layer(groups, il, kinds={ATTN_SIDE}), PINNED)
                lay.kv[il] = Loc(PINNED)
            return lay

        k = _largest(lambda k: attn_only(k).fits(tier), n)
        lay = attn_only(max(k, 0))
        if k == n:
            for il in range(n):
                full = lay.copy().set(_layer(groups, il), PINNED)
                if not full.fits(tier):
                    break
                lay = full
        return lay

    return _per_tier(p, build)


def stream_rest(p: Problem) -> dict[int, TierPlacement]:
    """Not a named system: the output head and KV pinned first, then whole layers front to back,
    everything else streamed and nothing on the CPU — so copies run at the full PCIe rate. One of
    the optimizer's warm starts."""
    groups = tensor_groups(p.spec)
    n = p.spec.hparams.n_layer

    def build(tier: int) -> Layout:
        def with_pinned(k: int, kv_pinned: bool) -> Layout:
            lay = Layout(p, groups).set([g.name for g in groups if g.kind != EMBD], STREAMED)
            lay.set(["output"], PINNED)
            lay.set(["token_embd"], CPU)
            for il in range(n):
                if il < k:
                    lay.set(_layer(groups, il), PINNED)
                lay.kv[il] = Loc(PINNED) if kv_pinned or il < k else Loc(STREAMED)
            return lay

        for kv_pinned in (True, False):
            k = _largest(lambda k: with_pinned(k, kv_pinned).fits(tier), n - 1)
            if k >= 0:
                return with_pinned(k, kv_pinned)
        return Layout(p, groups)

    return _per_tier(p, build)


STRATEGIES: dict[str, Callable[[Problem], dict[int, TierPlacement]]] = {
    "fit": fit,
    "pshard-fitparams": pshard_fitparams,
    "layerpin-layerstream": layerpin_layerstream,
    "attnpin-ffnstream": attnpin_ffnstream,
    "ffncpu-attnstream": ffncpu_attnstream,
    "attnprio": attnprio,
}
# pshard's registry names (docs/pshard.md); `optimal` is written REFENGINE_OPTIMAL there
PSHARD_NAMES = {
    "pshard-fitparams": "STATIC_FITPARAMS_DENSEPRIO_MOEONLY",
    "layerpin-layerstream": "GPUONLY_LAYERPIN_LAYERSTREAM",
    "attnpin-ffnstream": "GPUONLY_ATTNPIN_FFNSTREAM",
    "ffncpu-attnstream": "DYNAMIC_FFNCPU_ATTNSTREAM",
    "attnprio": "STATIC_ATTNPRIO_ALLMODELS",
    "optimal": "REFENGINE_OPTIMAL",
}
