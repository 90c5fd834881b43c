"""HardwareProfile: what the planner knows about a machine, as versioned JSON.

Every number is a `Figure(value, source)`: the value and where it came from, one of
- `measured: ...` — by `refengine profile` on that machine (with the kernels it used and the date);
  figures taken with the NumPy stand-in CPU kernels also say `provisional`;
- `derived: ...` — computed from other figures (the formula is in the source);
- `datasheet: ...` / `public: ...` — a vendor figure or a public measurement, with its reference.

Rates are tables by ggml type name and token count (`RateTable`). The cost model prices a weight
tensor at `tokens` as max(bytes / read rate, 2 * params * tokens / compute rate), so each device
carries a weight-read rate (`matvec_gbps`, what a 1..16-token matvec achieves) and a compute rate
by token count (`matmul_tflops`). A type missing from a table falls back to the `*` row.

Who measures what (docs/contracts.md): the planner issue owns this schema and the CPU side; the
kernels issue measures the GPU side into the same schema.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, dataclass, fields, replace
from pathlib import Path

from refengine.errors import UserError

SCHEMA = "refengine.hardware-profile"
VERSION = 1
ANY_TYPE = "*"
# the CPU matmul row of fp32 weights: our runtime's host prefill multiplies cached fp32 panels
PANEL_TYPE = "F32"
# the rows of one of our host's int8 tiles (`cudarun.kernels.q8_gemm.ROWS`): a weight whose rows
# are not a whole number of tiles stays on the fp32 panels
TILE_ROWS = 16


@dataclass(frozen=True)
class Figure:
    value: float
    source: str

    def to_json(self) -> dict:
        return {"value": self.value, "source": self.source}

    @classmethod
    def from_json(cls, d, where: str) -> "Figure":
        try:
            value, source = float(d["value"]), str(d["source"])
        except (TypeError, KeyError, ValueError):
            raise UserError(f"{where}: expected {{'value': number, 'source': text}}") from None
        if not math.isfinite(value) or value < 0:
            raise UserError(f"{where}: {value} is not a usable figure")
        return cls(value, source)


def log_between(points: dict[float, float], x: float) -> float:
    """The value at x interpolated in log(x) between the nearest of `points` and held constant
    beyond them."""
    xs = sorted(points)
    if x <= xs[0]:
        return points[xs[0]]
    if x >= xs[-1]:
        return points[xs[-1]]
    hi = next(k for k in xs if k >= x)
    lo = xs[xs.index(hi) - 1]
    f = (math.log(x) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return points[lo] + f * (points[hi] - points[lo])


# the attention twins' KV heads (cudarun.measure_cpu.score_twin_config), and the wider twin's
SCORE_TWIN_KV_HEADS = 2
SCORE_WIDE_KV_HEADS = 8


def score_row(depth: int, kv_heads: int) -> str:
    """A score table's row name (`RateTable.at_depth` reads it back)."""
    return str(depth) if kv_heads == SCORE_TWIN_KV_HEADS else f"{depth}@{kv_heads}"


@dataclass(frozen=True)
class RateTable:
    """Achieved rate by ggml type and a size key (tokens, or threads for CPU matvec)."""

    unit: str
    rows: dict[str, dict[int, Figure]]

    def at(self, qtype: str, key: int) -> float:
        """The rate for `qtype` at `key`: interpolated in log(key) between measured keys and held
        constant beyond them; the `*` row when the type was not measured."""
        row = self.rows.get(qtype) or self.rows.get(ANY_TYPE)
        if not row:
            raise UserError(f"the profile has no {self.unit} rate for {qtype} (nor a '*' row)")
        return log_between({k: f.value for k, f in row.items()}, key)

    def at_depth(self, key: int, depth: float, kv_heads: int = SCORE_TWIN_KV_HEADS) -> float:
        """For a table whose rows are named by a depth ("2048") or a depth and KV heads
        ("2048@8"; the first, SCORE_TWIN_KV_HEADS'): the rate at `key` interpolated in log(depth)
        between the rows' of each count of KV heads, then in log(kv_heads) between those, held
        constant beyond them; a `*` row stands for every depth."""
        if ANY_TYPE in self.rows:
            return self.at(ANY_TYPE, key)
        by_heads: dict[int, dict[int, float]] = {}
        for name in self.rows:
            depth_name, _, heads = name.partition("@")
            by_heads.setdefault(int(heads or SCORE_TWIN_KV_HEADS), {})[int(depth_name)] = (
                self.at(name, key))
        return log_between({h: log_between(row, depth) for h, row in by_heads.items()},
                           kv_heads)  # fmt: skip

    def to_json(self) -> dict:
        return {
            "unit": self.unit,
            "rows": {
                t: {str(k): f.to_json() for k, f in sorted(r.items())} for t, r in self.rows.items()
            },
        }

    @classmethod
    def from_json(cls, d, where: str) -> "RateTable":
        try:
            rows = {
                t: {int(k): Figure.from_json(f, f"{where}.{t}.{k}") for k, f in r.items()}
                for t, r in d["rows"].items()
            }
            return cls(str(d["unit"]), rows)
        except (TypeError, KeyError, ValueError, AttributeError):
            raise UserError(
                f"{where}: expected {{'unit': ..., 'rows': {{type: {{n: figure}}}}}}"
            ) from None


