"""A `llamacpp` plan checked by real llama.cpp: its exported flags run in `llama-completion` (one
token, verbose), and the load log read back — which device each tensor went to (the layer
assignments and the `-ot` overrides it logs) and each device's model, KV and compute buffers — to
set beside the plan's prediction (`refengine verify`).

On a machine without the plan's GPUs, llama.cpp RPC servers stand in for them: GPU i of the plan is
the i-th `--rpc` endpoint, `CUDA<i>` in the flags becomes that server's device and buffer names. A
plan whose devices are RPC servers (`solve --rpc`) names them itself: its flags carry `--rpc`.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from refengine.errors import UserError
from refengine.spec import ModelSpec

from .export import llamacpp_layer, on_rpc_servers, rpc_buffer
from .targets import traits

LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python sdist scripts/build_llamacpp.sh builds
MIB = 1 << 20
HOST = "CPU"
# what a device may be off the plan before `verify` flags it (issue 18: 3% + 4 MiB)
REL_TOLERANCE = 0.03
ABS_TOLERANCE_BYTES = 4 * MIB


def default_llama_bin() -> Path:
    from refengine.defaults import cache_dir

    return cache_dir() / "llama.cpp" / LLAMACPP_VERSION / "bin"


def llama_binary(bin_dir: Path | None, name: str) -> Path:
    d = Path(bin_dir) if bin_dir else default_llama_bin()
    exe = d / name
    if not exe.is_file():
        raise UserError(
            f"no {name} in {d}: build llama.cpp with scripts/build_llamacpp.sh, or give --llama-bin"
        )
    return exe


def exported_args(command: str) -> tuple[str, list[str]]:
    """(model path, flags) of an exported `llama-server -m MODEL ...` command line."""
    words = shlex.split(command)
    i = words.index("-m")
    return words[i + 1], words[1:i] + words[i + 2 :]


def on_rpc(args: list[str], endpoints: list[str]) -> list[str]:
    """Flags with the plan's local GPU i served by RPC endpoint i: `--rpc` before `-dev` (llama.cpp
    refuses `-dev RPC0` otherwise), CUDA<i> as device RPC<i>, and `-ot` destinations as RPC
    buffer names; the plan's own RPC servers, if any, after them."""
    return on_rpc_servers(args, endpoints, 0)


@dataclass
class DeviceBuffers:
    model_bytes: int = 0
    kv_bytes: int = 0
    compute_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.kv_bytes + self.compute_bytes


@dataclass
class LoadLog:
    """What llama.cpp's verbose load log says: devices in order, each tensor's device, and the
    buffers per device (`CPU` gathers the host's: mapped, repacked, pinned)."""

    devices: list[str] = field(default_factory=list)
    tensors: dict[str, str] = field(default_factory=dict)
    buffers: dict[str, DeviceBuffers] = field(default_factory=dict)


_USING = re.compile(r"using device (\S+) \(([^)]*)\)")
_LAYER = re.compile(r"layer +(\d+) assigned to device (\S+?),")
_OVERRIDE = re.compile(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)")
_BUFFER = re.compile(r"(load_tensors|llama_kv_cache|llama_memory_recurrent|sched_reserve): +(\S+) "
                     r"(model|KV|RS|compute) buffer size = +([\d.]+) MiB")  # fmt: skip
# a recurrent layer's state (RS) is its cache, as a layer's KV is
_KIND = {"model": "model_bytes", "KV": "kv_bytes", "RS": "kv_bytes", "compute": "compute_bytes"}


def parse_load_log(text: str, spec: ModelSpec) -> LoadLog:
    log = LoadLog()
    buffer_device = {}
    for m in _USING.finditer(text):
        name, desc = m.group(1), m.group(2)
        log.devices.append(name)
        buffer_device[rpc_buffer(desc) if name.startswith("RPC") else name] = name

    def device_of(buffer: str) -> str:
        if buffer.startswith("CPU") or buffer.endswith("_Host"):
            return HOST
        return buffer_device.get(buffer, buffer)

    layer_device = {int(m.group(1)): m.group(2) for m in _LAYER.finditer(text)}
    overridden = {m.group(1): device_of(m.group(2)) for m in _OVERRIDE.finditer(text)}
    n = spec.hparams.n_block  # the output layer's index
    for t in spec.tensors:
        if t.name in overridden:
            log.tensors[t.name] = overridden[t.name]
        elif t.name == "token_embd.weight":
            log.tensors[t.name] = HOST  # the input layer is always the host's
        else:
            log.tensors[t.name] = layer_device.get(llamacpp_layer(t, n), HOST)
    if spec.tied_output:  # the head reads a copy of the embedding on the output layer's device
        log.tensors["token_embd.weight@output"] = overridden.get(
            "token_embd.weight", layer_device.get(n, HOST)
        )
    for m in _BUFFER.finditer(text):
        b = log.buffers.setdefault(device_of(m.group(2)), DeviceBuffers())
        attr = _KIND[m.group(3)]
        setattr(b, attr, getattr(b, attr) + round(float(m.group(4)) * MIB))
    return log


