"""Reading compiled CUDA kernels without a GPU, for the peer gates (`sass_check`): the toolchain
of the NVIDIA wheels (nvcc, ptxas, nvdisasm, one CUDA release), our kernels' PTX (as `ptx_check`
compiles it) and llama.cpp's CUDA sources (as `scripts/build_llamacpp.sh` keeps them) assembled
for sm_90 and disassembled, and the SASS counted: the loop that holds a kernel's most global
loads, every path through one of its iterations, its induction step, and the shortest way into
and out of it (docs/sass_gate.md)."""

from __future__ import annotations

import hashlib
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import compat  # noqa: F401  (before numba.cuda)
from .ptx_check import ARCH

# an H100 SXM: the warp-instructions its schedulers can issue per KiB that HBM delivers
H100_SMS, H100_SCHEDULERS, H100_CLOCK_HZ, H100_HBM_BYTES_PER_S = 132, 4, 1.755e9, 3.35e12
ISSUE_BUDGET_PER_KIB = H100_SMS * H100_SCHEDULERS * H100_CLOCK_HZ / H100_HBM_BYTES_PER_S * 1024


class CannotAnalyse(Exception):
    pass


# -- the toolchain ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Toolchain:
    nvcc: Path
    ptxas: Path
    nvdisasm: Path
    include: list[Path]  # CCCL's headers where the nvcc wheel lacks nv/target
    release: str


