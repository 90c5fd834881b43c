"""Exports: a `llamacpp`-target plan as llama.cpp flags that mean exactly its placement, and the
inverse — llama.cpp's own placement rules applied to flags — that the tests use to prove it.

Flags (LLAMACPP.md): `-fit off` (else --fit would move things), an explicit `-c`, `-ngl K` (the
output layer plus the last K-1 repeating layers go to the GPU, and a layer's KV follows it),
integer `-ts` counts over several GPUs, `-sm layer`, `-b`/`-ub` (the plan's largest ubatch),
`-fa`, `-ctk/-ctv`, `-dev CUDA0[,CUDA1...]`, and anchored `-ot` patterns, first match wins, for
every tensor whose plan location differs from what `-ngl`/`-ts` give it; or, for a tensor-split
plan, `-sm tensor`. llama.cpp cannot
express streamed execution, per-tier plans, or a KV placement other than its layer's: a plan
needing those is refused with the reason.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict

from refengine.errors import UserError
from refengine.spec import ModelSpec, layer_of

from .budget import DEFAULT_N_BATCH
from .cost import CPU, TierPlacement
from .groups import tensor_groups

CPU_BUFT = "CPU"


def gpu_buft(device: int) -> str:
    return f"CUDA{device}"


def tensor_devices(spec: ModelSpec, place: TierPlacement) -> dict[str, str]:
    """GGUF tensor -> CUDA<i> or CPU under a placement (a tied head is
    `token_embd.weight@output`)."""
    out = {}
    for g in tensor_groups(spec):
        loc = place.groups[g.name]
        dev = CPU_BUFT if loc.kind == CPU else gpu_buft(loc.device)
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
    n_devices: int = 1,
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
    kv_devices = [place.kv[il].device for il in gpu_kv]
    if kv_devices != sorted(kv_devices):
        raise UserError(
            "llama.cpp splits the offloaded layers across GPUs in device order (-ts): each "
            "GPU's layers must follow the previous GPU's"
        )
    want = tensor_devices(spec, place)
    ngl = len(gpu_kv) + 1 if (gpu_kv or want["output_norm.weight"] != CPU_BUFT) else 0
    # -ts: repeating layers per device, and the output layer (index n_layer, after them) on
    # the device holding output_norm when it can follow the layers, else on the last GPU used
    ts = [kv_devices.count(d) for d in range(n_devices)]
    head = place.groups["output"]
    last_used = max(kv_devices, default=0)
    if ngl:
        ts[head.device if head.on_gpu and head.device >= last_used else last_used] += 1
    default = llamacpp_defaults(spec, ngl, ts)
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
    split = ["-ts", ",".join(map(str, ts))] if n_devices > 1 else []
    args = [
        "-fit",
        "off",
        "-c",
        str(n_ctx),
        "-ngl",
        str(ngl),
        *split,
        "-sm",
        "layer",
        "-b",  # llama.cpp caps -ub at -b (2048 unless given)
        str(max(n_ubatch, DEFAULT_N_BATCH)),
        "-ub",
        str(n_ubatch),
        "-fa",
        "on" if flash_attn else "off",
        "-ctk",
        kv_type,
        "-ctv",
        kv_type,
        "-dev",
        ",".join(gpu_buft(d) for d in range(n_devices)),
    ]
    if ot:
        args += ["-ot", ",".join(ot)]
    return args


def tensor_split_args(plan: dict, spec: ModelSpec) -> list[str]:
    """Flags for a tensor-split plan: every layer offloaded, each matrix split evenly (llama.cpp
    ignores -ts under -sm tensor), flash attention on (it requires it)."""
    fp = plan["fingerprint"]
    return [
        "-fit", "off", "-c", str(fp["n_ctx"]), "-ngl", str(spec.hparams.n_layer + 1),
        "-sm", "tensor", "-b", str(max(max(fp["tiers"]), DEFAULT_N_BATCH)),
        "-ub", str(max(fp["tiers"])), "-fa", "on",
        "-ctk", fp["kv_type"], "-ctv", fp["kv_type"],
        "-dev", ",".join(gpu_buft(d) for d in range(len(fp["budget_bytes"]))),
    ]  # fmt: skip


def llamacpp_defaults(spec: ModelSpec, ngl: int, ts: list[int] | None = None) -> dict[str, str]:
    """Where llama.cpp puts each tensor given only `-ngl` and integer `-ts` counts: the last
    ngl - 1 repeating layers and the output layer (index n_layer) offloaded, GPU layer offset k
    on the first device whose cumulative count exceeds k."""
    n = spec.hparams.n_layer
    ts = ts or [ngl]
    first_gpu_layer = n - (ngl - 1) if ngl >= 1 else n + 1
    cumulative = [sum(ts[: d + 1]) for d in range(len(ts))]

    def device_of(il: int) -> str:
        if ngl < 1 or il < first_gpu_layer:
            return CPU_BUFT
        k = il - first_gpu_layer
        return gpu_buft(next(d for d, c in enumerate(cumulative) if c > k))

    out = {}
    for t in spec.tensors:
        il = t.layer
        if t.name == "token_embd.weight":
            out[t.name] = CPU_BUFT  # the input embedding always stays on the CPU
        else:  # output_norm and output are layer n_layer
            out[t.name] = device_of(n if il is None else il)
    if spec.tied_output:
        out["token_embd.weight@output"] = device_of(n)
    return out


def apply_llamacpp_args(spec: ModelSpec, args: list[str]) -> dict[str, str]:
    """llama.cpp's rules applied to flags: `-ngl` first, then each `-ot` pattern searched (not
    matched) against the full tensor name in order, the first match winning."""
    ngl = int(args[args.index("-ngl") + 1])
    ts = [int(x) for x in args[args.index("-ts") + 1].split(",")] if "-ts" in args else None
    devices = llamacpp_defaults(spec, ngl, ts)
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


def export_plan(d: dict, spec: ModelSpec, fmt: str) -> str:
    """A plan's JSON as `fmt`: `llamacpp`, the llama.cpp command line (a `llamacpp`-target or
    tensor-split plan only), or `pshard-registry`, the registry's text (one-GPU plans only)."""
    from .plan import placements_from_json, plan_workload
    from .registry import registry_text

    w, fp = plan_workload(d), d["fingerprint"]
    model = str(spec.path or d["model"]["name"])
    if d.get("split_mode") == "tensor":
        if fmt != "llamacpp":
            raise UserError("a tensor-split plan exports as llama.cpp flags only")
        return command_line(model, tensor_split_args(d, spec))
    tiers = placements_from_json(d, spec)
    if fmt == "llamacpp":
        if d["target"] != "llamacpp":
            raise UserError(
                "this plan is for refengine's runtime (streamed, per tier); solve "
                "with --target llamacpp to export llama.cpp flags"
            )
        args = llamacpp_args(
            spec,
            tiers[min(tiers)],
            w.n_ctx,
            w.kv_type,
            w.flash_attn,
            n_ubatch=max(tiers),
            n_devices=len(fp["budget_bytes"]),
        )
        return command_line(model, args)
    per_tier = {
        t: (place, d["prediction"]["tps"], d["tiers"][str(t)]["memory"]["0"]["total"])
        for t, place in tiers.items()
    }
    if len(fp["budget_bytes"]) > 1:
        raise UserError("the pshard registry export writes one-GPU plans; solve for one GPU")
    return registry_text(
        spec, w, fp["threads"], fp["budget_bytes"][0], per_tier, d["strategy"], d["not_needed"]
    )