def run_llamacpp(bin_dir: Path | None, model_path: str, args: list[str], timeout_s: float = 600):
    """llama.cpp's load log for one token of `args` (stdout and stderr together)."""
    exe = llama_binary(bin_dir, "llama-completion")
    cmd = [str(exe), "-m", model_path, *args, "-n", "1", "-p", "hi", "-v", "-no-cnv",
           "--no-warmup"]  # fmt: skip
    for _ in range(2):  # under load it has exited 0 printing nothing: once more, then say so
        p = subprocess.run(cmd, capture_output=True, text=True, errors="replace",
                           timeout=timeout_s)  # fmt: skip
        text = p.stdout + p.stderr
        if p.returncode != 0:
            tail = " | ".join(line for line in text.strip().splitlines()[-3:])
            raise UserError(f"llama.cpp exited {p.returncode} on the plan's flags: {tail}")
        if _BUFFER.search(text):
            return text
    raise UserError("llama.cpp exited 0 twice without reporting a buffer it allocated; nothing "
                    "to check the plan against: run verify again")


def run_llama_bench(bin_dir: Path | None, model_path: str, args: list[str], n_prompt: int,
                    n_gen: int, repetitions: int = 1, timeout_s: float = 600) -> tuple[list, str]:
    """llama-bench's JSON records (one per test: pp then tg) and its verbose load log for
    llama-bench flags (`solver.export.llama_bench_args`)."""
    import json

    exe = llama_binary(bin_dir, "llama-bench")
    cmd = [str(exe), "-m", model_path, *args, "-p", str(n_prompt), "-n", str(n_gen),
           "-r", str(repetitions), "-o", "json", "-v"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s)
    if p.returncode != 0:
        tail = " | ".join(line for line in p.stderr.strip().splitlines()[-3:])
        raise UserError(f"llama-bench exited {p.returncode} on the plan's flags: {tail}")
    return json.loads(p.stdout), p.stderr


@dataclass
class DeviceRow:
    device: str  # llama.cpp's name (CUDA0, RPC1)
    planned: DeviceBuffers
    measured: DeviceBuffers
    budget_bytes: int

    @property
    def within_tolerance(self) -> bool:
        p, m = self.planned.total_bytes, self.measured.total_bytes
        return abs(m - p) <= REL_TOLERANCE * p + ABS_TOLERANCE_BYTES

    @property
    def within_budget(self) -> bool:
        return self.measured.total_bytes <= self.budget_bytes

    def worst_term(self) -> tuple[str, int, int]:
        """(term, planned bytes, allocated bytes) of the buffer furthest off the plan."""
        terms = [(t, getattr(self.planned, a), getattr(self.measured, a))
                 for t, a in (("model", "model_bytes"), ("KV", "kv_bytes"),
                              ("compute", "compute_bytes"))]  # fmt: skip
        return max(terms, key=lambda x: abs(x[2] - x[1]))

    def problem(self) -> str | None:
        """One line when this device is over its budget or off the plan, naming the term."""
        term, planned, got = self.worst_term()
        where = (f"{self.device}: llama.cpp allocated {self.measured.total_bytes / MIB:.1f} MiB, "
                 f"the plan {self.planned.total_bytes / MIB:.1f} MiB")  # fmt: skip
        if not self.within_budget:
            return f"{where}, over its budget of {self.budget_bytes / MIB:.0f} MiB"
        if not self.within_tolerance:
            return (f"{where}: off the plan by more than {REL_TOLERANCE:.0%} + "
                    f"{ABS_TOLERANCE_BYTES / MIB:.0f} MiB, most in its {term} buffer "
                    f"({got / MIB:.1f} MiB allocated, {planned / MIB:.1f} planned): the memory "
                    "model is wrong there")  # fmt: skip
        return None


