"""`refengine sweep`: one `solve` request over a range of budgets, contexts or PCIe bandwidths
(`solver.sweep.sweep`), printed as a table of the optimizer, llama.cpp's fit and pshard's best,
and drawn as a PNG (`solver.sweep.write_png`)."""

from __future__ import annotations

import time
from pathlib import Path

import click

from .. import defaults
from ..errors import UserError
from ..models import load_model_or_shape, shape_argument
from .base import THREADS_CHECK, USERS_CHECK, cli

OPTIMIZER_SLOWER = 1e-3  # relative: below the solver's own gap target, a tie


@cli.command()
@click.argument("model", required=False)
@click.option("--arch", help="Spec-only model: architecture in the shape table (shapes.json).")
@click.option("--params", help="Spec-only model: size in the shape table, e.g. 70B or 30B-A3B.")
@click.option("--qtype", help="Spec-only model: matrix type, e.g. Q4_K_M (llama.cpp's mix), Q8_0.")
@click.option("--budget", help="LO..HI:STEP to sweep (4GiB..24GiB:2GiB, GPU 0 alone), or one "
              "budget as solve takes it. Default: the profile's GPU memory minus 1024 MiB.")
@click.option("--ctx", "ctx", default=str(defaults.N_CTX), show_default=True,
              help="Context in tokens, or LO..HI:STEP to sweep (2048..16384:2048).")
@click.option("--pcie-gbps", help="Host -> GPU copy rate in GB/s (device -> host keeps the "
              "profile's ratio), or LO..HI:STEP to sweep (8..32:8). Default: the profile's.")
@click.option("--reserve", default="0", show_default=True,
              help="Subtracted from the budget: one size for every device, or one per device.")
@click.option("--profile", "profile_name", help="A profile file, or a shipped profile's name.")
@click.option("--tiers", help="Tokens per ubatch to plan for, e.g. 1,16,512 (default: PSHARD's).")
@click.option("--users", default=defaults.USERS, show_default=True, callback=USERS_CHECK)
@click.option("--prompt-tokens", type=int, help="Default: ctx - gen tokens, at each context.")
@click.option("--gen-tokens", default=defaults.GEN_TOKENS, show_default=True)
@click.option("--target", type=click.Choice(["refengine", "llamacpp"]), default="refengine",
              show_default=True, help="As solve's: llamacpp plans what llama.cpp's flags can say.")
@click.option("--objective", type=click.Choice(["e2e", "tps", "ttft"]), default="e2e",
              show_default=True)
@click.option("--kv-type", type=click.Choice(["f16", "q8_0"]), default=defaults.KV_TYPE,
              show_default=True)
@click.option("--fa", type=click.Choice(["on", "off"]),
              default="on" if defaults.FLASH_ATTN else "off", show_default=True)
@click.option("--threads", default=defaults.THREADS, show_default=True, callback=THREADS_CHECK,
              help="0: the profile's.")
@click.option("--time-limit", type=float, default=None,
              help="Solver effort per value, in CP-SAT's deterministic seconds (default 1, "
              "solver.sweep.SWEEP_SOLVER_SECONDS: about 1.3 s a value on two cores; solve: 6).")
@click.option("--png", type=click.Path(dir_okay=False, path_type=Path),
              help="Also draw TTFT, TPS and end-to-end time against the swept axis here.")
