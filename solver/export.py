"""Exports: a `llamacpp`-target plan as the llama.cpp flags an expert would write for exactly its
placement, and the inverse -- llama.cpp's own placement rules applied to flags -- that the tests use
to prove it.

Flags (docs/llamacpp.md, common/arg.cpp): `-fit off` (else --fit would move things), an explicit
`-c` (the plan's cells, the total over all sequences: `-np N -kvu` shares one cache among N users,
which is what the plan priced), `-ngl K` (the output layer plus the last K-1 repeating layers go to
the GPU, and a layer's KV follows it), integer `-ts` counts over several GPUs, `-sm layer`,
`-b`/`-ub` (the plan's largest ubatch), `-fa`, `-ctk/-ctv`, `-dev CUDA0[,CUDA1...]`; then the
tensors whose plan location differs from that: `--cpu-moe` / `--n-cpu-moe N` where the routed
experts of the first N layers are on the CPU, and `-ot` patterns, one per set of layers and
destination, for the rest. Every override joins one list in command-line order and the first search
match wins, so the `-ot` exceptions come before the MoE flag. A tensor-split plan is `-sm tensor`.
llama.cpp cannot express streamed execution, per-tier plans, a KV placement other than its layer's,
or a quantized V cache without flash attention: a plan needing those is refused with the reason.
"""

from __future__ import annotations

import re
import shlex
from collections import defaultdict

from refengine.errors import UserError
from refengine.layout import ROPE_FREQS
from refengine.spec import ModelSpec, TensorInfo, layer_of

from .budget import DEFAULT_N_BATCH
from .cost import CPU, TierPlacement, check_kv_cache
from .groups import tensor_groups
from .targets import traits

CPU_BUFT = "CPU"


def gpu_buft(device: int) -> str:
    return f"CUDA{device}"


def rpc_buffer(endpoint: str) -> str:
    """llama.cpp's buffer-type name of a one-device RPC server: `RPC0[host:port]` (the index is
    the device's on that server, so every single-device server is RPC0)."""
    return f"RPC0[{endpoint}]"


def on_rpc_servers(args: list[str], endpoints: list[str], first: int = 0) -> list[str]:
    """Flags whose devices CUDA<first>, CUDA<first + 1>, ... are the RPC servers at `endpoints`,
    in order: each as device RPC<j>, its `-ot` destinations as its buffer type `RPC0[host:port]`,
    and `--rpc` before everything (llama.cpp registers a server's device when it reads `--rpc`,
    and refuses `-dev RPC0` before). Servers the flags already name (`--rpc`, RPC<j>) stay
    after the new ones: with `first` 0, servers standing in for a plan's local GPUs
    (`refengine verify --rpc`) come before the plan's own."""
    out = list(args)
    known: list[str] = []
    if "--rpc" in out:
        k = out.index("--rpc")
        known = out[k + 1].split(",")
        del out[k : k + 2]
    dev = out.index("-dev")
    names = out[dev + 1].split(",")
    local = [int(n.removeprefix("CUDA")) for n in names if n.startswith("CUDA")]
    served = [i for i in local if i >= first]
    n_new = max(served) - first + 1 if served else 0
    if n_new > len(endpoints):
        raise UserError(
            f"the plan has {len(local)} local GPU(s) and --rpc names {len(endpoints)} "
            "server(s) to stand in for them; give one each"
        )

    def name(n: str) -> str:
        if n.startswith("RPC"):
            return f"RPC{n_new + int(n.removeprefix('RPC'))}"
        i = int(n.removeprefix("CUDA"))
        return f"RPC{i - first}" if i >= first else n

    out[dev + 1] = ",".join(name(n) for n in names)
    if "-ot" in out:
        k = out.index("-ot") + 1
        out[k] = re.sub(
            r"=CUDA(\d+)(?=,|$)",
            lambda m: "=" + (rpc_buffer(endpoints[int(m.group(1)) - first])
                             if int(m.group(1)) >= first else m.group(0)[1:]),
            out[k],
        )  # fmt: skip
    servers = endpoints[:n_new] + known
    return ["--rpc", ",".join(servers), *out] if servers else out


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


