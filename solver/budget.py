"""Budgets and tiers as the user writes them (CONTRACTS.md): `12000` (MiB, llama.cpp's -mva habit),
`12000MiB`, `12GiB`, or one per device, `24GiB,6GiB`; tiers as `1,16,512`."""

from __future__ import annotations

import re

from refengine.errors import UserError

UNITS = {"": 2**20, "mib": 2**20, "m": 2**20, "gib": 2**30, "g": 2**30, "mb": 10**6, "gb": 10**9}
LLAMACPP_MARGIN_BYTES = 1024 * 2**20  # llama.cpp --fit's default margin per device
DEFAULT_N_BATCH = 2048  # llama.cpp's -b


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
    """The budgets less `--reserve` (CONTRACTS.md): one size for every device, or one per device."""
    reserves = parse_budget(reserve)
    if len(reserves) not in (1, len(budgets)):
        raise UserError(f"give one --reserve for every device or one per device ({len(budgets)})")
    reserves = reserves * len(budgets) if len(reserves) == 1 else reserves
    return [b - r for b, r in zip(budgets, reserves)]


def default_tiers(n_ctx: int, users: int = 1, n_batch: int = DEFAULT_N_BATCH) -> list[int]:
    """Decode {1, 16} ({1, 4, 16, 32, 64} with several users), then prefill 512 * 2^k up to
    min(max(n_batch, 16384), n_ctx) (PSHARD.md)."""
    tiers = [1, 16] if users == 1 else [1, 4, 16, 32, 64]
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
