"""What each GiB buys: one `solve` request repeated over the values of one axis — the budget, the
context, or the PCIe bandwidth — with the predicted TTFT, decode TPS and end-to-end time of the
optimizer, of llama.cpp's `fit` and of the best of pshard's strategies in each row, before
anything is loaded.

Each row is `solver.solve.solve_request` as `refengine solve` asks it (the same budgets, reserve,
viable tiers and named strategies, scored by the same `evaluate`), so a row and a `solve` at that
value print the same figures. A value the request refuses (a budget below the minimum any
placement needs, a context too small for the prompt) is a row that says why, not an error.

One axis at a time. PCIe bandwidth is the profile's host -> device copy rate; the device -> host
and the while-the-CPU-computes rates move with it in the profile's own ratios.

`write_png` draws the rows with matplotlib. Printing is the command's (refengine/commands/sweep.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from refengine.errors import UserError
from refengine.spec import ModelSpec

from .budget import UNITS
from .cost import Prediction, Workload
from .profile import Figure, HardwareProfile
from .solve import Outcome, request_workload, solve_request
from .strategies import PSHARD_NAMES

# CP-SAT's deterministic seconds per row (`solve` takes 6): about 1.3 s of wall time on the
# two-core machine, so 11 budgets of an 8B model sweep in about 15 s; `--time-limit` raises it.
SWEEP_SOLVER_SECONDS = 1.0
MAX_POINTS = 64  # a step written without its unit (2 = 2 MiB) would ask for thousands of solves
GIB = 2**30


@dataclass(frozen=True)
class Axis:
    """What a sweep varies: `budget` (bytes, device 0), `ctx` (tokens) or `pcie` (GB/s)."""

    name: str
    values: tuple[float, ...]

    @property
    def option(self) -> str:
        return AXES[self.name][0]

    @property
    def unit(self) -> str:
        """The unit tables and plots use: a budget in GiB, or MiB when every value is below one."""
        if self.name == "budget" and max(self.values) < GIB:
            return "MiB"
        return AXES[self.name][1]

    def shown(self, value: float) -> float:
        """The value in `unit`."""
        return value / UNITS[self.unit.lower()] if self.name == "budget" else value


# axis -> (its option, the unit shown, the units a value may be written in: name -> factor)
AXES = {
    "budget": ("--budget", "GiB", UNITS),
    "ctx": ("--ctx", "tokens", {"": 1}),
    "pcie": ("--pcie-gbps", "GB/s", {"": 1}),
}


def is_range(text: str | None) -> bool:
    return text is not None and ".." in text


def parse_range(axis: str, text: str) -> Axis:
    """`LO..HI:STEP`, both ends included: `4GiB..24GiB:2GiB` (a bare budget number is MiB, as
    --budget reads it), `2048..16384:2048`, `8..32:8`. Refused in one line: HI below LO, a step
    of zero, a unit the axis does not know, more than MAX_POINTS values."""
    option, _, units = AXES[axis]
    m = re.fullmatch(r"\s*(\S+?)\s*\.\.\s*(\S+?)\s*:\s*(\S+?)\s*", text)
    if not m:
        raise UserError(f"{option} {text}: write a range as LO..HI:STEP, e.g. {EXAMPLES[axis]}")
    lo, hi, step = (_number(option, text, part, units, axis) for part in m.groups())
    if lo <= 0:
        raise UserError(f"{option} {text}: the range must start above zero")
    if step <= 0:
        raise UserError(f"{option} {text}: the step must be above zero")
    if hi < lo:
        raise UserError(f"{option} {text}: the end is below the start")
    n = int((hi - lo) / step + 1e-9) + 1
    if n > MAX_POINTS:
        raise UserError(
            f"{option} {text} is {n} values, more than {MAX_POINTS}; take a larger step"
            + (" (a bare number is MiB)" if axis == "budget" else "")
        )
    values = [lo + i * step for i in range(n)]
    if axis != "pcie":  # bytes and tokens are whole
        values = [int(round(v)) for v in values]
    return Axis(axis, tuple(values))


EXAMPLES = {"budget": "4GiB..24GiB:2GiB", "ctx": "2048..16384:2048", "pcie": "8..32:8"}


def _number(option: str, text: str, part: str, units: dict, axis: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([a-zA-Z/]*)", part)
    if not m:
        raise UserError(f"{option} {text}: cannot read {part!r} as a number")
    unit = m.group(2).lower()
    if unit not in units:
        known = [u for u in ("GiB", "MiB", "GB", "MB") if u.lower() in units]
        say = f"units: {', '.join(known)}; a bare number is MiB" if known else "write bare numbers"
        raise UserError(f"{option} {text}: unknown unit {m.group(2)!r} ({say})")
    if axis == "ctx" and "." in m.group(1):
        raise UserError(f"{option} {text}: a context is a whole number of tokens")
    return float(m.group(1)) * units[unit]


@dataclass(frozen=True)
class Figures:
    """One placement's predictions in a row."""

    name: str  # optimal, not-needed (everything pinned), fit, or a pshard strategy
    ttft_seconds: float
    tps: float
    e2e_seconds: float

    @classmethod
    def of(cls, o: Outcome) -> "Figures":
        p: Prediction = o.prediction
        return cls(o.name, p.ttft_seconds, p.tps, p.e2e_seconds)


