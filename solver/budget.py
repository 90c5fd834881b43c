"""Budgets and tiers as the user writes them (docs/contracts.md): `12000` (MiB, llama.cpp's -mva
habit), `12000MiB`, `12GiB`, or one per device, `24GiB,6GiB`; tiers as `1,16,512`.

`plan_budgets` is the one place a plan's budgets are decided, for `solve` and for the plan engines
alike: the default (free memory, or the profile's GPU memory, less llama.cpp's 1024 MiB margin),
the check against the profile's devices, `--reserve`, and which tiers' workspaces fit (a budget
too small for the smallest tier is refused, naming both figures). It leaves out measuring free
memory, which the runtime does and passes in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from refengine.errors import UserError
from refengine.spec import ModelSpec

from .memory import compute_nbytes

if TYPE_CHECKING:
    from .cost import Workload
    from .profile import HardwareProfile

UNITS = {"": 2**20, "mib": 2**20, "m": 2**20, "gib": 2**30, "g": 2**30, "mb": 10**6, "gb": 10**9}
LLAMACPP_MARGIN_BYTES = 1024 * 2**20  # llama.cpp --fit's default margin per device
DEFAULT_N_BATCH = 2048  # llama.cpp's -b
# What our CUDA runtime allocates outside its arena, which the budget covers too
# (docs/contracts.md): cuBLAS's handle and the kernels it loads, once a tier takes the prefill path,
# and our kernels' code, streams, events and graphs. Measured as the drop in free memory after the
# context was created, on an H200 with CUDA 13.0 (docs/measured/2026-11-27-h200-agreement.txt and
# -vs-llamacpp): 64.0-75.0 MiB outside the arena on engines with a prefill tier, 1.9-3.9 MiB on
# decode-only ones.
CUDA_RUNTIME_NBYTES = 80 * 2**20


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise UserError(
            f"cannot read {text!r} as a memory size; write 12000 (MiB), 12000MiB or 12GiB"
        )
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def parse_budget(text: str) -> list[int]:
    """Bytes per device."""
    return [parse_bytes(part) for part in text.split(",")]


def apply_reserve(budgets: list[int], reserve: str) -> list[int]:
    """The budgets less `--reserve` (docs/contracts.md): one size for every device, or one per
    device."""
    reserves = parse_budget(reserve)
    if len(reserves) not in (1, len(budgets)):
        raise UserError(f"give one --reserve for every device or one per device ({len(budgets)})")
    reserves = reserves * len(budgets) if len(reserves) == 1 else reserves
    return [b - r for b, r in zip(budgets, reserves)]


MANY_USERS_DECODE_TIERS = (1, 4, 16, 32, 64)


def default_tiers(n_ctx: int, users: int = 1, n_batch: int = DEFAULT_N_BATCH) -> list[int]:
    """Decode {1, 16}; with several users {1, 4, 16, 32, 64} up to the first that holds a step of
    all of them (8 users: 1, 4, 16); then prefill 512 * 2^k up to min(max(n_batch, 16384), n_ctx)
    (docs/pshard.md)."""
    if users == 1:
        tiers = [1, 16]
    else:
        tiers = [t for t in MANY_USERS_DECODE_TIERS if t < users]
        tiers.append(next((t for t in MANY_USERS_DECODE_TIERS if t >= users),
                          MANY_USERS_DECODE_TIERS[-1]))  # fmt: skip
    top, t = min(max(n_batch, 16384), n_ctx), 512
    while t <= top:
        tiers.append(t)
        t *= 2
    return sorted(set(tiers))


def parse_tiers(text: str) -> list[int]:
    try:
        tiers = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise UserError(f"--tiers takes comma-separated token counts, not {text!r}") from None
    if not tiers or tiers[0] < 1:
        raise UserError("tiers must be positive token counts")
    return tiers


def mib_text(nbytes: int) -> str:
    """Whole MiB, or two decimals below 10 MiB (a decode tier's workspace is a fraction of one)."""
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB"


def excluded_lines(excluded: dict, tensor_split: bool) -> list[str]:
    """A line per device a plan leaves out (`solver.excluded`: device -> bytes it lacks)."""
    what = ("its workspace and a share of every layer" if tensor_split else
            "one layer, its KV and a workspace")  # fmt: skip
    return [f"GPU {d} excluded: {mib_text(lack)} short of {what}"
            for d, lack in sorted(excluded.items(), key=lambda item: int(item[0]))]  # fmt: skip


def device_budgets(
    budget: str | None,
    reserve: str,
    profile: HardwareProfile,
    measure_free: Callable[[], int] | None = None,
) -> list[int]:
    """Bytes per device the plan may use, less `--reserve`. No `--budget`: free memory less
    llama.cpp's margin, from `measure_free` when the plan runs here (one device), else from the
    profile's GPUs. A written budget may not list more devices than the profile describes, nor
    exceed a device's memory there."""
    if budget:
        budgets = parse_budget(budget)
        if len(budgets) > len(profile.gpus):
            raise UserError(
                f"{len(budgets)} budgets but profile {profile.name} describes "
                f"{len(profile.gpus)} GPU(s); give one budget per GPU of the profile "
                "(`refengine profile` measures yours)"
            )
        for d, (b, gpu) in enumerate(zip(budgets, profile.gpus)):
            memory = int(gpu.memory_bytes.value)
            if b > memory:
                raise UserError(
                    f"--budget {b / 2**30:.2f} GiB is above the {memory / 2**30:.2f} GiB of "
                    f"GPU {d} ({gpu.name}) in profile {profile.name}; lower --budget or "
                    "profile the card you have"
                )
    elif measure_free is not None:
        budgets = [measure_free() - LLAMACPP_MARGIN_BYTES]
    else:
        budgets = [int(g.memory_bytes.value) - LLAMACPP_MARGIN_BYTES for g in profile.gpus]
    return apply_reserve(budgets, reserve)


def minimum_budget_bytes(spec: ModelSpec, w: Workload, tier: int, target: str = "refengine") -> int:
    """The smallest budget a tier needs on a device that computes anything: its workspace (with
    every weight and all KV on the CPU)."""
    return compute_nbytes(spec, tier, w.n_ctx, w.flash_attn, 0, target)


def viable_tiers(
    spec: ModelSpec,
    w: Workload,
    tiers: list[int],
    budget_bytes: int | list[int],
    target: str = "refengine",
) -> list[int]:
    """The tiers whose workspace fits some device's budget (pshard marks the others not_viable; a
    prompt then runs in ubatches of the largest viable tier)."""
    budgets = [budget_bytes] if isinstance(budget_bytes, int) else budget_bytes
    return [t for t in tiers if minimum_budget_bytes(spec, w, t, target) <= max(budgets)]


def viable_or_refuse(
    spec: ModelSpec, w: Workload, tiers: list[int], budgets: list[int], target: str = "refengine"
) -> list[int]:
    """`viable_tiers`, refusing budgets too small for the smallest tier's workspace on any device:
    the budget and the minimum named, or each device's shortfall."""
    viable = viable_tiers(spec, w, tiers, budgets, target)
    if min(tiers) in viable:
        return viable
    need = minimum_budget_bytes(spec, w, min(tiers), target)
    if len(budgets) == 1:
        raise UserError(
            f"a budget of {mib_text(budgets[0])} is below the minimum of {mib_text(need)} any "
            "placement needs here; raise --budget"
        )
    short = ", ".join(
        f"device {d}: workspace of tier {min(tiers)} needs {mib_text(need)}, "
        f"budget {mib_text(b)}, short by {mib_text(need - b)}"
        for d, b in enumerate(budgets)
    )
    raise UserError(f"no device can compute at all ({short}); raise a --budget")


@dataclass(frozen=True)
class Budgets:
    bytes: list[int]  # per device, after the reserve
    tiers: list[int]  # the requested tiers whose workspace fits
    dropped: list[int]  # the others


def plan_budgets(
    spec: ModelSpec,
    w: Workload,
    tiers: list[int],
    budget: str | None,
    reserve: str,
    profile: HardwareProfile,
    target: str = "refengine",
    measure_free: Callable[[], int] | None = None,
) -> Budgets:
    """A request's budgets and viable tiers: `device_budgets`, then `viable_or_refuse`."""
    budgets = device_budgets(budget, reserve, profile, measure_free)
    viable = viable_or_refuse(spec, w, tiers, budgets, target)
    return Budgets(budgets, viable, sorted(set(tiers) - set(viable)))
