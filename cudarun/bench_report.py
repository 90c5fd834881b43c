"""`refengine bench-kernels`: the kernel benchmark tables, measured next to the ceilings of the
same run and, for the CPU, next to llama.cpp's decode rate on this machine (`--peer`, written by
scripts/llamacpp_cpu_rate.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from refengine.errors import UserError

from . import bench_cpu

CPU_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16")
GPU_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
SHAPES = ((4096, 14336), (14336, 4096))


def load_peer(path: Path | None) -> dict:
    """{type: llama.cpp weight GB/s} from the peer script's JSON ({} without one)."""
    if path is None:
        return {}
    try:
        data = json.loads(Path(path).read_text())
        return {t: float(v["weight_gbps"]) for t, v in data["types"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{path}: not a peer file of scripts/llamacpp_cpu_rate.py ({e}); run that script"
        ) from None


def cpu_table(types, shapes, tokens, threads: int, peer: dict, quick: bool, progress) -> Table:
    runs = 2 if quick else 9
    progress("host read ceiling")
    read_nbytes = 2 * bench_cpu.last_level_cache_nbytes() if quick else bench_cpu.GIB
    ceiling = bench_cpu.host_read_gbps(threads, read_nbytes, runs)
    table = Table(title=f"CPU kernels, {threads or 'all'} threads")
    for col in (
        "type",
        "path",
        "shape",
        "tokens",
        "ms",
        "GB/s",
        "of read",
        "llama.cpp GB/s",
        "ratio",
    ):
        table.add_column(col, justify="left" if col in ("type", "path") else "right")
    table.add_row(
        "read",
        "numba parallel",
        f"{read_nbytes >> 20} MiB",
        "",
        "",
        f"{ceiling:.1f}",
        "1.00",
        "",
        "",
    )
    for name in types:
        for shape in shapes:
            for n in tokens:
                progress(f"CPU {name} {shape[0]}x{shape[1]} x{n}")
                r = bench_cpu.matmul_rate(name, shape, n, threads, runs)
                theirs = peer.get(name) if n == 1 else None
                table.add_row(
                    name,
                    r.path,
                    f"{shape[0]}x{shape[1]}",
                    str(n),
                    f"{r.seconds * 1e3:.2f}",
                    f"{r.gbps:.2f}",
                    f"{r.gbps / ceiling:.2f}",
                    f"{theirs:.2f}" if theirs else "",
                    f"{r.gbps / theirs:.2f}" if theirs else "",
                )
    return table


def gpu_table(types, tokens, progress) -> Table:
    from . import bench_gpu

    rates = bench_gpu.run_all(types, tokens, progress=progress)
    table = Table(title="GPU kernels and transfers (median of 5 runs of 100 launches)")
    for col in ("what", "us", "value", "unit", "ceiling", "of ceiling"):
        table.add_column(col, justify="left" if col == "what" else "right")
    for r in rates:
        table.add_row(
            r.what,
            f"{r.seconds * 1e6:.1f}",
            f"{r.value:.2f}",
            r.unit,
            f"{r.ceiling:.1f}" if r.ceiling else "",
            f"{r.fraction:.2f}" if r.ceiling else "",
        )
    return table


def render(table: Table) -> str:
    console = Console(width=140, record=True, file=open("/dev/null", "w"))
    console.print(table)
    return console.export_text()
