"""`refengine profile`: this machine measured into a hardware profile (`cudarun.measure`), and
llama.cpp RPC servers as devices of it (`cudarun.measure_rpc`)."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import click

from ..errors import UserError
from .base import THREADS_CHECK, cli, open_for_writing


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
    "(without a GPU here: this, or --rpc).",
)
@click.option("--threads", type=int, callback=THREADS_CHECK, help="CPU threads (default: all).")
@click.option("--quick", is_flag=True, help="Small shapes and short runs: seconds, not minutes.")
@click.option(
    "--rpc",
    metavar="HOST:PORT,...",
    help="llama.cpp RPC servers (ggml-rpc-server) to measure as devices of the profile, after "
    "its local GPUs: each one's link both ways, round trip, memory and what it computes.",
)
@click.option(
    "--cpu-from",
    metavar="PROFILE",
    help="A profile (a file, or a shipped name) whose CPU side to keep instead of measuring "
    "this one's (with --rpc: only the servers are measured).",
)
@click.option(
    "--llama-bin",
    type=click.Path(file_okay=False, path_type=Path),
    help="A llama.cpp build's bin folder: measure its CPU backend's own rates too (llama-bench on "
    "a synthetic model per type), which `solve --target llamacpp` prices CPU-held matrices at.",
)
def profile(output: Path, gpu_from: str | None, threads: int | None, quick: bool,
            rpc: str | None, cpu_from: str | None, llama_bin: Path | None) -> None:  # fmt: skip
    """Measure this machine (its GPU, when there is one, and its CPU) into a hardware profile,
    and llama.cpp RPC servers (--rpc) as further devices."""
    from cudarun.driver import gpu_present
    from cudarun.rpc_client import parse_endpoints
    from solver.solve import load_profile

    endpoints = parse_endpoints(rpc) if rpc is not None else []
    local_gpu = gpu_from is not None or gpu_present()
    if not local_gpu and not endpoints:
        raise UserError(
            "no NVIDIA GPU here to measure: pass --gpu-from PROFILE (a file, or a shipped "
            "name such as h100) to keep its GPU figures, or --rpc HOST:PORT,... to measure "
            "llama.cpp RPC servers as the devices"
        )
    base = load_profile(gpu_from) if gpu_from else None
    llama_bench = None
    if llama_bin is not None:
        from solver.llamacpp_check import llama_binary

        llama_bench = llama_binary(llama_bin, "llama-bench")
    out = open_for_writing(output)  # an unwritable path refused before any measuring
    try:
        prof, servers = _measure(base, local_gpu, endpoints, cpu_from, threads, quick)
        if llama_bench is not None:
            prof = _with_llamacpp(prof, llama_bench, quick)
    except BaseException:  # no empty profile left behind where a server did not answer
        out.close()
        output.unlink(missing_ok=True)
        raise
    with out:
        out.write(json.dumps(prof.to_json(), indent=1).encode() + b"\n")
    _summary(output, prof, servers, base, local_gpu, cpu_from)


@contextmanager
def _phases(first: str):
    """A callback naming each phase of the measuring: a bar on a terminal; in a log (a profile
    runs for half an hour, often under nohup), a line a phase on stderr with the time it began."""
    from rich.console import Console
    from rich.progress import Progress

    if Console().is_terminal:
        with Progress(transient=True) as bar:
            task = bar.add_task(first, total=None)
            yield lambda what: bar.update(task, description=what)
        return

    def say(what: str) -> None:  # (none before the first phase: a refusal stays one line)
        click.echo(f"{time.strftime('%H:%M:%S')} {what}", err=True)

    yield say


def _with_llamacpp(prof, llama_bench: Path, quick: bool):
    """The profile with llama.cpp's CPU rows, on the threads its CPU side was measured at."""
    from cudarun.measure_llamacpp import measure_llamacpp_cpu

    with _phases("llama.cpp") as say:
        rows = measure_llamacpp_cpu(llama_bench, prof.cpu.threads, quick, say)
    return replace(prof, cpu=replace(prof.cpu, **rows))


def _measure(base, local_gpu: bool, endpoints: list[str], cpu_from: str | None,
             threads: int | None, quick: bool):  # fmt: skip
    """(the profile, [(device, link, compute) of each RPC server])."""
    from cudarun.measure_rpc import measure_rpc_device
    from cudarun.rpc_client import RpcClient
    from solver.profile import HardwareProfile, with_rpc_devices
    from solver.solve import load_profile

    with _phases("profiling") as say:
        # the servers first, each greeted before any is measured: one that does not answer is
        # refused before minutes of measuring
        for e in endpoints:
            RpcClient(e).close()
        servers = [measure_rpc_device(e, quick, say) for e in endpoints]
        if cpu_from is not None:  # the CPU side kept: at most a GPU here is measured
            cpu = load_profile(cpu_from).cpu
            if base is not None or not local_gpu:
                gpus = base.gpus if base is not None else ()
            else:
                from cudarun.measure_gpu import measure_gpu

                gpu, sync = measure_gpu(quick, say)
                gpus, cpu = (gpu,), replace(cpu, sync_seconds=sync)
            names = [cpu.name] + ([base.gpu_side_name if base else gpus[0].name] if gpus else [])
            prof = HardwareProfile(name=" + ".join(names), gpus=gpus, cpu=cpu,
                                   notes=base.notes if base else "")  # fmt: skip
        elif local_gpu:
            from cudarun.measure import measure_profile

            prof = measure_profile(base, threads, quick, say)
        else:  # RPC servers are the only devices: the CPU alone is measured here
            from cudarun.measure_cpu import measure_cpu

            shape = (1024, 1024) if quick else (4096, 4096)  # as cudarun.measure's
            cpu = measure_cpu(threads, shape, quick, say)
            prof = HardwareProfile(name=cpu.name, gpus=(), cpu=cpu)
    if servers:
        prof = with_rpc_devices(prof, tuple(dev for dev, _, _ in servers))
        prof = replace(prof, name=f"{prof.name} + {len(servers)} RPC")
    return prof, servers


def _summary(output: Path, prof, servers, base, local_gpu: bool, cpu_from: str | None) -> None:
    cpu, gpus = prof.cpu, prof.gpus
    click.echo(
        f"wrote {output}: host memory {cpu.memory_gbps.value:.1f} GB/s, Q4_K matvec "
        f"{cpu.matvec_gbps.at('Q4_K', cpu.threads):.2f} GB/s"
        + (" (kept from " + cpu_from + ")" if cpu_from else "")
        + (
            f"; GPU {gpus[0].name}: HBM {gpus[0].hbm_gbps.value:.0f} GB/s, H2D "
            f"{gpus[0].h2d_gbps.value:.1f} GB/s"
            if base is None and local_gpu
            else ""
        )
    )
    first_rpc = len(prof.gpus) - len(servers)
    for d, (dev, link, compute) in enumerate(servers, start=first_rpc):
        click.echo(
            f"device {d} {dev.name} (llama.cpp RPC{d - first_rpc}): "
            f"{link.total_bytes / 2**30:.1f} GiB, link {link.h2d_gbps:.2f} GB/s up, "
            f"{link.d2h_gbps:.2f} down, round trip {link.latency_seconds * 1e3:.3f} ms; Q4_K "
            f"matvec {compute.matvec_gbps['Q4_K']:.1f} GB/s, matmul "
            f"{compute.matmul_gflops['Q4_K'][512]:.0f} GFLOP/s at 512 tokens, "
            f"{compute.node_seconds * 1e6:.2f} us a graph node"
        )