@dataclass(frozen=True)
class GPUProfile:
    name: str
    memory_bytes: Figure
    hbm_gbps: Figure  # device memory bandwidth, bytes read + written (a D2D copy)
    matvec_gbps: RateTable  # weight bytes read per second by a 1..16-token matvec, by type
    matmul_tflops: RateTable  # achieved dense rate by type and token count
    h2d_gbps: Figure  # pinned host -> device, one large copy
    d2h_gbps: Figure
    copy_latency_seconds: Figure  # fixed cost of one async copy
    h2d_gbps_while_cpu_computes: Figure  # measured with the CPU busy: they share host memory
    launch_seconds: Figure  # one kernel launched from the host
    graph_kernel_seconds: Figure  # one kernel inside a replayed CUDA graph
    # "cuda", or "rpc": a llama.cpp RPC server (`ggml-rpc-server`) at `endpoint`, a device to
    # llama.cpp only: its rates are its host's CPU, its copies cross the network, and llama.cpp
    # offloads no CPU-held weight's op to it
    backend: str = "cuda"
    endpoint: str = ""

    @property
    def is_rpc(self) -> bool:
        return self.backend == "rpc"


@dataclass(frozen=True)
class CPUProfile:
    name: str
    threads: int  # the thread count the rates below were taken at
    memory_gbps: Figure  # host memory read bandwidth on `threads` threads
    matvec_gbps: RateTable  # weight bytes read per second by a matvec, by type and thread count
    matmul_gflops: RateTable  # by type and token count, on `threads` threads
    sync_seconds: Figure  # one CPU<->GPU hand-off (event wait + activation copy setup)
    # llama.cpp's own CPU kernels, as `llama-bench` ran them (`refengine profile --llama-bin`):
    # what `--target llamacpp` prices a CPU-held matrix at; absent, our kernels' rates stand in
    llamacpp_matmul_gflops: RateTable | None = None  # by type and prompt tokens
    # a layer's cost per prompt token beyond its products' FLOPs at that rate (their starts, the
    # activations' quantization, the nodes between), by type and prompt tokens: what narrow
    # models feel
    llamacpp_prompt_layer_seconds: RateTable | None = None
    llamacpp_matvec_gbps: RateTable | None = None  # weight bytes a generated token reads
    # its attention (flash attention over the f16 cache) in a prompt and in a decode, per query
    # head (and token) and key: rows by depth and KV heads, by head size (`RateTable.at_depth`)
    llamacpp_prompt_score_seconds: RateTable | None = None
    llamacpp_decode_score_seconds: RateTable | None = None
    # our host prefill's attention (scores by BLAS, masked, a row softmax, times V) and gated
    # activation, measured by `refengine profile`: beyond the matrices, what small models feel
    attention_score_seconds: RateTable | None = None  # per query head and key, by head size
    attention_row_seconds: Figure | None = None  # per query head and token
    decode_score_seconds: RateTable | None = None  # our decode's, per query head and key
    # element-wise work, as a prompt's ubatch runs it: serially, BLAS's threads holding the cores
    glu_element_seconds: Figure | None = None  # SiLU(gate) * up, per element
    gelu_element_seconds: Figure | None = None  # GELU(gate) * up (tanh form), per element
    rope_angle_seconds: Figure | None = None  # RoPE, per token and pair: its angle, all heads'
    rope_element_seconds: Figure | None = None  # RoPE over q and k, per rotated element
    # a prompt's routed FFN, per (token, slot) and element of n_embd + n_ff_exp: the rows'
    # grouping by expert, gathers, scatters and weighted sum
    routed_slot_seconds: Figure | None = None
    # a prompt's first BLAS product after a routed layer's experts (Numba's parallel region,
    # whose OpenMP threads spin ~300,000 times on the cores BLAS's threads need), beyond its time
    # alone: once per layer that follows a routed one
    routed_handoff_seconds: Figure | None = None
    # ours: a prompt layer's time beyond what the terms above price of it, per token and element
    # of n_embd (its norms, residual adds and the activations' passes between calls): 512-wide
    # twins took 1.2x their price, SmolLM2 and Gemma-3 1.12-1.18x and a qwen2-1.5B 1.09x, and
    # this, taken off the twins, priced all three within 3-10% in three runs
    # (docs/measured/2026-12-07-prompt-layer-residual.txt)
    prompt_layer_element_seconds: Figure | None = None
    # a host-run layer's fixed cost per ubatch, whatever its width (the calls, the graph's nodes):
    # what a small model's decode feels most; ours, and llama.cpp's CPU backend's
    layer_seconds: Figure | None = None
    llamacpp_layer_seconds: Figure | None = None
    # llama.cpp's decode from the last-level cache: by the bytes a token reads (key), how many
    # times faster than streaming a decode runs (Q8_0 llama twins of a few layers to many); 1
    # past the cache, ~2 here on twins of 12 layers (38 MB)
    llamacpp_decode_cache_speedup: RateTable | None = None
    # ours by type, on twins whose every matrix is of the type: a narrow layer's rows cost beyond
    # their bytes by type (Q8_0's ~40 us, Q5_0's ~110 on 512-wide twins); by threads
    layer_type_seconds: RateTable | None = None
    # the gated activation those twins' decode ran inside both (their FFN width x SiLU's cost per
    # element, serial in the fused layer): the cost model takes it out and prices each layer's
    # own, GELU at 4-5x SiLU's cost an element and FFNs up to 6x the twins' width
    layer_activation_seconds: Figure | None = None
    # the output head in a decode (ours, llama.cpp's): its rows' own cost (each dot product's
    # start and final sum), what a head of 262144 short rows feels, and its bytes' rate (Q8_0)
    head_row_seconds: Figure | None = None
    head_gbps: Figure | None = None
    llamacpp_head_row_seconds: Figure | None = None
    llamacpp_head_gbps: Figure | None = None
    # ours: a decoded token's cost beyond its layers and head (the embedding row, the final norm,
    # the step's Python; 0.14-0.27 ms here, a twentieth of SmolLM2's token), which the head's
    # twins go without and our head carries once a call
    token_seconds: Figure | None = None
    # ours: a routed layer's fixed cost per decoded token (its two fused calls and the router in
    # Python between them), and the q8 row kernels' rate on several tokens (a routed stack's
    # experts at prefill, each on the tokens it drew), by type and token count
    routed_layer_seconds: Figure | None = None
    q8_matmul_gflops: RateTable | None = None
    # ours: a prompt's products on the int8 tiles of a weight repacked once and kept (`q8_gemm`),
    # by type and token count, for the types that repack (rows in whole tiles of TILE_ROWS): the
    # rest run on kept fp32 panels (matmul_gflops' PANEL_TYPE row); absent, every type is priced
    # at the panels' rate
    tile_gflops: RateTable | None = None
    # ours: the activations of those products quantized to int8 per 32 (once per input, serially:
    # `cpu.quantize_activations`), per value; the tiles' rate above is without it: a product of
    # few rows pays it over few FLOPs (640 x 2048 ran at 269 GFLOP/s where 4096 x 4096 ran 463)
    quantize_value_seconds: Figure | None = None
    llamacpp_routed_layer_seconds: Figure | None = None  # llama.cpp's, the same way
    # a routed layer's fixed cost beyond the above for each expert a decode chose (ours,
    # llama.cpp's): where these are measured, the routed layer's figure is its cost before any
    expert_seconds: Figure | None = None
    llamacpp_expert_seconds: Figure | None = None
    # ours by type, on routed twins whose every matrix is of the type: each expert a decode chose
    # costs beyond its bytes by type (Q8_0's 1-5 us, Q4_K's 12-17 on 512-wide twins); by threads
    expert_type_seconds: RateTable | None = None
    # llama.cpp's routed experts (its mul_mat_id) on a prompt, by type and the tokens an expert
    # draws, and in a decode, the expert bytes a token reads per second
    llamacpp_expert_gflops: RateTable | None = None
    llamacpp_expert_gbps: Figure | None = None
    # beyond those FLOPs, each (prompt token, expert chosen) of a routed layer, by type and prompt
    # tokens (the rows' gather and quantization)
    llamacpp_expert_slot_seconds: RateTable | None = None
    # and a routed layer's cost per prompt token beyond a dense FFN's of its FLOPs (the router's
    # softmax and top-k, the experts' weighting and sum), by type and prompt tokens
    llamacpp_routed_token_seconds: RateTable | None = None


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpus: tuple[GPUProfile, ...]
    cpu: CPUProfile
    notes: str = ""

    @property
    def gpu_side_name(self) -> str:
        """The name less its CPU's ("<cpu> + h100" -> "h100"): what its GPU side is called in a
        profile that another CPU measured beside it (kept whole, each reuse named the CPU again)."""
        mine = f"{self.cpu.name} + "
        return self.name[len(mine):] if self.name.startswith(mine) else self.name

    def to_json(self) -> dict:
        def fig_fields(obj) -> dict:
            out = {}
            for k, v in vars(obj).items():
                out[k] = v.to_json() if isinstance(v, (Figure, RateTable)) else v
            return out

        return {
            "schema": SCHEMA,
            "version": VERSION,
            "name": self.name,
            "notes": self.notes,
            "gpus": [fig_fields(g) for g in self.gpus],
            "cpu": fig_fields(self.cpu),
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, d: dict, where: str = "profile") -> "HardwareProfile":
        if not isinstance(d, dict) or d.get("schema") != SCHEMA:
            raise UserError(f"{where}: not a refengine hardware profile")
        if d.get("version") != VERSION:
            raise UserError(
                f"{where}: profile version {d.get('version')} is not {VERSION}; "
                "measure it again with `refengine profile`"
            )
        try:
            gpus = tuple(
                _build(GPUProfile, g, f"{where}.gpus[{i}]") for i, g in enumerate(d["gpus"])
            )
            cpu = _build(CPUProfile, d["cpu"], f"{where}.cpu")
        except KeyError as e:
            raise UserError(f"{where}: missing {e}") from None
        return cls(str(d.get("name", "")), gpus, cpu, str(d.get("notes", "")))

    @classmethod
    def load(cls, path: str | Path) -> "HardwareProfile":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except OSError as e:
            raise UserError(f"{p}: cannot read the profile ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise UserError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_json(d, str(p))


def _build(cls, d: dict, where: str):
    """A dataclass from JSON, each field parsed by its declared type."""
    kwargs = {}
    defaults = {f.name for f in fields(cls) if f.default is not MISSING}
    for name, ftype in cls.__annotations__.items():
        if name not in d and name in defaults:
            continue
        if name not in d:
            raise UserError(f"{where}: missing {name}")
        v = d[name]
        if v is None and name in defaults:
            continue
        if ftype in ("Figure", "Figure | None"):
            kwargs[name] = Figure.from_json(v, f"{where}.{name}")
        elif ftype in ("RateTable", "RateTable | None"):
            kwargs[name] = RateTable.from_json(v, f"{where}.{name}")
        elif ftype == "int":
            kwargs[name] = int(v)
        else:
            kwargs[name] = str(v)
    return cls(**kwargs)


def rpc_device(
    cpu: CPUProfile | None,
    endpoint: str,
    memory_bytes: int,
    server_threads: int,
    h2d_gbps: Figure,
    d2h_gbps: Figure,
    latency_seconds: Figure,
    matvec_gbps: RateTable | None = None,
    matmul_tflops: RateTable | None = None,
    node_seconds: Figure | None = None,
) -> GPUProfile:
    """A llama.cpp RPC server as a device: the link's bandwidth and round trip as its copies, and
    as its rates what the server computed on its own device and threads where they were measured
    (`matvec_gbps`, `matmul_tflops`, `node_seconds`: `refengine profile --rpc`, through
    `cudarun.measure_rpc.measure_rpc_compute`), else its host's CPU figures (`cpu`) at the
    server's thread count. llama.cpp sends a device one command per graph split and the server
    runs the split's nodes one after another: a node costs what the server takes per node
    (launches and graph kernels alike; nothing where not measured), and a split's round trip is
    the copy latency of the activations fetched from it."""
    if matvec_gbps is None or matmul_tflops is None:
        if cpu is None:
            raise ValueError("an RPC device needs its measured rates or its host's CPU figures")
        at = f"derived: the RPC host's CPU ({cpu.name}) at {server_threads} threads"
        # below the fewest threads measured, a matvec's rate scales with the threads
        matvec_gbps = RateTable("GB/s", {
            t: {1: Figure(cpu.matvec_gbps.at(t, server_threads)
                          * min(1.0, server_threads / min(row)), at)}
            for t, row in cpu.matvec_gbps.rows.items()})  # fmt: skip
        matmul_tflops = RateTable("TFLOP/s", {
            t: {k: Figure(f.value * server_threads / cpu.threads / 1000, at)
                for k, f in row.items()}
            for t, row in cpu.matmul_gflops.rows.items()})  # fmt: skip
        hbm = Figure(cpu.memory_gbps.value * min(1.0, server_threads / cpu.threads), at)
    else:
        best = max(f.value for row in matvec_gbps.rows.values() for f in row.values())
        hbm = Figure(best, "derived: the fastest weight read of the server's matvecs")
    per_node = node_seconds or Figure(0.0, "derived: an RPC device runs a graph split as one "
                                           "command")  # fmt: skip
    return GPUProfile(
        name=f"RPC {endpoint}",
        memory_bytes=Figure(float(memory_bytes), f"measured: reported by the server at {endpoint}"),
        hbm_gbps=hbm,
        matvec_gbps=matvec_gbps,
        matmul_tflops=matmul_tflops,
        h2d_gbps=h2d_gbps,
        d2h_gbps=d2h_gbps,
        copy_latency_seconds=latency_seconds,
        # the server's host memory is not the client's: its copies do not slow when we compute
        h2d_gbps_while_cpu_computes=h2d_gbps,
        launch_seconds=per_node,
        graph_kernel_seconds=per_node,
        backend="rpc",
        endpoint=endpoint,
    )


def local_gpus(profile: HardwareProfile) -> tuple[GPUProfile, ...]:
    return tuple(g for g in profile.gpus if not g.is_rpc)


def with_rpc_devices(profile: HardwareProfile, devices: tuple[GPUProfile, ...]) -> HardwareProfile:
    """The profile's local GPUs, then `devices` (RPC servers): llama.cpp's order when the flags
    name them (`-dev CUDA0,...,RPC0,...`)."""
    return replace(profile, gpus=local_gpus(profile) + tuple(devices))


def on_rpc(profile: HardwareProfile, endpoints: list[str]) -> HardwareProfile:
    """The profile over its local GPUs and the RPC servers at `endpoints`, in that order; each
    endpoint must be one the profile measured (`refengine profile --rpc`)."""
    known = {g.endpoint: g for g in profile.gpus if g.is_rpc}
    missing = [e for e in endpoints if e not in known]
    if missing:
        raise UserError(
            f"profile {profile.name} has no RPC device at {', '.join(missing)}"
            + (f" (it has {', '.join(known)})" if known else "")
            + ": measure it with `refengine profile --rpc ...`"
        )
    if len(set(endpoints)) < len(endpoints):
        raise UserError("--rpc names a server twice; llama.cpp takes each server once")
    return with_rpc_devices(profile, tuple(known[e] for e in endpoints))


def rpc_endpoints(profile: HardwareProfile, n_devices: int) -> list[str]:
    """The endpoints of the RPC devices among the profile's first `n_devices`, which must follow
    its local GPUs (llama.cpp numbers a plan's devices so; `with_rpc_devices` orders them so)."""
    devices = profile.gpus[:n_devices]
    kinds = [g.is_rpc for g in devices]
    if kinds != sorted(kinds):
        raise UserError(
            f"profile {profile.name} lists an RPC device before a local GPU; the plan's devices "
            "are its local GPUs first: measure it again with `refengine profile --rpc ...`"
        )
    return [g.endpoint for g in devices if g.is_rpc]


def for_devices(profile: HardwareProfile, n: int) -> HardwareProfile:
    """The profile over `n` devices: where it describes fewer GPUs, its first stands for each
    device it lacks (the stand-in's devices and a GPU's virtual devices have no profile of their
    own), named `NAME*n`."""
    if n <= len(profile.gpus):
        return profile
    more = (profile.gpus[0],) * (n - len(profile.gpus))
    return replace(profile, name=f"{profile.name}*{n}", gpus=profile.gpus + more)