def sweep(model, arch, params, qtype, budget, ctx, pcie_gbps, reserve, profile_name, tiers, users,
          prompt_tokens, gen_tokens, target, objective, kv_type, fa, threads, time_limit,
          png) -> None:  # fmt: skip
    """What each GiB buys, before anything is loaded: solve MODEL (as `solve` takes it) at each
    value of ONE swept axis — --budget, --ctx or --pcie-gbps written LO..HI:STEP, both ends
    included; the other two stay fixed — and print the predicted TTFT, decode TPS and end-to-end
    time of the optimizer, llama.cpp's --fit and the best of pshard's strategies per value. A value
    with no plan (a budget below the minimum) is a row that says why. Each value is one solve with
    a short time limit (--time-limit)."""
    from rich.console import Console
    from rich.markup import escape

    from solver.budget import device_budgets, parse_tiers
    from solver.solve import load_profile, request_workload
    from solver.sweep import SWEEP_SOLVER_SECONDS, is_range, parse_range, sweep, with_pcie
    from solver.sweep import write_png
    from solver.targets import traits

    ranges = {name: text for name, text in (("budget", budget), ("ctx", ctx),
                                             ("pcie", pcie_gbps)) if is_range(text)}  # fmt: skip
    if len(ranges) != 1:
        raise UserError(
            (f"sweep one axis at a time ({' and '.join(ranges)} are both ranges)" if ranges
             else "nothing to sweep: write one of --budget, --ctx, --pcie-gbps as LO..HI:STEP")
            + ", e.g. --budget 4GiB..24GiB:2GiB, --ctx 2048..16384:2048 or --pcie-gbps 8..32:8"
        )  # fmt: skip
    (name, text), = ranges.items()  # fmt: skip
    axis = parse_range(name, text)
    spec = load_model_or_shape(shape_argument(model, arch, params, qtype))
    prof = load_profile(profile_name)
    if pcie_gbps and name != "pcie":
        prof = with_pcie(prof, _positive(pcie_gbps, "--pcie-gbps", float))
    # what holds at every value is refused once, up front; what depends on it is a row
    device_budgets(None if name == "budget" else budget, reserve, prof)
    if tiers:
        parse_tiers(tiers)
    n_ctx = max(axis.values) if name == "ctx" else _positive(ctx, "--ctx", int)
    w = request_workload(prof, int(n_ctx), users, prompt_tokens, gen_tokens, kv_type, fa == "on",
                         threads)  # fmt: skip
    seconds = SWEEP_SOLVER_SECONDS if time_limit is None else time_limit
    if seconds <= 0:
        raise UserError(f"--time-limit takes seconds above zero, not {time_limit:g}")
    con = Console(width=max(Console().width, 100))
    default_budget = "the profile's GPU memory - 1024 MiB"
    fixed = [f"budget {budget or default_budget}" if name != "budget" else "",
             f"ctx {n_ctx}" if name != "ctx" else "",
             f"prompt {prompt_tokens or 'fills ctx - ' + str(gen_tokens)}",
             f"generate {gen_tokens}", f"users {users}",
             f"PCIe {prof.gpus[0].h2d_gbps.value:g} GB/s" if name != "pcie" else ""]  # fmt: skip
    heading = f"{spec.name} on {prof.name}: " + ", ".join(f for f in fixed if f)
    con.print(f"[bold]{heading}[/]", soft_wrap=True)

    started = time.monotonic()
    rows = sweep(spec, prof, w, axis, prompt_fills=prompt_tokens is None, budget=budget,
                 reserve=reserve, tiers=tiers, objective=objective, time_limit_seconds=seconds,
                 target=target, on_row=lambda r: click.echo(
                     f"  {name} {_value(axis, r.value)}: "
                     + ("refused" if r.optimal is None else f"{r.optimal.e2e_seconds:.2f} s e2e"),
                     err=True))  # fmt: skip
    wall = time.monotonic() - started
    con.print(sweep_table(axis, rows))
    for r in rows:
        if r.optimal is None:
            con.print(f"no plan at {_value(axis, r.value)} {axis.unit}: {escape(r.refused)}")
    slower = [r for r in rows if optimizer_slower(r)]
    gaps = [r.gap for r in rows if r.gap is not None]
    con.print(
        f"solver: {seconds:g} deterministic s a value (--time-limit)"
        + (f", largest gap {max(gaps):.1%}" if gaps else "")
        + f"; {len(rows)} values in {wall:.1f} s"
    )
    if slower:
        con.print(
            f"[red]the optimizer is slower end to end than a named placement at "
            f"{', '.join(_value(axis, r.value) for r in slower)} {axis.unit}[/]"
            + ("; pshard's strategies run on our runtime, a llamacpp plan on llama.cpp with its "
               "own memory terms" if traits(target).llamacpp_flags else "")
        )  # fmt: skip
    if png:
        write_png(axis, rows, png, heading)
        con.print(f"wrote {png}")


def _positive(text: str, option: str, kind):
    try:
        v = kind(text)
    except ValueError:
        raise UserError(f"{option} takes a number or a range LO..HI:STEP, not {text!r}") from None
    if v <= 0:
        raise UserError(f"{option} takes a number above zero, not {text}")
    return v


def _value(axis, value: float) -> str:
    v = axis.shown(value)
    return f"{v:.2f}" if axis.unit == "GiB" else f"{v:g}"


def optimizer_slower(row) -> bool:
    best = row.named_best
    return (
        row.optimal is not None
        and best is not None
        and row.optimal.e2e_seconds > best.e2e_seconds * (1 + OPTIMIZER_SLOWER)
    )


def sweep_table(axis, rows):
    """Three lines a value: the optimizer, fit and pshard's best, each against the optimizer."""
    from rich.table import Table

    from solver.sweep import gains

    t = Table(title="predicted, same cost model (vs optimal: end-to-end time over the optimizer's)")
    t.add_column(f"{axis.name} {axis.unit}", justify="right")
    t.add_column("placement")
    for col in ("TTFT s", "TPS", "end-to-end s", "vs optimal"):
        t.add_column(col, justify="right")
    per = axis.unit if axis.name in ("budget", "pcie") else None  # more context is more work
    if per:
        t.add_column(f"saved s/{per}", justify="right")
    for r, gain in zip(rows, gains(axis, rows)):
        value = _value(axis, r.value)
        if r.optimal is None:
            t.add_row(value, "[red]no plan (below)[/]", end_section=True)
            continue
        lines = [("optimal" if r.optimal.name == "optimal" else "optimal (all pinned)",
                  r.optimal), ("fit", r.fit), (r.pshard.name, r.pshard)]  # fmt: skip
        for i, (label, f) in enumerate(lines):
            ratio = f.e2e_seconds / r.optimal.e2e_seconds
            vs = f"{ratio:.2f}x" if i else ""
            if i and ratio < 1 - OPTIMIZER_SLOWER:
                vs = f"[red]{ratio:.3f}x[/]"
            cells = [value if i == 0 else "", label, f"{f.ttft_seconds:.2f}", f"{f.tps:.2f}",
                     f"{f.e2e_seconds:.2f}", vs]  # fmt: skip
            if per:
                cells.append(f"{gain:.3g}" if i == 0 and gain is not None else "")
            t.add_row(*cells, end_section=i == len(lines) - 1)
    return t