@dataclass
class Verdict:
    rows: list[DeviceRow]
    misplaced: list[tuple[str, str, str]]  # tensor, planned device, llama.cpp's

    @property
    def ok(self) -> bool:
        """Every tensor where the plan says, every device within its budget and within the
        tolerance of the plan's memory."""
        return not self.misplaced and not any(r.problem() for r in self.rows)


def planned_memory(d: dict, spec: ModelSpec | None = None) -> dict[int, DeviceBuffers]:
    """Per GPU, what a llamacpp plan says llama.cpp allocates (`memory_worst`); with `spec`, what
    it allocates on devices that do no op-offload (RPC servers), from the plan's placement at its
    largest tier."""
    if spec is None:
        return {
            int(g): DeviceBuffers(m["weights"], m["kv"], m["compute"])
            for g, m in d["memory_worst"].items()
        }
    from .groups import tensor_groups
    from .plan import placements_from_json, plan_workload
    from .usage import device_usage

    tiers = placements_from_json(d, spec)
    tier, w = max(tiers), plan_workload(d)
    out = {}
    for g in range(len(d["fingerprint"]["budget_bytes"])):
        u = device_usage(spec, tensor_groups(spec), tiers[tier], tier, w, "llamacpp", g, False)
        out[g] = DeviceBuffers(u.weights, u.kv, u.compute)  # no op-offload: no scratch
    return out


def compare(d: dict, planned_devices: dict[str, str], log: LoadLog, device_names: list[str],
            memory: dict[int, DeviceBuffers] | None = None) -> Verdict:  # fmt: skip
    """`planned_devices`: tensor -> the llama.cpp device the plan puts it on (CPU for the host);
    `device_names`: llama.cpp's name of each GPU of the plan; `memory`: per GPU, what the plan
    has llama.cpp allocate (default: the plan's `memory_worst`)."""
    misplaced = [
        (name, dev, log.tensors.get(name, "?"))
        for name, dev in sorted(planned_devices.items())
        if log.tensors.get(name) != dev
    ]
    budgets = d["fingerprint"]["budget_bytes"]
    rows = []
    for g, mem in sorted((memory or planned_memory(d)).items()):
        name = device_names[g]
        rows.append(DeviceRow(name, mem, log.buffers.get(name, DeviceBuffers()), budgets[g]))
    return Verdict(rows, misplaced)


def verify_plan(d: dict, spec: ModelSpec, model_path: str, bin_dir: Path | None,
                rpc: list[str] | None) -> tuple[Verdict, list[str]]:  # fmt: skip
    """Run a llamacpp plan's flags in llama.cpp and judge placement and memory; also returns
    the flags run."""
    from .export import export_plan, tensor_devices
    from .plan import placements_from_json, plan_devices

    if not traits(d.get("target", "refengine")).llamacpp_flags:
        raise UserError("verify checks llamacpp plans: solve with --target llamacpp")
    if d.get("split_mode") == "tensor":
        raise UserError("verify reads layer-split placements; this plan splits every tensor")
    own = [e for _, e in plan_devices(d) if e]
    if rpc and len(own) == len(d["fingerprint"]["budget_bytes"]):
        raise UserError(
            f"the plan's devices are the RPC servers at {','.join(own)}, which it names: --rpc "
            "stands in for a plan's local GPUs and this one has none; leave --rpc out"
        )
    _, args = exported_args(export_plan(d, spec, "llamacpp"))
    if rpc:
        args = on_rpc(args, rpc)
    log = parse_load_log(run_llamacpp(bin_dir, model_path, args), spec)
    names = args[args.index("-dev") + 1].split(",")  # llama.cpp's name of each plan device
    tiers = placements_from_json(d, spec)
    planned = {
        t: dev if dev == HOST else names[int(dev.removeprefix("CUDA"))]
        for t, dev in tensor_devices(spec, tiers[min(tiers)]).items()
    }
    # an RPC server does no op-offload: where the first device is one, nothing does, and the
    # plan's memory is as llama.cpp allocates it then (a GPU first offloads as the plan says)
    first_rpc = names[0].startswith("RPC")
    return compare(d, planned, log, names, planned_memory(d, spec) if first_rpc else None), args
