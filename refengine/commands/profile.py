"""`refengine profile`: this machine measured into a hardware profile (`cudarun.measure`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import UserError
from . import THREADS_CHECK, cli, open_for_writing


@cli.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the profile (JSON).",
)
@click.option(
    "--gpu-from",
    metavar="PROFILE",
    help="A profile (a file, or a shipped name) whose GPU side to keep instead of measuring one "
    "(required without a GPU).",
)
@click.option("--threads", type=int, callback=THREADS_CHECK, help="CPU threads (default: all).")
@click.option("--quick", is_flag=True, help="Small shapes and short runs: seconds, not minutes.")
def profile(output: Path, gpu_from: str | None, threads: int | None, quick: bool) -> None:
    """Measure this machine (its GPU, when there is one, and its CPU) into a hardware profile."""
    from rich.progress import Progress

    from cudarun.driver import gpu_present
    from cudarun.measure import measure_profile
    from solver.solve import load_profile

    if gpu_from is None and not gpu_present():
        raise UserError(
            "no NVIDIA GPU here to measure: pass --gpu-from PROFILE (a file, or a shipped "
            "name such as h100) to keep its GPU figures"
        )
    base = load_profile(gpu_from) if gpu_from else None
    out = open_for_writing(output)
    with Progress(transient=True) as bar:
        task = bar.add_task("profiling", total=None)
        prof = measure_profile(base, threads, quick,
                               lambda what: bar.update(task, description=what))  # fmt: skip
    with out:
        out.write(json.dumps(prof.to_json(), indent=1).encode() + b"\n")
    cpu, gpus = prof.cpu, prof.gpus
    click.echo(
        f"wrote {output}: host memory {cpu.memory_gbps.value:.1f} GB/s, Q4_K matvec "
        f"{cpu.matvec_gbps.at('Q4_K', cpu.threads):.2f} GB/s"
        + (
            f"; GPU {gpus[0].name}: HBM {gpus[0].hbm_gbps.value:.0f} GB/s, H2D "
            f"{gpus[0].h2d_gbps.value:.1f} GB/s"
            if base is None
            else ""
        )
    )
