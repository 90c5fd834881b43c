"""`refengine bench-kernels`: the kernel benchmark tables, measured next to the ceilings of the
same run and, for the CPU, next to llama.cpp's decode rate on this machine (`--peer`, written by
scripts/llamacpp_cpu_rate.py)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from refengine.errors import UserError
from refengine.quants import CUDA, supported

from . import bench_cpu

# the types with a CPU decode kernel (int8 rows, and F16's fp16 rows); every type the CUDA engine
# supports
CPU_TYPES = (*(q.name for q in bench_cpu.cpu.Q8_ROWS), "F16")
GPU_TYPES = tuple(q.name for q in supported(CUDA))
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


CPU_COLUMNS = ("type", "path", "shape", "tokens", "ms", "GB/s", "of read", "llama.cpp GB/s",
               "ratio")  # fmt: skip
GPU_COLUMNS = ("what", "us", "value", "unit", "ceiling", "of ceiling")


def cpu_rows(types, shapes, tokens, threads: int, peer: dict, quick: bool):
    """The CPU table's rows, each yielded as soon as it is measured: the host read ceiling, then
    each type, shape and token count."""
    runs = 2 if quick else 9
    read_nbytes = 2 * bench_cpu.last_level_cache_nbytes() if quick else bench_cpu.GIB
    ceiling = bench_cpu.host_read_gbps(threads, read_nbytes, runs)
    yield ("read", "numba parallel", f"{read_nbytes >> 20} MiB", "", "", f"{ceiling:.1f}", "1.00",
           "", "")  # fmt: skip
    for name in types:
        for shape in shapes:
            for n in tokens:
                r = bench_cpu.matmul_rate(name, shape, n, threads, runs)
                theirs = peer.get(name) if n == 1 else None
                yield (
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


def gpu_rows(types, tokens, failed=None):
    """The GPU table's rows, each yielded as soon as it is measured (`bench_gpu.run_all`)."""
    from . import bench_gpu

    for r in bench_gpu.run_all(types, tokens, failed=failed):
        yield (
            r.what,
            f"{r.seconds * 1e6:.1f}",
            f"{r.value:.2f}",
            r.unit,
            f"{r.ceiling:.1f}" if r.ceiling else "",
            f"{r.fraction:.2f}" if r.ceiling else "",
        )


def table(title: str, columns: tuple[str, ...], rows) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col, justify="left" if col in ("type", "path", "what") else "right")
    for row in rows:
        t.add_row(*row)
    return t


def render(table: Table) -> str:
    console = Console(width=140, record=True, file=open("/dev/null", "w"))
    console.print(table)
    return console.export_text()
