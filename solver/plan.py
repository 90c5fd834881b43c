"""The Plan: versioned JSON that says, per tier, where every tensor and every layer's KV lives,
the device memory map, and what the cost model predicts (docs/contracts.md, Plan).

The memory map of a device in a tier lists regions (name, offset_bytes, nbytes) in arena order:
weights pinned in every tier first (so a tier switch leaves them in place), then this tier's
other pinned weights, the scratch ring slots, the runtime's workspace, and the KV packed from the
right end of the budget (layer 0 rightmost), so a switch can resize the scratch between them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from refengine.errors import UserError
from refengine.spec import ModelSpec

from .cost import CPU, PINNED, ROUTED, STREAMED, Loc, Prediction, TierPlacement, Workload
from .groups import EMBD, Group, cache_nbytes, tensor_groups
from .memory import kv_layer_nbytes
from . import regions
from .regions import Region, RegionId, RegionKind
from .routing import RoutingStats
from .shares import Shares
from .targets import traits
from .tensor_split import device_nbytes, split_memory_map, tensor_split_nbytes
from .usage import PREFETCH_DEPTH, device_usage, kv_shape
from .workspace import ALIGN, align_up, map_padding_nbytes

SCHEMA = "refengine.plan"
VERSION = 1


def memory_map(
    spec: ModelSpec,
    groups: list[Group],
    tiers: dict[int, TierPlacement],
    tier: int,
    w: Workload,
    budget_bytes: int,
    device: int = 0,
) -> list[Region]:
    place = tiers[tier]
    everywhere = {
        g.name
        for g in groups
        if all(t.groups[g.name] == Loc(PINNED, device) for t in tiers.values())
    }
    out, offset = [], 0
    ordered = [g for g in groups if g.name in everywhere] + [
        g
        for g in groups
        if g.name not in everywhere and place.groups[g.name] == Loc(PINNED, device)
    ]

    def add(rid: RegionId, nbytes: int) -> None:  # from the left, each on an ALIGN boundary
        nonlocal offset
        offset = align_up(offset)
        out.append(Region(rid, offset, nbytes))
        offset += nbytes

    for g in ordered:
        add(regions.weights(g.name, device), g.nbytes)
    for g in groups:  # the expert caches of routed stacks (empty after a switch)
        loc = place.groups[g.name]
        if loc.kind == ROUTED and loc.device == device and loc.cache:
            add(regions.cache(g.name, device), cache_nbytes(spec, g, loc.cache))
    usage = device_usage(spec, groups, place, tier, w, "refengine", device)
    slot = usage.scratch // PREFETCH_DEPTH if usage.scratch else 0
    # (a routed stack whose expert cache holds a ubatch's every expert copies nothing into its
    # slot: the ring may be empty yet there)
    streams = any(
        loc.kind in (STREAMED, ROUTED) and loc.device == device
        for loc in (*place.groups.values(), *place.kv.values())
    )
    for i in range(PREFETCH_DEPTH if slot or streams else 0):
        add(RegionId(RegionKind.SCRATCH, i, device), slot)
    # the workspace's own layout; the padding the model adds to it is spent on the boundaries
    add(regions.workspace(device), usage.compute - map_padding_nbytes(spec) if usage.compute else 0)
    end = budget_bytes // ALIGN * ALIGN
    kv = kv_shape(w, tier)
    for il in sorted(place.kv):
        if place.kv[il] == Loc(PINNED, device):
            n = kv_layer_nbytes(spec, il, kv)
            end = (end - n) // ALIGN * ALIGN
            out.append(Region(regions.kv(il, device), end, n))
    if end < offset:  # the solver's memory model and this map disagree: a bug, not a user error
        raise AssertionError(
            f"tier {tier}: the memory map overflows the budget by {offset - end} B"
        )
    return out


def fingerprint(
    spec: ModelSpec, w: Workload, profile_name: str, budgets: list[int], tiers: list[int],
    split_mode: str = "layer", rpc: list[str] | None = None,
) -> dict:  # fmt: skip
    """`rpc`: the endpoints of the llama.cpp RPC servers that are the last len(rpc) devices (after
    the local GPUs, as llama.cpp numbers them): a plan for other servers is another plan, and
    export names them (`--rpc`)."""
    return {
        "model": spec.name,
        "model_nbytes": spec.file_nbytes,
        "n_ctx": w.n_ctx,
        "users": w.users,
        "kv_unified": w.unified,
        "kv_type": w.kv_type,
        "flash_attn": w.flash_attn,
        "threads": w.threads,
        "profile": profile_name,
        "budget_bytes": budgets,
        "tiers": tiers,
    } | ({"routing": w.routing.digest} if w.routing else {}) | (
        {"split_mode": split_mode} if split_mode != "layer" else {}
    ) | ({"rpc": list(rpc)} if rpc else {})


def fingerprint_hash(fp: dict) -> str:
    return hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]


def plan_json(
    spec: ModelSpec,
    w: Workload,
    profile_name: str,
    budgets: list[int],
    tiers: dict[int, TierPlacement],
    prediction: Prediction,
    strategy: str,
    target: str,
    solver: dict | None = None,
    not_needed: bool = False,
    split_mode: str = "layer",
    shares: Shares | None = None,
    rpc: list[str] | None = None,
) -> dict:
    """`rpc`: the endpoints of the RPC servers among the devices, the last ones
    (`solver.profile.rpc_endpoints`)."""
    groups = tensor_groups(spec)
    fp = fingerprint(spec, w, profile_name, budgets, sorted(tiers), split_mode, rpc)
    out_tiers = {}
    if shares is not None:  # our runtime's tensor split: each device's shares, laid out
        devices = range(len(budgets))
        for t in sorted(tiers):
            out_tiers[str(t)] = {
                "tensors": {
                    n: "cpu" if n == "token_embd.weight" else "split" for n in spec.by_name
                },
                "kv": {str(il): "split" for il in range(spec.hparams.n_layer)},
                "memory": {str(d): {"total": device_nbytes(spec, w, t, shares, d)}
                           for d in devices},
                "memory_map": {
                    str(d): [r.to_json()
                             for r in split_memory_map(spec, w, t, shares, budgets[d], d)]
                    for d in devices
                },
            }  # fmt: skip
    elif split_mode == "tensor":  # every matrix and all KV split evenly across the GPUs
        for t in sorted(tiers):
            need = tensor_split_nbytes(spec, w, t, len(budgets))
            out_tiers[str(t)] = {
                "tensors": {
                    n: "cpu" if n == "token_embd.weight" else "split" for n in spec.by_name
                },
                "kv": {str(il): "split" for il in range(spec.hparams.n_layer)},
                "memory": {str(d): {"total": need} for d in range(len(budgets))},
            }
    for t, place in sorted(tiers.items()) if split_mode == "layer" else ():
        tensors = {}
        for g in groups:
            for name in g.tensors:  # a tied head is token_embd used a second time
                tied_head = g.kind == "output" and name == "token_embd.weight"
                tensors[name + ("@output" if tied_head else "")] = str(place.groups[g.name])
        devices = range(len(budgets))
        terms = prediction.per_tier.get(t, {})
        out_tiers[str(t)] = {
            "tensors": tensors,
            "kv": {str(il): str(loc) for il, loc in sorted(place.kv.items())},
            "memory": {
                str(d): device_usage(spec, groups, place, t, w, target, d).as_dict()
                for d in devices
            },
            "memory_map": {
                str(d): [
                    r.to_json()
                    for r in memory_map(spec, groups, tiers, t, w, budgets[d], d)
                ]
                for d in devices
            }
            if traits(target).our_runtime
            else {},
            "predicted_ubatch_seconds": {
                str(d): {
                    "gpu": x.gpu,
                    "copy": x.copy,
                    "cpu": x.cpu,
                    "latency": x.latency,
                    "total": x.total,
                    "bound": x.bound,
                }
                for d, x in sorted(terms.items())
            },
        }
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "target": target,
        "split_mode": split_mode,
        "strategy": strategy,
        "not_needed": not_needed,
        "model": {"name": spec.name, "path": str(spec.path)},
        "fingerprint": fp,
        "fingerprint_hash": fingerprint_hash(fp),
        "workload": {
            "prompt_tokens": w.prompt_tokens,
            "gen_tokens": w.gen_tokens,
            "users": w.users,
            "op_offload": w.op_offload,
        },
        "prediction": {
            "ttft_seconds": prediction.ttft_seconds,
            "tps": prediction.tps,
            "decode_seconds": prediction.decode_seconds,
            "e2e_seconds": prediction.e2e_seconds,
            "switch_seconds": prediction.switch_seconds,
        },
        "solver": solver or {},
        "routing": w.routing.to_json() if w.routing else None,
        "tiers": out_tiers,
        "shares": shares.to_json() if shares is not None else None,
        # llama.cpp allocates once, for its largest ubatch, with the one placement of every tier
        "memory_worst": (out_tiers[str(max(tiers))]["memory"] if traits(target).ggml_memory
                         else None),
    }


def load_plan(path: str | Path) -> dict:
    p = Path(path)
    try:
        d = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{p}: not a readable plan ({e})") from None
    if d.get("schema") != SCHEMA or d.get("version") != VERSION:
        raise UserError(f"{p}: not a refengine plan of version {VERSION}; solve again")
    return d


def placements_from_json(d: dict, spec: ModelSpec) -> dict[int, TierPlacement]:
    """TierPlacements back from a plan's JSON (group locations from their tensors')."""
    groups = tensor_groups(spec)
    out = {}
    for t, tier in d["tiers"].items():
        locs = {}
        for g in groups:  # a group's tensors share its location; the first one names it
            locs[g.name] = Loc.parse(tier["tensors"][g.tensors[0]])
        out[int(t)] = TierPlacement(locs, {int(il): Loc.parse(v) for il, v in tier["kv"].items()})
    return out


def plan_devices(d: dict) -> list[tuple[str, str | None]]:
    """Each device of a plan as llama.cpp names it, with its RPC endpoint (None for a local GPU):
    the local GPUs CUDA0, CUDA1, ..., then the RPC servers RPC0, RPC1, ... of the fingerprint."""
    rpc = d["fingerprint"].get("rpc", [])
    n_local = len(d["fingerprint"]["budget_bytes"]) - len(rpc)
    return [(f"CUDA{i}", None) for i in range(n_local)] + [
        (f"RPC{j}", e) for j, e in enumerate(rpc)
    ]


def plan_model(d: dict) -> str:
    """The model argument a plan was solved for: its file, or its spec-only shape's name."""
    return d["model"]["path"] if d["model"]["path"] != "None" else d["model"]["name"]


