"""`refengine bench-kernels`: kernel rates beside the ceilings measured in the same run
(`cudarun.bench_report`)."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UserError
from .base import THREADS_CHECK, cli, open_for_writing


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
    """Kernel rates next to the ceilings measured in the same run (and llama.cpp's, --peer).
    Each row is printed to stderr (and appended to -o) as soon as it is measured, the tables at
    the end: a run cut short by a time limit keeps what it measured."""
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
    runs = []  # (title, columns, rows): the GPU's first, the figure a lent GPU is for
    if gpu:
        names = _names(types, bench_report.GPU_TYPES) if types else bench_report.GPU_TYPES
        runs.append(("GPU kernels and transfers (median of 5 runs of 100 launches)",
                     bench_report.GPU_COLUMNS, bench_report.gpu_rows(names, (1, 16))))  # fmt: skip
    if cpu:
        names = _names(types, bench_report.CPU_TYPES) if types else bench_report.CPU_TYPES
        shapes = ((1024, 4096),) if quick else bench_report.SHAPES
        counts_cpu = counts[:1] if quick else counts
        runs.append((f"CPU kernels, {threads or 'all'} threads", bench_report.CPU_COLUMNS,
                     bench_report.cpu_rows(names, shapes, counts_cpu, threads, peer_rates,
                                           quick)))  # fmt: skip
    log = open_for_writing(output) if output else None
    tables = []
    try:
        for title, columns, rows in runs:
            kept = []
            _progress(log, f"{title}: {' | '.join(columns)}")
            for row in rows:
                kept.append(row)
                _progress(log, " | ".join(row))
            tables.append(bench_report.table(title, columns, kept))
        text = "\n".join(bench_report.render(t) for t in tables)
        click.echo(text)
        if log:
            log.write(("\n" + text + "\n").encode())
    finally:
        if log:
            log.close()


def _progress(log, line: str) -> None:
    click.echo(line, err=True)
    if log:
        log.write((line + "\n").encode())
        log.flush()