@dataclass(frozen=True)
class Row:
    value: float  # on the axis: bytes, tokens or GB/s
    optimal: Figures | None = None  # None: refused
    fit: Figures | None = None
    pshard: Figures | None = None  # the best of pshard's strategies by the objective
    refused: str = ""  # why there is no plan at this value (the request's one-line refusal)
    budgets: tuple[int, ...] = ()  # bytes per device, after the reserve
    gap: float | None = None  # the solver's relative gap (None: no program was solved)
    wall_seconds: float = 0.0

    @property
    def named_best(self) -> Figures | None:
        """The better of fit and pshard's best, end to end."""
        named = [f for f in (self.fit, self.pshard) if f is not None]
        return min(named, key=lambda f: f.e2e_seconds) if named else None


def with_pcie(profile: HardwareProfile, gbps: float) -> HardwareProfile:
    """`profile` with every GPU's host -> device copy at `gbps`; device -> host and the copy while
    the CPU computes keep their ratios to it."""

    def scaled(f: Figure, factor: float) -> Figure:
        return Figure(f.value * factor, f"derived: {f.source} scaled to {gbps:g} GB/s H2D (sweep)")

    gpus = []
    for g in profile.gpus:
        k = gbps / g.h2d_gbps.value
        busy = scaled(g.h2d_gbps_while_cpu_computes, k)
        gpus.append(replace(g, h2d_gbps=scaled(g.h2d_gbps, k), d2h_gbps=scaled(g.d2h_gbps, k),
                            h2d_gbps_while_cpu_computes=busy))  # fmt: skip
    return replace(profile, gpus=tuple(gpus))


def sweep(
    spec: ModelSpec,
    profile: HardwareProfile,
    w: Workload,
    axis: Axis,
    *,
    prompt_fills: bool = True,
    budget: str | None = None,
    reserve: str = "0",
    tiers: str | None = None,
    objective: str = "e2e",
    time_limit_seconds: float = SWEEP_SOLVER_SECONDS,
    target: str = "refengine",
    on_row: Callable[[Row], None] | None = None,
) -> list[Row]:
    """One row per value of `axis`; the other axes as `w`, `budget` and `profile` say. On the ctx
    axis the prompt fills each context less the generated tokens when `prompt_fills`, else stays
    `w.prompt_tokens`. `budget`/`reserve`/`tiers` are written as `solve` takes them."""
    rows = []
    for value in axis.values:
        row_budget, row_profile, row_w = budget, profile, w
        try:
            if axis.name == "budget":
                row_budget = f"{value / 2**20:.6f}MiB"  # as --budget reads it
            elif axis.name == "pcie":
                row_profile = with_pcie(profile, value)
            else:
                row_w = request_workload(
                    profile, int(value), w.users, None if prompt_fills else w.prompt_tokens,
                    w.gen_tokens, w.kv_type, w.flash_attn, w.threads, w.unified,
                )  # fmt: skip
            solved = solve_request(spec, row_profile, row_w, tiers, row_budget, reserve,
                                   objective, None, time_limit_seconds, target)  # fmt: skip
        except UserError as e:
            row = Row(value, refused=str(e))
        else:
            pshard = [b for b in solved.baselines if b.name in PSHARD_NAMES]
            best = min(pshard, key=lambda b: b.prediction.objective(objective))
            fit = next(b for b in solved.baselines if b.name == "fit")
            row = Row(
                value,
                Figures.of(solved.chosen),
                Figures.of(fit),
                Figures.of(best),
                budgets=tuple(solved.budgets.bytes),
                gap=solved.facts.get("gap"),
                wall_seconds=solved.facts.get("wall_seconds", 0.0),
            )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def gains(axis: Axis, rows: list[Row]) -> list[float | None]:
    """End-to-end seconds the optimizer saves per unit of the axis (per GiB, per GB/s) against
    the previous planned row; None for the first planned row and refused rows."""
    out, prev = [], None
    for r in rows:
        if r.optimal is None:
            out.append(None)
            continue
        out.append(
            None
            if prev is None
            else (prev.optimal.e2e_seconds - r.optimal.e2e_seconds)
            / (axis.shown(r.value) - axis.shown(prev.value))
        )
        prev = r
    return out


def write_png(axis: Axis, rows: list[Row], path: str | Path, title: str) -> None:
    """TTFT, TPS and end-to-end seconds against the axis, one line per placement (optimal, fit,
    pshard's best); refused values are left out of the lines and marked on the axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = [r for r in rows if r.optimal is not None]
    xs = [axis.shown(r.value) for r in planned]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = (("TTFT, s", "ttft_seconds"), ("decode, tokens/s", "tps"),
              ("end to end, s", "e2e_seconds"))  # fmt: skip
    lines = (("optimal", "optimal", "tab:blue", "o"), ("fit", "llama.cpp fit", "tab:orange", "s"),
             ("pshard", "pshard best", "tab:green", "^"))  # fmt: skip
    for ax, (label, field) in zip(axes, panels):
        for attr, name, color, marker in lines:
            ys = [getattr(getattr(r, attr), field) for r in planned]
            ax.plot(xs, ys, marker=marker, color=color, label=name)
        for r in rows:
            if r.optimal is None:
                ax.axvline(axis.shown(r.value), color="tab:red", alpha=0.3, linestyle=":")
        ax.set_xlabel(f"{axis.name} ({axis.unit})")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100, format="png")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
    finally:
        plt.close(fig)