def toolchain() -> Toolchain:
    """nvcc, ptxas and nvdisasm of the NVIDIA wheels (the test extra), one CUDA release."""
    import nvidia

    found = sorted(p for root in nvidia.__path__ for p in Path(root).glob("cu*/bin"))
    tools = {}
    for name in ("nvcc", "ptxas", "nvdisasm"):
        hits = [b / name for b in found if (b / name).exists()]
        if not hits:
            wheel = {"nvdisasm": "nvidia-cuda-nvdisasm"}.get(name, "nvidia-cuda-nvcc")
            raise SystemExit(f"sass_check needs {name}: pip install '{wheel}>=13' (the test extra)")
        tools[name] = hits[0]
    out = subprocess.run([tools["ptxas"], "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release ([\d.]+)", out).group(1)
    include = []
    base = tools["nvcc"].parent.parent / "include"
    if not (base / "nv" / "target").exists():
        cccl = [p.parent.parent for r in nvidia.__path__ for p in Path(r).glob("cu*/include/**/nv/target")]  # noqa: E501
        if not cccl:
            raise SystemExit("sass_check needs CCCL's headers: pip install nvidia-cuda-cccl")
        include.append(cccl[0])
    return Toolchain(tools["nvcc"], tools["ptxas"], tools["nvdisasm"], include, release)


# -- SASS ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ins:
    op: str  # with its modifiers, e.g. LDG.E.U16
    pred: str | None  # the guarding predicate, e.g. @!P1
    text: str  # operands
    target: str | None  # a branch's label


_SECTION = re.compile(r"^\s*//-+ \.text\.(\S+) -+\s*$", re.M)
_LINE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?([A-Z][\w.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")


def sass_functions(text: str) -> dict[str, tuple[list[Ins], dict[str, int]]]:
    """Each function of nvdisasm's output: its instructions and its labels' positions."""
    parts = _SECTION.split(text)
    out = {}
    for name, body in zip(parts[1::2], parts[2::2]):
        ins, labels = [], {}
        for line in body.splitlines():
            m = _LABEL.match(line.strip())
            if m:
                labels[m.group(1)] = len(ins)
                continue
            m = _LINE.match(line)
            if m:
                pred = (m.group(1) or "").strip() or None
                target = re.search(r"`\((\.L_x_\d+)\)", m.group(3))
                ins.append(Ins(m.group(2), pred, m.group(3), target and target.group(1)))
        out[name] = (ins, labels)
    return out


def weight_loop(ins: list[Ins], labels: dict[str, int]) -> tuple[int, int]:
    """(head, latch) of the innermost backward-branch loop holding the most global loads."""
    loops = [(labels[i.target], k) for k, i in enumerate(ins)
             if i.op.startswith("BRA") and labels.get(i.target, k + 1) <= k]  # fmt: skip
    inner = [a for a in loops if not any(b != a and a[0] <= b[0] and b[1] <= a[1] for b in loops)]
    loads = {a: sum(_is_load(ins[k].op) for k in range(a[0], a[1] + 1)) for a in inner}
    if not loads or max(loads.values()) == 0:
        raise CannotAnalyse("no loop with global loads")
    return max(loads, key=lambda a: (loads[a], a[1] - a[0]))


def iteration_paths(ins, labels, head: int, latch: int, limit: int = 4096) -> list[list[int]]:
    """Every path through one iteration: a guarded branch forks, a branch back to the head ends
    the iteration, one out of the loop leaves it (not an iteration)."""
    paths, stack = [], [(head, [])]
    while stack:
        k, path = stack.pop()
        while head <= k <= latch:
            path = path + [k]
            i = ins[k]
            if i.op.startswith("BRA") and i.target in labels:
                t = labels[i.target]
                if t == head:
                    paths.append(path)
                    if i.pred is None:
                        break
                elif i.pred is not None:
                    stack.append((t, path))
                else:
                    k = t
                    continue
            elif i.op == "EXIT" and i.pred is None:
                break
            k += 1
        if len(paths) > limit:
            raise CannotAnalyse("too many paths through the loop")
    if not paths:
        raise CannotAnalyse("no path back to the loop's head")
    return paths


def induction_step(ins: list[Ins], head: int, latch: int) -> int:
    """The constant the loop's exit test register grows by per iteration: the ISETP that sets the
    latch's predicate compares a register that an add of an immediate advances in the loop."""
    pred = ins[latch].pred
    if pred is None:
        raise CannotAnalyse("the loop's latch is unconditional")
    name = pred.lstrip("@!")
    for k in range(latch - 1, head - 1, -1):
        i = ins[k]
        regs = [r.strip() for r in i.text.split(",")]
        if i.op.startswith("ISETP") and regs[0] == name:
            counter = regs[2]
            break
    else:
        raise CannotAnalyse("no test of the loop's predicate in the loop")
    total = 0
    for k in range(head, latch + 1):
        i = ins[k]
        regs = [r.strip() for r in i.text.split(",")]
        if i.op.split(".")[0] in ("VIADD", "IADD3", "IADD") and regs[0] == counter and counter in regs[1:]:  # noqa: E501
            imm = [r for r in regs[1:] if r.startswith("0x")]
            if len(imm) == 1:
                total += int(imm[0], 16)
    if total <= 0:
        raise CannotAnalyse(f"no constant step of the loop counter {counter}")
    return total


def successors(ins: list[Ins], labels: dict[str, int], k: int) -> list[int]:
    i = ins[k]
    if i.op.startswith("BRA") and i.target in labels:
        return [labels[i.target]] + ([k + 1] if i.pred is not None else [])
    if i.op in ("EXIT", "RET") and i.pred is None:
        return []
    return [k + 1] if k + 1 < len(ins) else []


def shortest(ins, labels, starts: list[int], done, avoid: range) -> int:
    """The fewest instructions from any of `starts` to an instruction for which `done(k)` holds
    (itself not counted), never entering `avoid` (breadth first: every instruction costs one)."""
    seen, frontier, length = set(starts), list(starts), 0
    while frontier:
        nxt = []
        for k in frontier:
            if done(k):
                return length
            for j in successors(ins, labels, k):
                if j not in seen and (j not in avoid or done(j)):
                    seen.add(j)
                    nxt.append(j)
        frontier, length = nxt, length + 1
    raise CannotAnalyse("no path around the weight loop")


@dataclass(frozen=True)
class Counts:
    """One kernel's SASS, counted: warp-instructions of one loop iteration (the mean over its
    paths, and the range), the loop's induction step, the instructions a warp issues outside it
    (the shortest path from the entry to the loop and from the loop to an exit: both kernels'
    warps skip code on their way, e.g. llama.cpp's other warps leave before the reduction), and
    the iteration's dp4a and widest global load."""

    loop_instructions: float
    loop_min: int
    loop_max: int
    step: int
    outside: int
    dp4a: float
    widest_load_bits: int
    narrow_loads: float  # global loads of 8 or 16 bits
    generic_loads: int  # loads through a pointer of unknown space (LD, not LDG)


def _is_load(op: str) -> bool:
    """A global load, or a generic one (what a pointer of unknown space compiles to)."""
    return op.startswith(("LDG.", "LD."))


def load_bits(op: str) -> int:
    """The width of a load's or store's operand, from its modifiers."""
    for part, bits in (("U8", 8), ("S8", 8), ("U16", 16), ("S16", 16), ("64", 64), ("128", 128)):
        if part in op.split("."):
            return bits
    return 32


def count(ins: list[Ins], labels: dict[str, int], stepped: bool = True) -> Counts:
    """The counts of the kernel's weight loop; `stepped`: its induction step is a constant to read
    (else 0: the caller knows the work of an iteration from the launch)."""
    head, latch = weight_loop(ins, labels)
    paths = iteration_paths(ins, labels, head, latch)
    sizes = [len(p) for p in paths]
    dp4a = sum(sum(ins[k].op.startswith("IDP") for k in p) for p in paths) / len(paths)
    narrow = sum(sum(_is_load(ins[k].op) and load_bits(ins[k].op) <= 16 for k in p)
                 for p in paths) / len(paths)  # fmt: skip
    widest = max((load_bits(ins[k].op) for k in range(head, latch + 1)
                  if _is_load(ins[k].op)), default=0)  # fmt: skip
    loop = range(head, latch + 1)
    exits = sorted({j for k in loop for j in successors(ins, labels, k) if j not in loop})
    is_exit = [i.op == "EXIT" and i.pred is None for i in ins]
    outside = (shortest(ins, labels, [0], lambda k: k == head, loop)
               + shortest(ins, labels, exits, lambda k: is_exit[k], loop) + 1)  # fmt: skip
    return Counts(sum(sizes) / len(sizes), min(sizes), max(sizes),
                  induction_step(ins, head, latch) if stepped else 0, outside, dp4a, widest, narrow,
                  sum(ins[k].op.startswith("LD.") for k in loop))


# -- compiling -------------------------------------------------------------------------------------

PEER_FLAGS = ("-O3", "-std=c++17", "-use_fast_math", "-extended-lambda", "--expt-relaxed-constexpr",
              "-DGGML_USE_CUDA", "-DGGML_BACKEND_BUILD", "-DGGML_BACKEND_SHARED", "-DGGML_SHARED",
              "-DGGML_BUILD", "-DGGML_CUDA_USE_GRAPHS", "-DGGML_SCHED_MAX_COPIES=4",
              "-D_GNU_SOURCE", "-D_XOPEN_SOURCE=600", "-Xcompiler", "-Wno-pedantic")  # fmt: skip
CUBLAS_STUB = """#pragma once
#include <cuda_runtime.h>
#define CUBLAS_VER_MAJOR 13
#define CUBLAS_VER_MINOR 0
typedef struct cublasContext *cublasHandle_t;
typedef enum { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_NOT_INITIALIZED = 1,
  CUBLAS_STATUS_ALLOC_FAILED = 3, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_ARCH_MISMATCH = 8,
  CUBLAS_STATUS_MAPPING_ERROR = 11, CUBLAS_STATUS_EXECUTION_FAILED = 13,
  CUBLAS_STATUS_INTERNAL_ERROR = 14, CUBLAS_STATUS_NOT_SUPPORTED = 15 } cublasStatus_t;
typedef enum { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TENSOR_OP_MATH = 1,
  CUBLAS_TF32_TENSOR_OP_MATH = 3 } cublasMath_t;
typedef enum { CUBLAS_COMPUTE_16F = 64, CUBLAS_COMPUTE_32F = 68,
  CUBLAS_COMPUTE_32F_FAST_TF32 = 77 } cublasComputeType_t;
typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum { CUBLAS_GEMM_DEFAULT = -1, CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99 } cublasGemmAlgo_t;
const char *cublasGetStatusString(cublasStatus_t);
cublasStatus_t cublasCreate(cublasHandle_t *);
cublasStatus_t cublasDestroy(cublasHandle_t);
cublasStatus_t cublasSetMathMode(cublasHandle_t, cublasMath_t);
cublasStatus_t cublasSetStream(cublasHandle_t, cudaStream_t);
cublasStatus_t cublasSetWorkspace(cublasHandle_t, void *, size_t);
"""


def peer_sources() -> Path:
    """The ggml tree of the llama.cpp build (kept by scripts/build_llamacpp.sh)."""
    from refengine.defaults import cache_dir
    from solver.llamacpp_check import LLAMACPP_VERSION

    ggml = cache_dir() / "llama.cpp" / LLAMACPP_VERSION / "ggml"
    if not (ggml / "src" / "ggml-cuda" / "mmvq.cu").exists():
        raise SystemExit(f"sass_check: no llama.cpp sources at {ggml}: "
                         "run scripts/build_llamacpp.sh")  # fmt: skip
    return ggml


def peer_sass(tools: Toolchain, source: str = "mmvq.cu") -> str:
    """nvdisasm of one of llama.cpp's ggml-cuda sources for ARCH, compiled once per sources and
    release."""
    ggml = peer_sources()
    cuda = ggml / "src" / "ggml-cuda"
    digest = hashlib.sha256()
    for f in sorted(cuda.glob("*.cu*")) + [ggml / "src" / "ggml-common.h"]:
        digest.update(f.read_bytes())
    digest.update(" ".join((ARCH, tools.release) + PEER_FLAGS).encode())
    digest.update(source.encode() + (cuda / source).read_bytes())  # template-instances/ too
    stem = Path(source).stem
    cached = ggml.parent / f"{stem}-{ARCH}-{tools.release}-{digest.hexdigest()[:12]}.sass"
    if cached.exists():
        return cached.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "cublas_v2.h").write_text(CUBLAS_STUB)
        cubin = Path(tmp) / f"{stem}.cubin"
        includes = [f"-I{p}" for p in (tmp, ggml / "include", ggml / "src", cuda)]
        includes += [f"-isystem{p}" for p in tools.include]
        cmd = [tools.nvcc, f"-arch={ARCH}", *PEER_FLAGS, *includes, "-cubin", "-o", cubin,
               cuda / source]  # fmt: skip
        print(f"sass_check: compiling llama.cpp's {source} for {ARCH} (once)", flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"sass_check: nvcc failed on {source}:\n" + run.stderr[-2000:])
        text = subprocess.run([tools.nvdisasm, "-c", cubin], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    cached.write_text(text)
    return text


def our_sass(tools: Toolchain, name: str) -> str:
    """nvdisasm of our kernel `name` of `ptx_check.kernels()` as it runs (its launch bounds),
    assembled for ARCH: the build ptx_check's gate reads (`kernel_build`)."""
    from . import kernel_build
    from .ptx_check import file_stem, kernels

    (kernel, argtypes), = [(k, a) for n, k, a in kernels() if n == name]
    return kernel_build.sass(file_stem(name), kernel, argtypes, tools.ptxas, tools.nvdisasm)