# llama.cpp's LLM_FFN_EXPS_REGEX (common/common.h): the routed experts --cpu-moe and --n-cpu-moe
# move; shared experts (_shexp) and the router (ffn_gate_inp) do not match
EXPERTS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"
MODEL_PLACEHOLDER = "MODEL.gguf"


def moe_rules(flag: str, n: int = 0) -> list[tuple[str, str]]:
    """The overrides `--cpu-moe` or `--n-cpu-moe n` add, in llama.cpp's order."""
    if flag == "--cpu-moe":
        return [(EXPERTS_REGEX, CPU_BUFT)]
    return [(f"blk\\.{il}{EXPERTS_REGEX}", CPU_BUFT) for il in range(n)]


def apply_rules(devices: dict[str, str], rules: list[tuple[str, str]]) -> dict[str, str]:
    """Each tensor to the buffer of the first rule whose regex is found in its name (a tied
    head's second copy, `token_embd.weight@output`, answers to `token_embd.weight`)."""
    compiled = [(re.compile(rx), buft) for rx, buft in rules]
    out = dict(devices)
    for name in out:
        real = name.removesuffix("@output")
        out[name] = next((buft for rx, buft in compiled if rx.search(real)), out[name])
    return out


def _moe_flag(spec: ModelSpec, want: dict[str, str], default: dict[str, str]) -> list[str]:
    """`--cpu-moe` when every routed expert is on the CPU; `--n-cpu-moe N` when those of layers
    0..N-1 are (N as large as the plan allows) and that moves one -ngl would offload; else none."""
    rx = re.compile(EXPERTS_REGEX)
    experts = [t.name for t in spec.tensors if rx.search(t.name)]
    if not experts or all(default[x] == CPU_BUFT for x in experts if want[x] == CPU_BUFT):
        return []
    if all(want[x] == CPU_BUFT for x in experts):
        return ["--cpu-moe"]
    n = 0
    while n < spec.hparams.n_layer and all(
        want[x] == CPU_BUFT for x in experts if layer_of(x) == n
    ):
        n += 1
    moved = any(default[x] != CPU_BUFT for x in experts if layer_of(x) < n)
    return ["--n-cpu-moe", str(n)] if moved else []


