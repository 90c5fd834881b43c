"""Exports: a `llamacpp`-target plan as llama.cpp flags that mean exactly its placement, and the
inverse — llama.cpp's own placement rules applied to flags — that the tests use to prove it.

Flags (LLAMACPP.md): `-fit off` (else --fit would move things), an explicit `-c`, `-ngl K` (the
output layer plus the last K-1 repeating layers go to the GPU, and a layer's KV follows it),
`-sm layer`, `-ub 512`, `-fa`, `-ctk/-ctv`, `-dev CUDA0`, and anchored `-ot` patterns, first match
wins, for every tensor whose plan location differs from what `-ngl` gives it. llama.cpp cannot
express streamed execution, per-tier plans, or a KV placement other than its layer's: a plan
needing those is refused with the reason.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict

from refengine.errors import UserError
from refengine.spec import ModelSpec, layer_of

from .cost import CPU, TierPlacement
from .groups import tensor_groups

GPU_BUFT, CPU_BUFT = "CUDA0", "CPU"


def tensor_devices(spec: ModelSpec, place: TierPlacement) -> dict[str, str]:
    """GGUF tensor -> CUDA0 or CPU under a placement (a tied head is `token_embd.weight@output`)."""
    out = {}
    for g in tensor_groups(spec):
        dev = CPU_BUFT if place.groups[g.name].kind == CPU else GPU_BUFT
        for name in g.tensors:
            tied = g.kind == "output" and name == "token_embd.weight"
            out[name + ("@output" if tied else "")] = dev
    return out


def llamacpp_args(
    spec: ModelSpec,
    place: TierPlacement,
    n_ctx: int,
    kv_type: str,
    flash_attn: bool,
    n_ubatch: int = 512,
) -> list[str]:
    n = spec.hparams.n_layer
    gpu_kv = sorted(il for il, loc in place.kv.items() if loc.kind != CPU)
    if any(loc.kind == "streamed" for loc in place.groups.values()) or any(
        loc.kind == "streamed" for loc in place.kv.values()
    ):
        raise UserError(
            "llama.cpp cannot stream weights or KV under a plan; solve with --target llamacpp"
        )
    if gpu_kv != list(range(n - len(gpu_kv), n)):
        raise UserError(
            "llama.cpp keeps a layer's KV with the layer and offloads the last "
            "layers: KV on the GPU must be a suffix of the layers"
        )
    want = tensor_devices(spec, place)
    ngl = len(gpu_kv) + 1 if (gpu_kv or want["output_norm.weight"] == GPU_BUFT) else 0
    default = llamacpp_defaults(spec, ngl)
    by_pattern: dict[tuple[str, str], list[int]] = defaultdict(list)
    singles = []
    for name, dev in want.items():
        if default[name] == dev or name.endswith("@output"):
            continue
        il = layer_of(name)
        if il is None:
            singles.append((name, dev))
        else:
            base = name.split(".", 2)[2]
            by_pattern[(base, dev)].append(il)
    ot = [f"^{re.escape(name)}$={dev}" for name, dev in singles]
    for (base, dev), layers in sorted(by_pattern.items()):
        alt = "|".join(str(il) for il in sorted(layers))
        ot.append(f"^blk\\.({alt})\\.{re.escape(base)}$={dev}")
    tied_head = want.get("token_embd.weight@output")
    if tied_head is not None and tied_head != default["token_embd.weight@output"]:
        raise UserError("a tied output head cannot be placed apart from llama.cpp's output layer")
    args = [
        "-fit",
        "off",
        "-c",
        str(n_ctx),
        "-ngl",
        str(ngl),
        "-sm",
        "layer",
        "-ub",
        str(n_ubatch),
        "-fa",
        "on" if flash_attn else "off",
        "-ctk",
        kv_type,
        "-ctv",
        kv_type,
        "-dev",
        GPU_BUFT,
    ]
    if ot:
        args += ["-ot", ",".join(ot)]
    return args


def llamacpp_defaults(spec: ModelSpec, ngl: int) -> dict[str, str]:
    """Where llama.cpp puts each tensor given only `-ngl`."""
    n = spec.hparams.n_layer
    first_gpu_layer = n - (ngl - 1) if ngl >= 1 else n + 1
    out = {}
    for t in spec.tensors:
        il = t.layer
        if t.name == "token_embd.weight":
            out[t.name] = CPU_BUFT  # the input embedding always stays on the CPU
        elif il is None:  # output_norm, output
            out[t.name] = GPU_BUFT if ngl >= 1 else CPU_BUFT
        else:
            out[t.name] = GPU_BUFT if il >= first_gpu_layer else CPU_BUFT
    if spec.tied_output:
        out["token_embd.weight@output"] = GPU_BUFT if ngl >= 1 else CPU_BUFT
    return out


def apply_llamacpp_args(spec: ModelSpec, args: list[str]) -> dict[str, str]:
    """llama.cpp's rules applied to flags: `-ngl` first, then each `-ot` pattern searched (not
    matched) against the full tensor name in order, the first match winning."""
    ngl = int(args[args.index("-ngl") + 1])
    devices = llamacpp_defaults(spec, ngl)
    rules = []
    if "-ot" in args:
        for item in args[args.index("-ot") + 1].split(","):
            pattern, buft = item.split("=", 1)
            rules.append((re.compile(pattern), buft))
    for name in list(devices):
        real = name.removesuffix("@output")
        for rx, buft in rules:
            if rx.search(real):
                devices[name] = buft
                break
    return devices


def command_line(model_path: str, args: list[str]) -> str:
    return shlex.join(["llama-server", "-m", model_path, *args])
