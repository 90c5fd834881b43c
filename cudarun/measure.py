"""This machine measured into a hardware profile: its CPU always, its GPU when it has one, or the
GPU side of another profile kept as it is (`refengine profile --gpu-from`). It leaves out writing
the profile and reporting it."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from solver.profile import HardwareProfile

from .measure_cpu import measure_cpu


def measure_profile(
    gpu_from: HardwareProfile | None,
    threads: int | None = None,
    quick: bool = False,
    progress: Callable[[str], None] = lambda s: None,
) -> HardwareProfile:
    """The GPU measured here (with the host's synchronization cost) unless `gpu_from` gives its
    GPU side and notes; then the CPU, on `threads` (None: all), in small shapes when `quick`."""
    if gpu_from is None:
        from .measure_gpu import measure_gpu

        gpu, sync = measure_gpu(quick, progress)
        gpus, gpu_name = (gpu,), gpu.name
    else:
        gpus, sync, gpu_name = gpu_from.gpus, None, gpu_from.gpu_side_name
    shape = (1024, 1024) if quick else (4096, 4096)
    cpu = measure_cpu(threads, shape, quick, progress)
    if sync is not None:
        cpu = replace(cpu, sync_seconds=sync)
    notes = gpu_from.notes if gpu_from else ""
    return HardwareProfile(name=f"{cpu.name} + {gpu_name}", gpus=gpus, cpu=cpu, notes=notes)
