"""Our CUDA kernels compiled for ARCH once per source tree, for the static gates: the PTX that
NVVM makes of a kernel at the argument types and launch bounds it runs with, and the cubin and
`-v` report ptxas makes of that PTX, kept in the project's cache. `ptx_check` (registers, stack,
spills, f64) and `sass_check` (instructions per KiB beside llama.cpp) read the same build, so the
suite compiles each kernel once where it compiled it twice (two of its slowest tests).

The key holds every byte that can change a kernel's code: the Python of cudarun, refengine and
solver (a kernel reads constants from all three), the versions of Numba, llvmlite and the NVIDIA
wheels, and ARCH. A build is written to a temporary name and renamed, so two processes building
the same kernel at once both read a whole file."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from . import compat  # noqa: F401  (before numba.cuda)

CC = (9, 0)  # the H100 of docs/toolchain.md
ARCH = f"sm_{CC[0]}{CC[1]}"

_KEPT_TREES = 3  # builds of other source trees left in the cache (other checkouts, older commits)


@lru_cache(maxsize=None)
def build_dir() -> Path:
    """This source tree's folder of builds, created on first use; older trees' beyond
    _KEPT_TREES removed."""
    from refengine.defaults import cache_dir

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(ARCH.encode())
    for package in ("cudarun", "refengine", "solver"):
        for f in sorted((root / package).rglob("*.py")):
            digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    versions = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions()
                      if d.metadata["Name"].lower().startswith(("numba", "llvmlite", "nvidia")))  # fmt: skip
    digest.update("\n".join(versions).encode())
    parent = cache_dir() / "kernels"
    here = parent / f"{ARCH}-{digest.hexdigest()[:16]}"
    here.mkdir(parents=True, exist_ok=True)
    others = sorted((p for p in parent.glob(f"{ARCH}-*") if p != here),
                    key=lambda p: p.stat().st_mtime)  # fmt: skip
    for old in others[: max(0, len(others) - _KEPT_TREES)]:
        shutil.rmtree(old, ignore_errors=True)
    return here


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def ptx(stem: str, kernel, argtypes) -> str:
    """The PTX of `kernel` at `argtypes`, with the launch bounds it is declared with."""
    path = build_dir() / f"{stem}.ptx"
    if path.exists():
        return path.read_text()
    from numba import cuda
    from numba.cuda import dispatcher

    # A kernel's device functions are compiled for "the current device", which needs a driver;
    # here that device is the target architecture.
    dispatcher.get_current_device = lambda: type("Target", (), {"compute_capability": CC})()
    bounds = kernel.targetoptions.get("launch_bounds")
    text, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=CC, launch_bounds=bounds)
    _write(path, text.encode())
    return text


@dataclass(frozen=True)
class Assembled:
    ptx: str
    cubin: Path
    report: str  # ptxas -v


def assemble(stem: str, kernel, argtypes, ptxas: Path) -> Assembled:
    """`ptx(...)` assembled for ARCH by `ptxas -v`: the cubin and the report."""
    text = ptx(stem, kernel, argtypes)
    cubin, report = build_dir() / f"{stem}.cubin", build_dir() / f"{stem}.ptxas"
    if not (cubin.exists() and report.exists()):
        with tempfile.TemporaryDirectory(dir=build_dir()) as tmp:
            src, out = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
            src.write_text(text)
            r = subprocess.run([str(ptxas), f"-arch={ARCH}", "-v", str(src), "-o", str(out)],
                               capture_output=True, text=True)  # fmt: skip
            if r.returncode:
                last = (r.stderr or r.stdout).strip().splitlines()[-1]
                raise RuntimeError(f"ptxas failed: {last}")
            _write(cubin, out.read_bytes())
            _write(report, (r.stdout + r.stderr).encode())  # -v went to stderr in older ptxas
    return Assembled(text, cubin, report.read_text())


def sass(stem: str, kernel, argtypes, ptxas: Path, nvdisasm: Path) -> str:
    """nvdisasm of `assemble(...)`'s cubin."""
    path = build_dir() / f"{stem}.sass"
    if not path.exists():
        cubin = assemble(stem, kernel, argtypes, ptxas).cubin
        text = subprocess.run([str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
        _write(path, text.encode())
    return path.read_text()
