"""`refengine bench-kernels`: kernel rates beside the ceilings measured in the same run
(`cudarun.bench_report`)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UserError
from . import THREADS_CHECK, cli, open_for_writing


def _names(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(t.strip().upper() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in known]
    if bad:
        raise UserError(f"unknown type {bad[0]}: choose from {','.join(known)}")
    return names


@cli.command("bench-kernels")
@click.option("--cpu/--no-cpu", default=True, show_default=True, help="Benchmark the CPU kernels.")
@click.option("--gpu/--no-gpu", default=None, help="Benchmark the GPU (default: when one is here).")
@click.option("--types", help="Comma-separated types (default: all the kernels read).")
@click.option("--tokens", default="1,4", show_default=True, help="CPU token counts.")
@click.option(
    "--threads", type=int, default=0, callback=THREADS_CHECK, help="CPU threads (default: all)."
)
@click.option(
    "--peer",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="llama.cpp's CPU rates from scripts/llamacpp_cpu_rate.py, printed beside ours.",
)
@click.option("--quick", is_flag=True, help="One small shape, fewer runs: seconds, not minutes.")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Also write the tables."
)
def bench_kernels(cpu, gpu, types, tokens, threads, peer, quick, output) -> None:
    """Kernel rates next to the ceilings measured in the same run (and llama.cpp's, --peer)."""
    from rich.progress import Progress

    from cudarun import bench_report
    from cudarun.driver import gpu_present

    peer_rates = bench_report.load_peer(peer)
    counts = tuple(int(n) for n in tokens.split(","))
    if gpu is None:
        gpu = gpu_present()
    elif gpu and not gpu_present():
        raise UserError(
            "no NVIDIA GPU here to benchmark: leave out --gpu (the CPU table runs alone)"
        )
    tables = []
    with Progress(transient=True) as bar:
        task = bar.add_task("benchmarking", total=None)

        def step(what: str) -> None:
            bar.update(task, description=what)

        if cpu:
            names = _names(types, bench_report.CPU_TYPES) if types else bench_report.CPU_TYPES
            shapes = ((1024, 4096),) if quick else bench_report.SHAPES
            counts_cpu = counts[:1] if quick else counts
            tables.append(
                bench_report.cpu_table(names, shapes, counts_cpu, threads, peer_rates, quick, step)
            )
        if gpu:
            names = _names(types, bench_report.GPU_TYPES) if types else bench_report.GPU_TYPES
            tables.append(bench_report.gpu_table(names, (1, 16), step))
    text = "\n".join(bench_report.render(t) for t in tables)
    click.echo(text)
    if output:
        with open_for_writing(output) as out:
            out.write(text.encode())