def _alternatives(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"({'|'.join(items)})"


def _digits(lo: int, hi: int) -> str:
    return str(lo) if lo == hi else f"[{lo}{hi}]" if hi == lo + 1 else f"[{lo}-{hi}]"


def layers_regex(layers: list[int]) -> str:
    """Layer numbers as decimal ranges, each run of consecutive layers in aligned blocks:
    [3..30] -> ([3-9]|[12][0-9]|30), [0..4] -> [0-4]."""
    pieces = []
    runs: list[list[int]] = []
    for il in sorted(layers):
        if runs and il == runs[-1][1] + 1:
            runs[-1][1] = il
        else:
            runs.append([il, il])
    for lo, hi in runs:
        while lo <= hi:
            block = 1  # the largest power of ten that starts at lo and fits before hi
            while lo and lo % (block * 10) == 0 and lo + block * 10 - 1 <= hi:
                block *= 10
            count = min((hi - lo + 1) // block, 10 - (lo // block) % 10)
            head, first = divmod(lo // block, 10)
            pieces.append(
                (str(head) if head else "")
                + _digits(first, first + count - 1)
                + "[0-9]" * (len(str(block)) - 1)
            )
            lo += count * block
    return _alternatives(pieces)


def _names_regex(stems: list[str]) -> str:
    """Tensor names without their layer prefix as one short alternation, names sharing a first
    word factored: attn_q.weight, attn_k.weight, ffn_norm.weight -> (attn_(q|k)|ffn_norm)\\.weight.
    """
    suffixes = {s.rsplit(".", 1)[1] for s in stems}
    if len(suffixes) > 1:
        return _alternatives([re.escape(s) for s in stems])
    words: dict[str, list[str]] = {}
    for s in stems:
        head, _, rest = s.rsplit(".", 1)[0].partition("_")
        words.setdefault(head, []).append(rest)
    alts = []
    for w, rests in words.items():
        alts += [re.escape(w)] if "" in rests else []  # `output` beside `output_norm`
        rests = [r for r in rests if r]
        tails = {r.rpartition("_")[2] for r in rests}
        if len(rests) > 1 and len(tails) == 1 and all("_" in r for r in rests):  # (gate|up)_exps
            tail = tails.pop()
            heads = [re.escape(r.rpartition("_")[0]) for r in rests]
            alts.append(f"{re.escape(w)}_{_alternatives(heads)}_{re.escape(tail)}")
        elif rests:
            alts.append(f"{re.escape(w)}_{_alternatives([re.escape(r) for r in rests])}")
    return _alternatives(alts) + re.escape("." + suffixes.pop())


def override_patterns(spec: ModelSpec, moves: dict[str, str]) -> list[str]:
    """`-ot` items moving each tensor of `moves` to its buffer: one per destination and set of
    layers, naming the tensors they share (`blk\\.(3|4)\\.ffn_(up|down)\\.weight=CPU`, or
    `blk\\.(3|4)\\.=CPU` for whole layers). Each pattern is the shortest of its forms that finds
    exactly its tensors in the model (the layers left out, then unanchored, then anchored), so no
    two patterns find the same tensor and their order does not matter."""
    layers_of: dict[tuple[str, str], set[int]] = defaultdict(set)  # (stem, buffer) -> layers
    for name, buft in moves.items():
        il = layer_of(name)
        stem = name if il is None else name.split(".", 2)[2]
        layers_of[(stem, buft)].update(() if il is None else (il,))
    sets: dict[tuple[tuple[int, ...], str], list[str]] = defaultdict(list)
    for (stem, buft), layers in layers_of.items():
        sets[(tuple(sorted(layers)), buft)].append(stem)  # () for tensors outside the layers
    names = [t.name for t in spec.tensors]
    out = []
    for (layers, buft), stems in sorted(sets.items()):
        if not layers:
            target = set(stems)
            forms = [_names_regex(sorted(stems, key=names.index))]
        else:
            target = {f"blk.{il}.{s}" for il in layers for s in stems}
            in_order = [n.split(".", 2)[2] for n in names if layer_of(n) == layers[0]]
            prefix = f"blk\\.{layers_regex(list(layers))}\\."
            if all({n for n in names if layer_of(n) == il} <= target for il in layers):
                forms = [prefix]  # whole layers
            else:
                stems_rx = _names_regex(sorted(stems, key=in_order.index))
                forms = [stems_rx, prefix + stems_rx]
        for pattern in forms + [f"^{forms[-1]}", f"^{forms[-1]}$"]:
            rx = re.compile(pattern)
            if {n for n in names if rx.search(n)} == target:
                out.append(f"{pattern}={buft}")
                break
        else:
            raise AssertionError(f"no pattern finds exactly {sorted(target)[:3]}...")
    return out


def llamacpp_args(
    spec: ModelSpec,
    place: TierPlacement,
    n_ctx: int,
    kv_type: str,
    flash_attn: bool,
    n_ubatch: int = 512,
    n_devices: int = 1,
    users: int = 1,
) -> list[str]:
    n = spec.hparams.n_layer
    check_kv_cache(kv_type, flash_attn)
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
    # the NextN blocks, which load nothing, count as layers between the last and the output's
    after = 1 + spec.hparams.n_nextn
    ngl = len(gpu_kv) + after if (gpu_kv or want["output_norm.weight"] != CPU_BUFT) else 0
    # -ts: repeating layers per device, and the output layer (index n_block, after them) on
    # the device holding output_norm when it can follow the layers, else on the last GPU used
    ts = [kv_devices.count(d) for d in range(n_devices)]
    head = place.groups["output"]
    last_used = max(kv_devices, default=0)
    if ngl:
        ts[head.device if head.on_gpu and head.device >= last_used else last_used] += after
    default = llamacpp_defaults(spec, ngl, ts)
    tied_head = want.get("token_embd.weight@output")
    if tied_head is not None and tied_head != default["token_embd.weight@output"]:
        raise UserError("a tied output head cannot be placed apart from llama.cpp's output layer")
    moe = _moe_flag(spec, want, default)
    after_moe = apply_rules(default, moe_rules(*moe[:1], *map(int, moe[1:])) if moe else [])
    moves = {
        name: dev
        for name, dev in want.items()
        if after_moe[name] != dev and not name.endswith("@output")
    }
    ot = override_patterns(spec, moves)
    split = ["-ts", ",".join(map(str, ts))] if n_devices > 1 else []
    parallel = ["-np", str(users), "-kvu"] if users > 1 else []
    args = [
        "-fit", "off", "-c", str(n_ctx), *parallel, "-ngl", str(ngl), *split, "-sm", "layer",
        "-b", str(max(n_ubatch, DEFAULT_N_BATCH)),  # llama.cpp caps -ub at -b (2048 unless given)
        "-ub", str(n_ubatch), "-fa", "on" if flash_attn else "off",
        "-ctk", kv_type, "-ctv", kv_type, "-dev", ",".join(gpu_buft(d) for d in range(n_devices)),
        *(["-ot", ",".join(ot)] if ot else []), *moe,
    ]  # fmt: skip
    if apply_llamacpp_args(spec, args) != want:
        raise AssertionError("exported flags do not reproduce the plan")  # a bug, not the user's
    return args


def tensor_split_args(plan: dict, spec: ModelSpec) -> list[str]:
    """Flags for a tensor-split plan: every layer offloaded, each matrix split evenly (llama.cpp
    ignores -ts under -sm tensor), flash attention on (it requires it)."""
    fp = plan["fingerprint"]
    parallel = ["-np", str(fp["users"]), "-kvu"] if fp["users"] > 1 else []
    return [
        "-fit", "off", "-c", str(fp["n_ctx"]), *parallel, "-ngl", str(spec.hparams.n_block + 1),
        "-sm", "tensor", "-b", str(max(max(fp["tiers"]), DEFAULT_N_BATCH)),
        "-ub", str(max(fp["tiers"])), "-fa", "on",
        "-ctk", fp["kv_type"], "-ctv", fp["kv_type"],
        "-dev", ",".join(gpu_buft(d) for d in range(len(fp["budget_bytes"]))),
    ]  # fmt: skip


def llamacpp_layer(t: TensorInfo, n_block: int) -> int:
    """The layer whose device llama.cpp gives tensor t: its block; for the global tensors, the
    output layer (index n_block), but for rope_freqs, which the first layer creates."""
    if t.layer is not None:
        return t.layer
    return 0 if t.name == ROPE_FREQS else n_block


def llamacpp_defaults(spec: ModelSpec, ngl: int, ts: list[int] | None = None) -> dict[str, str]:
    """Where llama.cpp puts each tensor given only `-ngl` and integer `-ts` counts: the last
    ngl - 1 repeating layers (NextN blocks included) and the output layer (index n_block)
    offloaded, GPU layer offset k on the first device whose cumulative count exceeds k."""
    n = spec.hparams.n_block
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
        if t.name == "token_embd.weight":
            out[t.name] = CPU_BUFT  # the input embedding always stays on the CPU
        else:
            out[t.name] = device_of(llamacpp_layer(t, n))
    if spec.tied_output:
        out["token_embd.weight@output"] = device_of(n)
    return out


def apply_llamacpp_args(spec: ModelSpec, args: list[str]) -> dict[str, str]:
    """llama.cpp's rules applied to flags: `-ngl`/`-ts` first, then the overrides of `-ot`,
    `--cpu-moe` and `--n-cpu-moe` in command-line order, each regex searched (not matched) in the
    full tensor name, the first match winning."""
    ngl = int(args[args.index("-ngl") + 1])
    ts = [int(x) for x in args[args.index("-ts") + 1].split(",")] if "-ts" in args else None
    rules: list[tuple[str, str]] = []
    for i, flag in enumerate(args):
        if flag == "-ot":
            rules += [tuple(item.split("=", 1)) for item in args[i + 1].split(",")]
        elif flag == "--cpu-moe":
            rules += moe_rules(flag)
        elif flag == "--n-cpu-moe":
            rules += moe_rules(flag, int(args[i + 1]))
    return apply_rules(llamacpp_defaults(spec, ngl, ts), rules)


# llama-server flags that take no value; every other flag of ours takes one
_VALUELESS = {"-kvu", "--cpu-moe"}


def llama_bench_args(args: list[str], n_layer: int) -> list[str]:
    """Exported llama-server flags as llama-bench's, for the same placement. llama-bench has no
    `-c` (a test's context is its own tokens) and no `-fit` (it fits only under `-fitt`), times one
    sequence, takes list items apart with '/' (`-ts`, `-dev`) and `-ot` patterns with ';' (a ','
    starts another test), and spells both MoE flags `-ncmoe N`, whose patterns it appends after
    the `-ot` ones as llama-server does (tools/llama-bench)."""
    out: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        value = None if flag in _VALUELESS else args[i + 1]
        i += 1 if value is None else 2
        if flag in ("-fit", "-c"):
            continue
        if flag in ("-np", "-kvu"):
            raise UserError(
                "llama-bench times one sequence: export a plan solved for several users "
                "--format llamacpp and time it with llama-batched-bench"
            )
        if flag == "--cpu-moe":
            flag, value = "-ncmoe", str(n_layer)
        elif flag == "--n-cpu-moe":
            flag = "-ncmoe"
        elif flag in ("-ts", "-dev"):
            value = value.replace(",", "/")
        elif flag == "-ot":
            value = value.replace(",", ";")
        out += [flag] if value is None else [flag, value]
    return out


def command_line(spec: ModelSpec, args: list[str], program: str = "llama-server") -> str:
    """`llama-server -m MODEL ...` (or `llama-bench`'s flags); for a spec-only shape, which has
    no file, MODEL.gguf stands in (`placeholder_note` says so)."""
    if program == "llama-bench":
        args = llama_bench_args(args, spec.hparams.n_layer)
    return shlex.join([program, "-m", str(spec.path or MODEL_PLACEHOLDER), *args])


def placeholder_note(spec: ModelSpec) -> str | None:
    if spec.path is not None:
        return None
    return f"{spec.name} is a spec-only shape: replace {MODEL_PLACEHOLDER} with a GGUF file of it"


def export_plan(d: dict, spec: ModelSpec, fmt: str) -> str:
    """A plan's JSON as `fmt`: `llamacpp`, the llama.cpp command line (a `llamacpp`-target or
    tensor-split plan only), `llama-bench`, the same placement as llama-bench's flags, or
    `pshard-registry`, the registry's text (one-GPU plans only)."""
    from .plan import placements_from_json, plan_workload
    from .registry import registry_text

    w, fp = plan_workload(d), d["fingerprint"]
    flags = fmt in ("llamacpp", "llama-bench")
    program = "llama-bench" if fmt == "llama-bench" else "llama-server"
    # the plan's RPC servers are its last devices (`solver.plan.plan_devices`)
    rpc = fp.get("rpc", [])
    first_rpc = len(fp["budget_bytes"]) - len(rpc)

    def devices_named(args: list[str]) -> list[str]:
        return on_rpc_servers(args, rpc, first_rpc) if rpc else args

    if d.get("split_mode") == "tensor":
        if not flags:
            raise UserError("a tensor-split plan exports as llama.cpp flags only")
        return command_line(spec, devices_named(tensor_split_args(d, spec)), program)
    tiers = placements_from_json(d, spec)
    if flags:
        if not traits(d["target"]).llamacpp_flags:
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
            users=w.users,
        )
        return command_line(spec, devices_named(args), program)
    per_tier = {
        t: (place, d["prediction"]["tps"], d["tiers"][str(t)]["memory"]["0"]["total"])
        for t, place in tiers.items()
    }
    if len(fp["budget_bytes"]) > 1:
        raise UserError("the pshard registry export writes one-GPU plans; solve for one GPU")
    return registry_text(
        spec, w, fp["threads"], fp["budget_bytes"][0], per_tier, d["strategy"], d["not_needed"]
    )
