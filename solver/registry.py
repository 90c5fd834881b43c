"""pshard's registry file (`<model>.gguf.tensor_overrides.pshard_registry`), in the grammar and
with the fingerprint of docs/pshard.md, so pshard's runtime can load a refengine plan.

Placement ids: 0 pinned on the GPU, 1 and 2 the two streaming lanes (alternating by layer parity,
so layer i+1's copy does not overwrite layer i's weights), 3 the CPU; every entry names the host
buffer type `CUDA_Host` and the id alone decides. `optimal` is written `REFENGINE_OPTIMAL`.
"""

from __future__ import annotations

import re

from refengine.quants import qtype
from refengine.spec import ModelSpec

from .cost import CPU, PINNED, TierPlacement, Workload
from .groups import ATTN_SIDE, tensor_groups
from .strategies import PSHARD_NAMES

FNV_OFFSET, FNV_PRIME, MASK = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1
HOST_BUFT = "CUDA_Host"
HEADER = "# Generated file. Edit at your own risk."


def fingerprint(values: list[int]) -> int:
    """FNV-1a-style fold over the values (negative ones as 64-bit two's complement)."""
    h = FNV_OFFSET
    for v in values:
        h ^= v & MASK
        h = (h * FNV_PRIME) & MASK
    return h


def fingerprint_values(spec: ModelSpec, w: Workload, n_threads: int) -> list[int]:
    kv = int(qtype(w.kv_type.upper()).ggml)
    fa = 1 if w.flash_attn else 0
    return [w.n_ctx, w.users, n_threads, fa, kv, kv, spec.file_nbytes, -1]


def _id(loc, layer: int | None) -> int:
    if loc.kind == PINNED:
        return 0
    if loc.kind == CPU:
        return 3
    return 1 + (layer or 0) % 2  # streamed: lane by layer parity


# pshard's partial boundary layers (docs/pshard.md): what stays pinned of layer n_pinned
OVERFLOWS = (  # in pshard's order, which also breaks ties (MOE keeps what ATTN does without
    # shared experts)
    ("ATTN", lambda base: base == "attn"),  # the whole FFN moved
    ("UP", lambda base: base == "attn" or base.startswith("ffn_up")),  # gate and down moved
    ("GATE", lambda base: base == "attn" or base.startswith(("ffn_up", "ffn_gate"))),  # down
    ("MOE", lambda base: not base.endswith("_exps")),  # all but the expert stacks
)


def overflow(spec: ModelSpec, place: TierPlacement, layer: int) -> str:
    """The name of the partial layer `layer` as pshard writes it, or NONE."""
    mine = [g for g in tensor_groups(spec) if g.layer == layer]
    pinned = {g.name.split(".", 2)[2] for g in mine if place.groups[g.name].kind == PINNED}
    bases = {g.name.split(".", 2)[2] for g in mine}
    for name, keeps in OVERFLOWS:
        want = {b for b in bases if keeps(b)}
        if want and want != bases and pinned == want:
            return name
    return "NONE"


def tier_lines(
    spec: ModelSpec, place: TierPlacement, strategy: str, tps: float, vram_bytes: int
) -> list[str]:
    groups = tensor_groups(spec)
    n = spec.hparams.n_layer
    full = [
        all(place.groups[g.name].kind == PINNED for g in groups if g.layer == il) for il in range(n)
    ]
    n_pinned = next((il for il in range(n) if not full[il]), n)
    over = overflow(spec, place, n_pinned) if n_pinned < n else "NONE"
    n_attn = sum(1 for g in groups if g.kind == ATTN_SIDE and place.groups[g.name].kind == PINNED)
    entries = []
    for g in groups:
        loc = place.groups[g.name]
        for name in g.tensors:
            if g.kind == "output" and name == "token_embd.weight":
                continue  # a tied head: pshard places it with token_embd
            entries.append(f"^{re.escape(name)}$={HOST_BUFT}:{_id(loc, g.layer)}")
    return [
        f"strategy={PSHARD_NAMES.get(strategy, strategy.upper())} n_pinned={n_pinned} "
        f"n_attn_pinned={n_attn} overflow={over} tps={tps:.2f} vram={vram_bytes / 2**20:.1f} "
        f"output_on_gpu={int(place.groups['output'].kind != CPU)} pin_from_back=0",
        "ot=" + ",".join(entries),
    ]


def registry_text(
    spec: ModelSpec,
    w: Workload,
    n_threads: int,
    budget_bytes: int,
    tiers: dict[int, tuple[TierPlacement, float, int]],
    strategy: str,
    not_needed: bool = False,
) -> str:
    """`tiers`: tier -> (placement, predicted tps, vram bytes). A plan that is not needed (the
    model fits) is written as pshard's disabled variant at cache_ubatch 512 with its VRAM."""
    fp = fingerprint(fingerprint_values(spec, w, n_threads))
    kv = int(qtype(w.kv_type.upper()).ggml)
    lines = [
        HEADER,
        f"[fingerprint=0x{fp:016x}]",
        f"# n_ctx={w.n_ctx} n_seq_max={w.users} n_threads={n_threads} "
        f"fa={'on' if w.flash_attn else 'off'} type_k={kv} type_v={kv} strategy=auto",
    ]
    if not_needed:
        vram = max(v for _, _, v in tiers.values())
        lines.append(f"[variant budget={budget_bytes // 2**20} cache_ubatch=512]")
        lines.append(f"pshard_disabled=1 baseline_vram={vram / 2**20:.1f}")
        return "\n".join(lines) + "\n"
    lines.append(f"[variant budget={budget_bytes // 2**20} cache_ubatch={max(tiers)}]")
    for i, (t, (place, tps, vram)) in enumerate(sorted(tiers.items())):
        lines.append(f"[tier {i} bs={t}]")
        lines += tier_lines(spec, place, strategy, tps, vram)
    return "\n".join(lines) + "\n"


def parse_registry(text: str) -> dict:
    """The registry back, by docs/pshard.md's grammar: entries split on ',', then the first '=',
    then the last ':'."""
    out = {"tiers": {}}
    tier = None
    for line in text.splitlines():
        if m := re.fullmatch(r"\[fingerprint=0x([0-9a-f]{16})\]", line):
            out["fingerprint"] = int(m.group(1), 16)
        elif m := re.fullmatch(r"\[variant budget=(\d+) cache_ubatch=(\d+)\]", line):
            out["budget_mib"], out["cache_ubatch"] = int(m.group(1)), int(m.group(2))
        elif m := re.fullmatch(r"\[tier (\d+) bs=(\d+)\]", line):
            tier = int(m.group(2))
            out["tiers"][tier] = {}
        elif m := re.fullmatch(r"pshard_disabled=1 baseline_vram=([0-9.]+)", line):
            out["disabled"], out["baseline_vram_mib"] = True, float(m.group(1))
        elif line.startswith("strategy="):
            out["tiers"][tier].update(dict(kv.split("=", 1) for kv in line.split()))
        elif line.startswith("ot="):
            ot = {}
            for entry in line[3:].split(","):
                pattern, rest = entry.split("=", 1)
                buft, ident = rest.rsplit(":", 1)
                assert buft == HOST_BUFT
                ot[pattern] = int(ident)
            out["tiers"][tier]["ot"] = ot
    return out
