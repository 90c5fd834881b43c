"""`refengine verify`: a llamacpp plan run by real llama.cpp (`solver.llamacpp_check`), where each
tensor went and each device's memory beside the plan's."""

from __future__ import annotations

from pathlib import Path

import click

from ..models import load_model_or_shape, resolve_model
from .base import cli

MIB = 1 << 20


@cli.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--llama-bin", type=click.Path(file_okay=False, path_type=Path),
              help="llama.cpp's bin directory (default: scripts/build_llamacpp.sh's, in the cache).")
@click.option("--model", "model_arg", help="The GGUF to load (default: the plan's).")
@click.option("--rpc", help="host:port,... llama.cpp RPC servers standing in for the plan's local "
              "GPUs, in order (the RPC servers a plan was solved for it names itself).")  # fmt: skip
def verify(plan_path: Path, llama_bin: Path | None, model_arg: str | None, rpc: str | None) -> None:
    """Run PLAN's exported flags in llama.cpp (one token, verbose) and check them: every tensor on
    the device the plan says, and each device's model, KV and compute buffers beside the plan's.
    Exits 1 when a tensor sits elsewhere, or a device goes above its budget or off the plan by
    more than 3% + 4 MiB."""
    from rich.console import Console
    from rich.table import Table

    from solver.llamacpp_check import ABS_TOLERANCE_BYTES, REL_TOLERANCE, verify_plan
    from solver.plan import load_plan, plan_model

    d = load_plan(plan_path)
    model = model_arg or plan_model(d)
    spec = load_model_or_shape(model)
    path = str(resolve_model(model))
    from cudarun.rpc_client import parse_endpoints

    endpoints = parse_endpoints(rpc) if rpc is not None else None
    verdict, args = verify_plan(d, spec, path, llama_bin, endpoints)
    click.echo("llama.cpp flags: " + " ".join(args))
    table = Table(title="device memory, MiB")
    for col in ("device", "", "model", "KV", "compute", "total", "budget", "verdict"):
        table.add_column(col, justify="left" if col in ("device", "", "verdict") else "right")
    for r in verdict.rows:
        verdict_text = ("over budget" if not r.within_budget
                        else "ok" if r.within_tolerance else "off plan")  # fmt: skip
        for what, b in (("plan", r.planned), ("llama.cpp", r.measured)):
            sizes = (b.model_bytes, b.kv_bytes, b.compute_bytes, b.total_bytes)
            table.add_row(r.device if what == "plan" else "", what,
                          *(f"{n / MIB:.1f}" for n in sizes),
                          f"{r.budget_bytes / MIB:.0f}" if what == "plan" else "",
                          verdict_text if what == "plan" else "")  # fmt: skip
    Console(width=100).print(table)
    click.echo(f"off plan: more than {REL_TOLERANCE:.0%} + {ABS_TOLERANCE_BYTES / MIB:.0f} MiB")
    for name, want, got in verdict.misplaced:
        click.echo(f"misplaced: {name} planned on {want}, llama.cpp put it on {got}")
    placed = len(spec.tensors) - len(verdict.misplaced)
    click.echo(f"tensors placed as planned: {placed}/{len(spec.tensors)}")
    for r in verdict.rows:
        if r.problem():
            click.echo(f"error: {r.problem()}", err=True)
    if not verdict.ok:
        raise SystemExit(1)