def plan_workload(d: dict) -> Workload:
    """The workload a plan was solved for, from its fingerprint."""
    fp = d["fingerprint"]
    return Workload(
        n_ctx=fp["n_ctx"],
        prompt_tokens=d["workload"]["prompt_tokens"],
        gen_tokens=d["workload"]["gen_tokens"],
        users=fp["users"],
        kv_type=fp["kv_type"],
        flash_attn=fp["flash_attn"],
        threads=fp["threads"],
        unified=fp.get("kv_unified", False),
        routing=RoutingStats.from_json(d["routing"]) if d.get("routing") else None,
        op_offload=d["workload"].get("op_offload", True),
    )


@dataclass(frozen=True)
class TierPlan:
    """A tier of a plan: where every group and layer's KV lives, and each device's memory map
    (a `--target refengine` plan's; empty for llama.cpp's)."""

    place: TierPlacement
    maps: dict[int, list[Region]]


@dataclass(frozen=True)
class Plan:
    """A plan's JSON, parsed once (what the runtime reads of it)."""

    target: str
    split_mode: str
    fingerprint: dict
    workload: Workload
    shares: Shares | None  # our runtime's tensor split: each device's share of every layer
    tiers: dict[int, TierPlan]
    runtime_nbytes: int  # what the CUDA runtime itself holds on each device, beside the arena

    @property
    def budgets(self) -> list[int]:
        return self.fingerprint["budget_bytes"]

    @classmethod
    def from_json(cls, d: dict, spec: ModelSpec) -> Plan:
        shares = Shares.from_json(d["shares"]) if d.get("shares") else None
        places = split_placements(spec, d) if shares is not None else placements_from_json(d, spec)
        tiers = {
            t: TierPlan(place, {int(dev): [Region.from_json(r, int(dev)) for r in m]
                                for dev, m in d["tiers"][str(t)].get("memory_map", {}).items()})
            for t, place in places.items()
        }  # fmt: skip
        return cls(d["target"], d["split_mode"], d["fingerprint"], plan_workload(d), shares,
                   tiers, d.get("runtime_nbytes", 0))  # fmt: skip


def split_placements(spec: ModelSpec, d: dict) -> dict[int, TierPlacement]:
    """A tensor split's placements as the runtime reads them: the embedding on the host,
    everything else held on the devices (their shares) in every tier."""
    groups = {g.name: Loc(CPU) if g.kind == EMBD else Loc(PINNED) for g in tensor_groups(spec)}
    kv = {il: Loc(PINNED) for il in range(spec.hparams.n_layer)}
    return {int(t): TierPlacement(groups, kv) for t in d["tiers"]}
