"""The cost model: time of every tensor group in every location, per tier and context depth, and
`evaluate`, the one function that scores any plan (docs/contracts.md).

Formulas (every rate from the HardwareProfile; M = tokens in the ubatch, the tier):

1. A weight group on a GPU (pinned or streamed) computes in
   max(bytes_read / gpu.matvec_gbps, flops / gpu.matmul_tflops(type, M)),
   flops = 2 * params * M. For an expert stack, bytes_read = nbytes * D / E with
   D = E * (1 - (1 - k/E)^M) distinct experts touched (docs/pshard.md reason 5), and
   flops = 2 * (params / E) * k * M. The output head computes only the rows that need logits
   (one per sequence per ubatch); the embedding is a row gather.
2. On the CPU the same with cpu.matvec_gbps(type, threads) and cpu.matmul_gflops(type, M);
   our runtime's prompt runs a type that repacks on the int8 tiles it keeps (cpu.tile_gflops),
   after quantizing each input once (cpu.quantize_value_seconds per value), the others on kept
   fp32 panels (the F32 row).
   Under llama.cpp, where the profile measured its own kernels, a prompt also pays per token a
   layer's cost beyond its FLOPs by type (shared by the layer's seven products) and, for an
   expert stack, each chosen expert's by type (shared by the layer's stacks).
3. A streamed group is copied host -> GPU every ubatch: nbytes / h2d + copy latency, where h2d is
   the profile's rate *while the CPU computes* whenever the tier's plan also computes on the CPU
   (they share the host memory bus; the embedding's row gather does not count), else the
   standalone rate.
4. Attention at context depth d (per sequence; S sequences share the ubatch): each of the M
   tokens attends to d + (M/S + 1)/2 keys (causal; a sliding layer to at most n_swa), costing
   4 * n_head * head_dim flops per key, and S * d + M cached cells are read; it runs where the
   layer's KV lives. That is a KV stream per sequence (llama.cpp #14363); with one cache shared by
   the sequences (unified, llama.cpp's -kvu, which a llamacpp plan exports) each token scores
   all S * d + M cells, the other sequences' masked. Under llama.cpp a CPU-held layer's attention
   runs on the GPU for ubatches of 32 tokens and more (its scheduler places it between the
   op-offloaded matmuls), copying the cells it reads up first; on the CPU it costs, where the
   profile measured it, a time per query head, token and key by head size and depth (else ggml's
   kernel reads the cells once per query head, n_head / n_head_kv times, at a share of the host's
   bandwidth).
5. Every change of device along the ops (embedding -> each layer's attention side -> attention ->
   FFN matrices -> next layer ... -> head) is a hop: sync + copy latency + activation bytes over
   PCIe (residual rows between layers, the wider FFN rows inside one); GPU to GPU is two (through
   the host).
6. Launches: ~8 element-wise kernels per layer plus one per GPU matrix, at the host launch cost, or
   at the per-kernel graph cost for single-token decode (captured as a CUDA graph).
   Under pshard's runtime (target "pshard") copies run at most at PSHARD_PAGEABLE_H2D_GBPS.
   Under llama.cpp (target "llamacpp") a CPU-held weight runs on the CPU below 32 tokens and is
   copied to the GPU and computed there at 32 and above (op-offload), unoverlapped. Of a CPU-held
   expert stack it copies only the D experts the ubatch routes to (ggml-backend's scheduler reads
   the router's ids back first: one synchronization a layer), one copy per run of consecutive
   used experts, each run padded by up to 512 bytes.
7. KV placed `streamed` (pshard's scheme, for its strategies only: our runtime keeps a layer's KV
   on a GPU or on the CPU) uploads the layer's cached cells before it and downloads the new ones.
   A layer takes max(GPU work, copies) + CPU work on our runtime, which prefetches the next layer's
   streamed tensors while this one computes; on llama.cpp (op-offload copies on the compute
   stream) it takes GPU work + copies + CPU work.
8. A request: each user's prompt runs in ubatches of the largest tier (the last one at the
   smallest tier that holds it), each at its depth, one user after another (TTFT is the last
   user's); decode steps one token per user at the smallest tier >= users, priced at the start and
   end depth (time is linear in depth); switching plans between prefill and decode re-pins the
   bytes the decode plan pins that the prefill plan did not, over PCIe (no latency term).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from refengine.errors import UserError
from refengine.spec import ModelSpec

from .groups import (ATTN_SIDE, EMBD, EXPERTS, FFN_MATRIX, HEAD, Group, expert_nbytes,
                     ffn_rank, routed_nbytes)
from .groups import tensor_groups
from .memory import expected_distinct_experts, kv_cell_nbytes
from .profile import ANY_TYPE, PANEL_TYPE, TILE_ROWS, Figure, HardwareProfile
from .routing import RoutingStats, miss_ratio, prefetch_ratios
from .targets import traits
from .workspace import MAX_DECODE_TOKENS, matrix_launches

PINNED, STREAMED, CPU = "pinned", "streamed", "cpu"
# an expert stack streamed in part: once the router has run, only the experts it chose are copied
ROUTED = "routed"
OP_OFFLOAD_MIN_TOKENS = 32  # llama.cpp's GGML_OP_OFFLOAD_MIN_BATCH
# from this many tokens our host multiplies kept int8 tiles or fp32 panels (cudarun.kernels.cpu's
# BLAS_TOKENS; below it the q8 row kernels)
HOST_PANEL_TOKENS = 8
# (cell, query head) pairs of a decode step from which our host's attention (cudarun.kernels.
# cpu_layer) scores its cells on every thread; below them on one: the parallel region paid ~20 us
# a call more than the serial (qwen2-1.5B's 12 heads: 21 against 0.8 us at depth 0, 29 against 9
# at 32, even at 256 cells, ahead from 1024); at depth 32 that was a thirtieth of the layer
HOST_ATTENTION_PARALLEL_PAIRS = 3072
# Calibrated, each on one cell of llama.cpp #22692 (Qwen3-32B-Q4 at 256K on the RTX 5080 machine),
# which examples/compare_seeds.py then leaves out of its medians:
# - flash attention on a GPU reaches this fraction of the profile's matmul rate (its softmax runs
#   on the scalar units, between two small matmuls per key block); from the TTFT cell;
GPU_ATTENTION_EFFICIENCY = 0.37
# - ggml's CPU flash attention (decode under llama.cpp) reaches this fraction of host memory
#   bandwidth over the bytes it reads; from the TPS cell.
GGML_CPU_ATTENTION_EFFICIENCY = 0.42
# pshard's runtime as measured (target "pshard", for predicting its results only): it streamed from
# pageable host memory, 4-13 GB/s (docs/pshard.md reason 4); the middle of that range.
PSHARD_PAGEABLE_H2D_GBPS = 8.5
ELEMENTWISE_KERNELS_PER_LAYER = 8
# a llama layer's products (Q, K, V, O, gate, up, down): what the profile's llama.cpp cost of a
# layer beyond its FLOPs (`llamacpp_prompt_layer_seconds`) is shared by
LAYER_PRODUCTS = 7
FFN_PRODUCTS = 3  # of them, the FFN's
OBJECTIVES = ("e2e", "tps", "ttft")


@dataclass(frozen=True)
class Operations:
    """What one ubatch moves between the CPU and the devices, by count."""

    copies: int = 0  # weight or KV copies up (H2D into a ring slot or an expert cache)
    all_reduces: int = 0  # sums of partial outputs over every device (tensor split)
    hops: int = 0  # activation copies: CPU <-> a device, or device -> host -> device (two)

    def __add__(self, other: "Operations") -> "Operations":
        return Operations(self.copies + other.copies, self.all_reduces + other.all_reduces,
                          self.hops + other.hops)  # fmt: skip

    def __mul__(self, n: int) -> "Operations":
        return Operations(self.copies * n, self.all_reduces * n, self.hops * n)


def matrices(spec: ModelSpec, g: Group) -> dict[str, tuple[int, ...]]:
    """Group g's matrices (its 2-D tensors, not norms or biases) by name, with their shapes."""
    shapes = {t: spec.by_name[t].shape for t in g.tensors}
    return {t: shape for t, shape in shapes.items() if len(shape) == 2}


def matrix_rows(spec: ModelSpec, g: Group) -> int:
    """The rows of group g's matrices (a head's: its vocabulary)."""
    return sum(shape[0] for shape in matrices(spec, g).values())


def hops_between(a: int, b: int) -> int:
    """Copies that move activations from device a to device b (Loc.where): none on the same
    device, one between the CPU and a GPU, two between GPUs (down to the host and up again:
    client GPUs have no peer link)."""
    return 0 if a == b else 2 if a >= 0 and b >= 0 else 1


@dataclass(frozen=True)
class Loc:
    """Where a group lives in one tier: pinned on / streamed to GPU `device` (an expert stack
    also routed: only its chosen experts copied), or on the CPU."""

    kind: str
    device: int = 0
    # a routed stack's expert cache: this many of its experts stay resident across ubatches
    # (`cudarun.expert_cache`), so a ubatch copies only those it misses; `prefetch`: the copies of
    # the experts the layer's router predicts from the layer's input start before it routes
    cache: int = 0
    prefetch: bool = False

    @property
    def on_gpu(self) -> bool:
        return self.kind != CPU

    @property
    def where(self) -> int:
        """The device the data is used on: a GPU's index, or -1 for the CPU."""
        return self.device if self.kind != CPU else -1

    def __str__(self) -> str:
        if self.kind == CPU:
            return CPU
        cache = f"+{self.cache}{'p' if self.prefetch else ''}" if self.cache else ""
        return f"{self.kind}:{self.device}{cache}"

    @classmethod
    def parse(cls, s: str) -> "Loc":
        if s == CPU:
            return cls(CPU)
        kind, rest = s.split(":")
        dev, _, cache = rest.partition("+")
        return cls(kind, int(dev), int(cache.removesuffix("p") or 0), cache.endswith("p"))


@dataclass(frozen=True)
class Workload:
    n_ctx: int  # cells of the unified KV cache, shared by all users (llama.cpp's -c)
    prompt_tokens: int
    gen_tokens: int
    users: int = 1
    kv_type: str = "f16"
    flash_attn: bool = True
    threads: int = 0  # 0: the profile's CPU thread count
    # the users share one cache and attention runs over all of its cells, masked (llama.cpp's
    # -kvu); else a KV stream per user of n_ctx / users cells (llama.cpp #14363)
    unified: bool = False
    # the routers' measured habits on the user's prompts (`solver.routing`); None: uniform
    routing: "RoutingStats | None" = None
    # llama.cpp's first device computes CPU-held weights of ubatches of 32 tokens and more: a GPU
    # does, an RPC server does not (then the CPU computes them, its devices mixing the outputs)
    op_offload: bool = True

    def __post_init__(self) -> None:
        check_kv_cache(self.kv_type, self.flash_attn)


def check_kv_cache(kv_type: str, flash_attn: bool) -> None:
    """llama.cpp stores a quantized V cache only with flash attention (llama-context.cpp)."""
    if kv_type != "f16" and not flash_attn:
        raise UserError(
            f"a {kv_type} KV cache needs flash attention (llama.cpp quantizes the V cache only "
            f"with it): use --fa on, or --kv-type f16 with --fa off"
        )


@dataclass
class Terms:
    """Seconds of one ubatch, by kind of work."""

    gpu: float = 0.0
    copy: float = 0.0
    cpu: float = 0.0
    latency: float = 0.0  # hops and launches
    total: float = 0.0

    def add(self, other: "Terms") -> None:
        for k in ("gpu", "copy", "cpu", "latency", "total"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    @property
    def bound(self) -> str:
        parts = {
            "GPU compute": self.gpu,
            "PCIe copies": self.copy,
            "CPU compute": self.cpu,
            "latency": self.latency,
        }
        return max(parts, key=parts.get)


@dataclass(frozen=True)
class TierPlacement:
    """What `evaluate` needs of one tier of a plan."""

    groups: dict[str, Loc]  # group name -> location
    kv: dict[int, Loc]  # layer -> Loc(PINNED, device) or Loc(CPU)


@dataclass
class Prediction:
    ttft_seconds: float
    decode_seconds: float  # all generated tokens, plan switches included
    tps: float  # generated tokens per second, summed over users
    e2e_seconds: float
    per_tier: dict[int, dict[int, Terms]] = field(default_factory=dict)  # tier -> depth -> terms
    switch_seconds: float = 0.0

    def objective(self, name: str) -> float:
        """Seconds to minimize for objective `name`."""
        return {"e2e": self.e2e_seconds, "ttft": self.ttft_seconds, "tps": self.decode_seconds}[
            name
        ]


class CostModel:
    """Rates bound to one model, profile and workload; prices groups, layers and ubatches."""

    def __init__(
        self,
        spec: ModelSpec,
        profile: HardwareProfile,
        workload: Workload,
        target: str = "refengine",
    ):
        self.spec, self.profile, self.w = spec, profile, workload
        self.target, self.traits = target, traits(target)
        # a llamacpp plan exports -np N -kvu: its users share one cache
        self.unified = workload.unified or self.traits.shares_one_cache
        self.overlap = self.traits.overlaps_copies
        self.groups = tensor_groups(spec)
        self.by_layer: dict[int | None, list[Group]] = {}
        for g in self.groups:
            self.by_layer.setdefault(g.layer, []).append(g)
        for il, groups in self.by_layer.items():  # each layer's groups in compute order
            if il is not None:
                groups.sort(key=lambda g: -1 if g.kind == ATTN_SIDE else
                            ffn_rank(g.name.split(".")[2]))  # fmt: skip
        self.threads = workload.threads or profile.cpu.threads
        self.cell_nbytes = kv_cell_nbytes(spec, workload.kv_type)
        hp = spec.hparams
        # activations crossing inside a layer: the wider of the residual and the FFN's inner rows
        self.hop_width = max(hp.n_embd, hp.n_ff_active)
        self._panel_launches: dict[str, int] = {}
        self._layer_fixed: dict[tuple[int, str], Figure | None] = {}

    def effective(self, g: Group, loc: Loc, tokens: int) -> Loc:
        """Where g really runs: llama.cpp copies CPU-held weights to the GPU for ubatches of 32
        tokens and more (op-offload); the embedding's row gather stays on the CPU."""
        if (
            self.traits.op_offload
            and self.profile.gpus  # llama.cpp's CPU backend alone offloads nothing
            and loc.kind == CPU
            and g.kind != EMBD
            and tokens >= OP_OFFLOAD_MIN_TOKENS
        ):
            return Loc(STREAMED)
        return loc

    # -- one group ---------------------------------------------------------------------------

    def work(self, g: Group, tokens: int) -> tuple[float, float]:
        """(bytes read, flops) of group g for a ubatch of `tokens`."""
        hp = self.spec.hparams
        if g.kind == EXPERTS:
            touched = expected_distinct_experts(hp.n_expert, hp.n_expert_used, tokens)
            return (
                g.nbytes * touched / hp.n_expert,
                2.0 * g.params / hp.n_expert * hp.n_expert_used * tokens,
            )
        if g.kind == EMBD:
            return g.nbytes / hp.n_vocab * tokens, 0.0
        if g.kind == HEAD:
            return g.nbytes, 2.0 * g.params * min(tokens, self.w.users)
        return g.nbytes, 2.0 * g.params * tokens

    def gpu_seconds(self, g: Group, tokens: int, device: int = 0) -> float:
        gpu = self.profile.gpus[device]
        nbytes, flops = self.work(g, tokens)
        return max(
            nbytes / (gpu.matvec_gbps.at(g.qtype, tokens) * 1e9),
            flops / (gpu.matmul_tflops.at(g.qtype, tokens) * 1e12),
        )

    def cpu_seconds(self, g: Group, tokens: int) -> float:
        cpu = self.profile.cpu
        nbytes, flops = self.work(g, tokens)
        # llama.cpp's own kernels where the profile measured them (`measure_llamacpp`)
        llama = self.traits.ggml_cpu
        matvec = (cpu.llamacpp_matvec_gbps if llama and cpu.llamacpp_matvec_gbps
                  else cpu.matvec_gbps)  # fmt: skip
        read = nbytes / (matvec.at(g.qtype, self.threads) * 1e9)
        head_gbps = cpu.llamacpp_head_gbps if llama else cpu.head_gbps
        head_row = cpu.llamacpp_head_row_seconds if llama else cpu.head_row_seconds
        if g.kind == HEAD and tokens == 1 and head_gbps and head_row:
            # the head apart (measured on Q8_0 heads, other types at their matvec's ratio to it):
            # a head of many short rows pays each row's own start
            ratio = matvec.at(g.qtype, self.threads) / matvec.at("Q8_0", self.threads)
            read = (nbytes / (head_gbps.value * ratio * 1e9)
                    + matrix_rows(self.spec, g) * head_row.value)  # fmt: skip
        if llama and g.kind == EXPERTS and cpu.llamacpp_expert_gbps:
            read = nbytes / (cpu.llamacpp_expert_gbps.value * 1e9)  # its mul_mat_id's, apart
        # a host-run layer's fixed cost (its calls, the graph's nodes), once per ubatch; a routed
        # layer's own where measured (ours: two fused calls, the router in Python between;
        # llama.cpp's: the router's, top-k's and the experts' nodes)
        fixed = cpu.llamacpp_layer_seconds if llama else cpu.layer_seconds
        hp = self.spec.hparams
        per_expert = 0.0
        if hp.routed(g.layer):
            fixed = (cpu.llamacpp_routed_layer_seconds if llama else
                     cpu.routed_layer_seconds) or fixed  # fmt: skip
            each = cpu.llamacpp_expert_seconds if llama else cpu.expert_seconds
            if not llama and g.kind == ATTN_SIDE:  # by its stacks' types, where measured
                each = self.our_expert_fixed(g.layer) or each
            if each:  # each expert the ubatch's tokens chose starts its own products
                per_expert = each.value * expected_distinct_experts(hp.n_expert,
                                                                    hp.n_expert_used, tokens)
        dense_ours = not llama and not hp.routed(g.layer)
        if fixed and g.kind == ATTN_SIDE and dense_ours:
            fixed = self.our_layer_fixed(g.layer) or fixed
        fixed = fixed.value + per_expert if fixed and g.kind == ATTN_SIDE else 0.0
        twins_act = cpu.layer_activation_seconds
        if twins_act and dense_ours and g.kind == ATTN_SIDE:
            fixed = max(fixed - twins_act.value, 0.0)  # the layer's own is priced with ffn_up
        if g.kind == HEAD and not llama and cpu.token_seconds:  # the step's own cost, once a
            fixed += cpu.token_seconds.value  # call, with the head the step ends at
        if tokens == 1:  # the matvec's measured rate covers its arithmetic; the matmul rate,
            # measured from 64 tokens on and held below them, priced a decode token 3-6x slow
            if twins_act and dense_ours and g.name.endswith(".ffn_up"):
                read += self.decode_activation_seconds()
            return read + fixed
        if g.kind == EXPERTS:  # each expert multiplies the tokens it drew
            touched = expected_distinct_experts(hp.n_expert, hp.n_expert_used, tokens)
            drawn = max(1, round(tokens * hp.n_expert_used / touched))
        if llama and g.kind == EXPERTS and cpu.llamacpp_expert_gflops:
            rate = cpu.llamacpp_expert_gflops.at(g.qtype, drawn)
            return (max(read, flops / (rate * 1e9)) + fixed
                    + tokens * self.llamacpp_beyond_seconds(g, tokens))  # fmt: skip
        if llama and cpu.llamacpp_matmul_gflops:
            rate = cpu.llamacpp_matmul_gflops.at(g.qtype, tokens)
            return (max(read, flops / (rate * 1e9)) + fixed
                    + tokens * self.llamacpp_beyond_seconds(g, tokens))  # fmt: skip
        qtype, rates, at = g.qtype, cpu.matmul_gflops, tokens
        q8 = cpu.q8_matmul_gflops
        if not llama and g.kind == EXPERTS and q8 and qtype in q8.rows:
            rates, at = q8, drawn  # our host runs a stack's experts on the q8 rows
        elif not llama and tokens >= HOST_PANEL_TOKENS and self.host_tiles(g):
            rates = cpu.tile_gflops  # our host multiplies the int8 tiles it keeps
            if cpu.quantize_value_seconds:  # their inputs quantized first, serially
                fixed += tokens * self.quantized_values(g) * cpu.quantize_value_seconds.value
        elif not llama and tokens >= HOST_PANEL_TOKENS and PANEL_TYPE in rates.rows:
            qtype = PANEL_TYPE  # our host multiplies the fp32 panels it keeps, at BLAS's rate
        seconds = max(read, flops / (rates.at(qtype, at) * 1e9)) + fixed
        if not llama:  # our host's element-wise work beside the matrices, where measured
            seconds += tokens * self.host_elementwise_seconds(g, tokens)
            beyond = cpu.prompt_layer_element_seconds
            if beyond and g.kind == ATTN_SIDE and tokens >= HOST_PANEL_TOKENS:
                seconds += tokens * hp.n_embd * beyond.value
            if (g.kind == ATTN_SIDE and g.layer > 0 and hp.routed(g.layer - 1)
                    and tokens >= HOST_PANEL_TOKENS and cpu.routed_handoff_seconds):  # fmt: skip
                seconds += cpu.routed_handoff_seconds.value  # after the last layer's experts
        return seconds

    def host_tiles(self, g: Group) -> bool:
        """Whether our host's prompt multiplies g on int8 tiles (`tile_gflops`): its type repacks
        and every matrix of it has its rows in whole tiles."""
        tiles = self.profile.cpu.tile_gflops
        return bool(tiles) and g.qtype in tiles.rows and all(
            shape[0] % TILE_ROWS == 0 for shape in matrices(self.spec, g).values())

    def quantized_values(self, g: Group) -> float:
        """Values a prompt token's inputs to g's products hold, each input quantized once: Q, K
        and V read one; gate and up read one, half of it priced to each."""
        inputs = {}
        for t, shape in matrices(self.spec, g).items():
            role = t.split(".")[-2]
            inputs["qkv" if role in ("attn_q", "attn_k", "attn_v") else role] = shape[1]
        gate_up = {"ffn_gate", "ffn_up"}
        shared = g.name.split(".")[-1] in gate_up and gate_up <= {
            x.name.split(".")[-1] for x in self.by_layer[g.layer]}  # fmt: skip
        return sum(inputs.values()) / (2 if shared else 1)

    def llamacpp_beyond_seconds(self, g: Group, tokens: int) -> float:
        """A prompt token's cost in llama.cpp's CPU products of g beyond their FLOPs, where the
        profile measured it: a layer's (on llamas of one type) shared by its products, the
        attention side's LAYER_PRODUCTS - FFN_PRODUCTS and each FFN matrix's one; a routed
        stack's, each expert chosen and the routed layer's own cost per token (on qwen3moe of one
        type) shared by the layer's stacks."""
        cpu, hp = self.profile.cpu, self.spec.hparams
        if g.kind == EXPERTS and cpu.llamacpp_expert_slot_seconds:
            stacks = sum(1 for x in self.by_layer[g.layer] if x.kind == EXPERTS)
            slot = cpu.llamacpp_expert_slot_seconds.at(g.qtype, tokens)
            own = cpu.llamacpp_routed_token_seconds
            own = own.at(g.qtype, tokens) if own else 0.0
            return (hp.n_expert_used * slot + own) / stacks
        if g.kind in (ATTN_SIDE, FFN_MATRIX) and cpu.llamacpp_prompt_layer_seconds:
            share = (LAYER_PRODUCTS - FFN_PRODUCTS if g.kind == ATTN_SIDE else 1) / LAYER_PRODUCTS
            return share * cpu.llamacpp_prompt_layer_seconds.at(g.qtype, tokens)
        return 0.0

    def our_layer_fixed(self, il: int) -> Figure | None:
        """Our decode layer's cost beyond its bytes, by its matrices' types as the profile
        measured them, weighted by each type's share of the layer's bytes."""
        return self._by_types(il, "layer_type_seconds", lambda g: True)

    def our_expert_fixed(self, il: int) -> Figure | None:
        """Our cost of each expert a decode chose beyond its bytes, by the types of the layer's
        expert stacks as the profile measured them, weighted by their bytes."""
        return self._by_types(il, "expert_type_seconds", lambda g: g.kind == EXPERTS)

    def _by_types(self, il: int, field: str, which) -> Figure | None:
        """A per-type figure of the profile's (`field`) for layer il's groups that `which`
        keeps, each type weighted by its share of their bytes."""
        if (il, field) not in self._layer_fixed:  # asked for every pricing of the layer
            table = getattr(self.profile.cpu, field)
            mats = [g for g in self.by_layer[il] if g.nbytes and which(g)]
            total = sum(g.nbytes for g in mats)
            self._layer_fixed[il, field] = Figure(
                sum(g.nbytes * table.at(g.qtype, self.threads) for g in mats) / total,
                f"the layer's types' {field}, by their bytes") if table and total else None
        return self._layer_fixed[il, field]

    def gate_element_seconds(self) -> Figure | None:
        """Our host's act(gate) * up per element, for the architecture's activation."""
        cpu = self.profile.cpu
        return cpu.gelu_element_seconds if self.spec.arch.ffn_act == "gelu" else (
            cpu.glu_element_seconds)  # fmt: skip

    def decode_activation_seconds(self) -> float:
        """A dense layer's gated activation in our fused decode: serial, between its parallel
        products."""
        act = self.gate_element_seconds()
        return self.spec.hparams.n_ff * act.value if act else 0.0

    def host_elementwise_seconds(self, g: Group, tokens: int) -> float:
        """A token's element-wise work on our host that rides with group g: act(gate) * up with
        ffn_up (each slot's with a routed stack's up), RoPE over q and k with the attention side
        (each of the two calls computes its angles once for all its heads). Measured as a
        prompt's ubatch runs them, serially beside BLAS; below HOST_PANEL_TOKENS, where the
        products are Numba's own, its thread team shares them."""
        cpu, hp = self.profile.cpu, self.spec.hparams
        share = 1 if tokens >= HOST_PANEL_TOKENS else max(1, self.threads)
        act = self.gate_element_seconds()
        if act and g.name.endswith(".ffn_up"):
            return hp.n_ff * act.value / share
        if act and g.name.endswith(".ffn_up_exps"):  # each slot's act; from the BLAS tier on,
            # the rows' bookkeeping around the stack's products (below it, one fused call)
            slot = cpu.routed_slot_seconds.value if cpu.routed_slot_seconds else 0.0
            rows = (hp.n_embd + hp.n_ff_exp) * slot if tokens >= HOST_PANEL_TOKENS else 0.0
            return hp.n_expert_used * (hp.n_ff_exp * act.value / share + rows)
        if cpu.rope_element_seconds and g.kind == ATTN_SIDE:
            angles = hp.n_rot * cpu.rope_angle_seconds.value if cpu.rope_angle_seconds else 0.0
            elements = (hp.n_head + hp.n_head_kv) * hp.n_rot * cpu.rope_element_seconds.value
            return (angles + elements) / share
        return 0.0

    def copy_seconds(self, nbytes: float, device: int, cpu_busy: bool) -> float:
        gpu = self.profile.gpus[device]
        rate = gpu.h2d_gbps_while_cpu_computes.value if cpu_busy else gpu.h2d_gbps.value
        if self.traits.pageable_copies:
            rate = min(rate, PSHARD_PAGEABLE_H2D_GBPS)
        return nbytes / (rate * 1e9) + gpu.copy_latency_seconds.value

    def routed_copy(self, g: Group, held: Loc) -> bool:
        """Whether llama.cpp op-offloads g copying only its routed experts: a CPU-held expert
        stack (ggml-backend's scheduler, for a MUL_MAT_ID whose weight is in a host buffer)."""
        return self.traits.op_offload and g.kind == EXPERTS and held.kind == CPU

    def routed_copy_seconds(self, g: Group, tokens: int, device: int, cpu_busy: bool) -> float:
        """An expert stack's selective copy (llama.cpp's op-offload, our runtime's routed
        streaming): the D experts a ubatch touches, as runs of
        consecutive ids (one copy each, padded by min(expert, 512) bytes but at the last expert);
        with each expert used independently with p = D/E, E p (1 - p) + p^2 runs are expected,
        counting only those not ending at the last expert for the padding."""
        hp = self.spec.hparams
        e = hp.n_expert
        used = expected_distinct_experts(e, hp.n_expert_used, tokens)
        p = used / e
        runs = p + (e - 1) * p * (1 - p)
        padded_runs = runs - p  # a run ending at the last expert copies no padding
        expert_nbytes = g.nbytes / e
        nbytes = expert_nbytes * used + padded_runs * min(expert_nbytes, 512)
        latency = self.profile.gpus[device].copy_latency_seconds.value
        return self.copy_seconds(nbytes, device, cpu_busy) + (runs - 1) * latency

    def routed_copies(self, loc: Loc, tokens: int) -> tuple[float, float]:
        """Expected experts a routed stack copies for a ubatch of `tokens`, (before its router
        chose: prefetch, after it): of the D = E (1 - (1 - k/E)^M) it touches, those its expert
        cache misses (`solver.routing`)."""
        hp = self.spec.hparams
        used = expected_distinct_experts(hp.n_expert, hp.n_expert_used, tokens)
        routing = self.w.routing
        if loc.prefetch and routing is not None:
            early, late = prefetch_ratios(routing, loc.cache)
            return used * early, used * late
        return 0.0, used * miss_ratio(routing, hp.n_expert, loc.cache)

    def routed_terms(self, g: Group, loc: Loc, tokens: int, cpu_busy: bool) -> tuple[float, float]:
        """(seconds of copies that overlap the device's work, seconds the device waits) of a
        routed stack: without a cache, the selective copy after the router; with one, each
        expert it misses copied on its own into the cache, the predicted ones (prefetch) while
        the layer's attention runs."""
        if not loc.cache:
            return 0.0, self.routed_copy_seconds(g, tokens, loc.device, cpu_busy)
        early, late = self.routed_copies(loc, tokens)
        per, rest = expert_nbytes(self.spec, g), routed_nbytes(self.spec, g, 0)
        latency = self.profile.gpus[loc.device].copy_latency_seconds.value
        copies = lambda n, nbytes: (  # noqa: E731
            self.copy_seconds(nbytes, loc.device, cpu_busy) + max(n - 1, 0) * latency if n else 0.0
        )
        return copies(early, early * per), copies(late + (rest > 0), late * per + rest)

    def expert_copy_nbytes(self, place: TierPlacement, tokens: int) -> float:
        """Bytes of expert stacks our runtime copies up for a ubatch of `tokens`: a streamed
        stack whole, a routed one's experts (`routed_copies`) and its other tensors."""
        total = 0.0
        for g in self.groups:
            loc = place.groups[g.name]
            if g.kind == EXPERTS and loc.kind == STREAMED:
                total += g.nbytes
            elif g.kind == EXPERTS and loc.kind == ROUTED:
                total += routed_nbytes(self.spec, g, 0)  # copied whole beside the experts
                total += expert_nbytes(self.spec, g) * sum(self.routed_copies(loc, tokens))
        return total

    def ids_readback_seconds(self, tokens: int, device: int) -> float:
        """The scheduler waits for the router's ids (k int32 a token) on the GPU, once a layer."""
        gpu = self.profile.gpus[device]
        nbytes = 4.0 * tokens * self.spec.hparams.n_expert_used
        return (
            self.profile.cpu.sync_seconds.value
            + gpu.copy_latency_seconds.value
            + nbytes / (gpu.d2h_gbps.value * 1e9)
        )

    # -- attention and hops ------------------------------------------------------------------

    def attention_seconds(
        self, il: int, tokens: int, depth: int, loc: Loc, sequences: int = 1
    ) -> float:
        hp = self.spec.hparams
        if hp.recurrent(il):  # (as many figures as depths asked for)
            return np.zeros_like(depth, dtype=float) + self.delta_net_seconds(tokens, loc,
                                                                               sequences)
        keys = depth + (tokens / sequences + 1) / 2
        cells = sequences * depth + tokens
        if self.spec.is_swa(il):
            keys = np.minimum(keys, hp.n_swa)
            cells = np.minimum(cells, sequences * hp.n_swa + tokens)
        if self.unified and sequences > 1:  # every token scores every cell in use, masked
            keys = cells
        flops = 4.0 * hp.n_head * hp.head_dim * tokens * keys
        nbytes = cells * self.cell_nbytes
        if loc.on_gpu:
            gpu = self.profile.gpus[loc.device]
            return np.maximum(
                nbytes / (gpu.matvec_gbps.at("F16", 1) * 1e9),
                flops / (GPU_ATTENTION_EFFICIENCY * gpu.matmul_tflops.at("F16", tokens) * 1e12),
            )
        cpu = self.profile.cpu
        gbps = cpu.memory_gbps.value
        if self.traits.ggml_cpu:
            measured = (cpu.llamacpp_prompt_score_seconds if tokens > 1
                        else cpu.llamacpp_decode_score_seconds)  # fmt: skip
            if measured:
                # per query head and key, by head size, the span of keys (the depths measured)
                # and KV heads: not its bytes, as heads of 128 take 1.4x the time per key of heads
                # of 64, not 2x
                score = np.vectorize(lambda k: measured.at_depth(hp.head_dim, k, hp.n_head_kv),
                                     otypes=[float])(keys)  # fmt: skip
                return np.maximum(nbytes / (gbps * 1e9), hp.n_head * tokens * keys * score)
            # unmeasured: its kernel reads the KV head once per query head
            nbytes *= hp.n_head / hp.n_head_kv
            gbps *= GGML_CPU_ATTENTION_EFFICIENCY
        if (not self.traits.ggml_cpu and tokens >= HOST_PANEL_TOKENS
                and cpu.attention_score_seconds and cpu.attention_row_seconds):  # fmt: skip
            # our host prefill scores every cell of its range, the later ones masked, and its
            # softmax's passes over the scores cost more than the products' FLOPs
            rows = hp.n_head * tokens
            score = cpu.attention_score_seconds.at(ANY_TYPE, hp.head_dim)
            return np.maximum(nbytes / (gbps * 1e9),
                              rows * (cells * score + cpu.attention_row_seconds.value))
        # our decode's attention (the fused layer's, cell by cell), where measured
        if not self.traits.ggml_cpu and tokens < HOST_PANEL_TOKENS and cpu.decode_score_seconds:
            score = cpu.decode_score_seconds.at(ANY_TYPE, hp.head_dim)  # on the profile's threads
            # Gemma-3's windows of 512 cells under 4 heads stay on one thread at any depth
            serial = tokens * keys * hp.n_head < HOST_ATTENTION_PARALLEL_PAIRS
            score = np.where(serial, score * cpu.threads, score)
            return np.maximum(nbytes / (gbps * 1e9), hp.n_head * tokens * keys * score)
        return np.maximum(
            nbytes / (gbps * 1e9),
            flops / (cpu.matmul_gflops.at("F16", tokens) * 1e9),
        )

    def delta_net_seconds(self, tokens: int, loc: Loc, sequences: int = 1) -> float:
        """A recurrent layer's mixing in place of attention, whatever the depth: each token
        updates and reads its sequence's state (about 6 flops a state value), and each state is
        read and written once a ubatch."""
        hp = self.spec.hparams
        flops = 6.0 * hp.ssm_state * hp.ssm_inner * tokens
        nbytes = 2.0 * sequences * hp.state_nbytes
        if loc.on_gpu:
            gpu = self.profile.gpus[loc.device]
            return max(nbytes / (gpu.matvec_gbps.at("F16", 1) * 1e9),
                       flops / (GPU_ATTENTION_EFFICIENCY * gpu.matmul_tflops.at("F16", tokens)
                                * 1e12))  # fmt: skip
        cpu = self.profile.cpu
        return max(nbytes / (cpu.memory_gbps.value * 1e9),
                   flops / (cpu.matmul_gflops.at("F16", tokens) * 1e9))

    def attention_loc(self, kv: Loc, tokens: int, device: int = 0) -> Loc:
        """Where a layer's attention runs: with its KV, except under llama.cpp for ubatches of 32
        tokens and more, whose scheduler puts a CPU-held layer's attention between its two
        op-offloaded matmuls, on the GPU, and copies the cached cells up (ggml-backend.c pass 2
        skips FLASH_ATTN_EXT in pass 1, then expands the GPU assignment over it)."""
        if (kv.on_gpu or not self.traits.op_offload or tokens < OP_OFFLOAD_MIN_TOKENS
                or not self.profile.gpus):  # fmt: skip
            return kv
        return Loc(STREAMED, device)

    def kv_stream_nbytes(self, il: int, tokens: int, depth: int, sequences: int) -> tuple[int, int]:
        """Bytes a streamed KV moves for one ubatch: the cells attention reads (up) and the new
        ones (down)."""
        cells = sequences * depth + tokens
        if self.spec.is_swa(il):
            cells = np.minimum(cells, sequences * self.spec.hparams.n_swa + tokens)
        return cells * self.cell_nbytes, tokens * self.cell_nbytes

    def hop_seconds(self, tokens: int, width: int, device: int = 0) -> float:
        gpu = self.profile.gpus[device]
        return (
            self.profile.cpu.sync_seconds.value
            + gpu.copy_latency_seconds.value
            + 4.0 * tokens * width / (gpu.h2d_gbps.value * 1e9)
        )

    def group_launches(self, g: Group, tokens: int) -> int:
        """Launches of a group's products on our runtime: one a product, but past the matvec
        tokens each product is a dequantize and a cuBLAS call per fp16 panel
        (`workspace.matrix_launches`); the experts' pass is one launch either way."""
        if not self.traits.panel_launches or g.kind == EXPERTS or tokens <= MAX_DECODE_TOKENS:
            return 1
        if g.name not in self._panel_launches:
            by_name = self.spec.by_name
            self._panel_launches[g.name] = sum(
                matrix_launches(self.spec, n, tokens) for n in g.tensors
                if len(by_name[n].shape) == 2
            )
        return self._panel_launches[g.name]

    def launch_seconds(self, n_kernels: int, tokens: int, device: int = 0) -> float:
        gpu = self.profile.gpus[device]
        per = gpu.graph_kernel_seconds.value if tokens == 1 else gpu.launch_seconds.value
        return n_kernels * per

    # -- a layer, a ubatch -------------------------------------------------------------------

    def layer_terms(
        self,
        il: int,
        place: TierPlacement,
        tokens: int,
        depth: int,
        cpu_busy: bool,
        sequences: int = 1,
        prev: int = 0,
    ) -> Terms:
        """One layer; `prev`: the device (Loc.where) the residual stream comes from (the
        previous layer's last op, or the embedding)."""
        hp, t = self.spec.hparams, Terms()
        groups = self.by_layer[il]
        gpu_mats, ids_read = 0, False
        for g in groups:
            loc = self.effective(g, place.groups[g.name], tokens)
            if loc.on_gpu:
                t.gpu += self.gpu_seconds(g, tokens, loc.device)
                gpu_mats += self.group_launches(g, tokens)
                if loc.kind == ROUTED:  # mostly after the router: nothing to hide it under
                    overlapped, waited = self.routed_terms(g, loc, tokens, cpu_busy)
                    t.copy += overlapped
                    t.latency += waited
                    ids_read = True
                elif loc.kind == STREAMED:
                    if self.routed_copy(g, place.groups[g.name]):
                        t.copy += self.routed_copy_seconds(g, tokens, loc.device, cpu_busy)
                        ids_read = True
                    else:
                        t.copy += self.copy_seconds(g.nbytes, loc.device, cpu_busy)
            else:
                t.cpu += self.cpu_seconds(g, tokens)
        kv = self.attention_loc(place.kv[il], tokens)
        attention = self.attention_seconds(il, tokens, depth, kv, sequences)
        if kv.on_gpu:
            t.gpu += attention
        else:
            t.cpu += attention
        if kv.kind == STREAMED:  # the cached cells go up before the layer, new ones back
            up, down = self.kv_stream_nbytes(il, tokens, depth, sequences)
            t.copy += self.copy_seconds(up, kv.device, cpu_busy)
            t.latency += self.copy_seconds(down, kv.device, cpu_busy)
        seq = self.layer_sequence(il, place, tokens)
        hops = sum(hops_between(a, b) for a, b in zip(seq, seq[1:]))
        if hops:
            t.latency += hops * self.hop_seconds(tokens, self.hop_width)
        if hops_between(prev, seq[0]):  # the residual stream arrives from another device
            t.latency += hops_between(prev, seq[0]) * self.hop_seconds(tokens, hp.n_embd)
        if ids_read:  # the router's ids read back before the experts' copies: a sync
            t.latency += self.ids_readback_seconds(tokens, kv.device)
        if gpu_mats or kv.on_gpu:
            t.latency += self.launch_seconds(ELEMENTWISE_KERNELS_PER_LAYER + gpu_mats, tokens)
        inner = np.maximum(t.gpu, t.copy) if self.overlap else t.gpu + t.copy
        t.total = inner + t.cpu + t.latency
        return t

    def layer_sequence(self, il: int, place: TierPlacement, tokens: int) -> list[int]:
        """Where a layer's ops run (Loc.where), in order: its attention side, the attention, the
        attention side again (the output projection), its FFN matrices in compute order."""
        runs_on = [self.effective(g, place.groups[g.name], tokens).where for g in self.by_layer[il]]
        kv = self.attention_loc(place.kv[il], tokens)
        return [runs_on[0], kv.where, runs_on[0]] + runs_on[1:]

    def ubatch_operations(self, place: TierPlacement, tokens: int) -> "Operations":
        """What one ubatch moves (our runtime): a copy per streamed unit (a group, a layer's KV; a
        routed stack's, and its prefetch), a hop per activation copy between devices."""
        copies = sum(
            (loc := self.effective(g, place.groups[g.name], tokens)).kind in (STREAMED, ROUTED)
            and 1 + loc.prefetch
            for g in self.groups
        ) + sum(self.attention_loc(kv, tokens).kind == STREAMED for kv in place.kv.values())
        hops, prev = 0, place.groups["token_embd"].where
        for il in range(self.spec.hparams.n_layer):
            seq = self.layer_sequence(il, place, tokens)
            hops += sum(hops_between(a, b) for a, b in zip([prev, *seq], seq))
            prev = seq[-1]
        hops += hops_between(prev, self.effective(self.by_layer[None][-1],
                                                  place.groups["output"], tokens).where)  # fmt: skip
        return Operations(copies=int(copies), hops=hops)

    def global_terms(
        self, g: Group, place: TierPlacement, tokens: int, cpu_busy: bool, prev: int
    ) -> Terms:
        """The embedding or the output head; `prev`: the device the last layer ended on."""
        loc, t = self.effective(g, place.groups[g.name], tokens), Terms()
        if loc.on_gpu:
            t.gpu = self.gpu_seconds(g, tokens, loc.device)
            if loc.kind == STREAMED:
                t.copy = self.copy_seconds(g.nbytes, loc.device, cpu_busy)
        else:
            t.cpu = self.cpu_seconds(g, tokens)
        if g.kind == HEAD and hops_between(prev, loc.where):  # from the last layer to the head
            t.latency = hops_between(prev, loc.where) * self.hop_seconds(
                tokens, self.spec.hparams.n_embd
            )
        t.total = (max(t.gpu, t.copy) if self.overlap else t.gpu + t.copy) + t.cpu + t.latency
        return t

    @staticmethod
    def cpu_busy(place: TierPlacement) -> bool:
        """Whether a tier computes on the CPU (its copies then share the host memory bus); the
        embedding's row gather is too small to count."""
        return any(
            not loc.on_gpu for name, loc in place.groups.items() if name != "token_embd"
        ) or any(not loc.on_gpu for loc in place.kv.values())

    def ubatch_terms(
        self, place: TierPlacement, tokens: int, depth: int, sequences: int = 1
    ) -> Terms:
        cpu_busy = self.cpu_busy(place)
        total = Terms()
        prev = place.groups["token_embd"].where
        for il in range(self.spec.hparams.n_layer):
            total.add(self.layer_terms(il, place, tokens, depth, cpu_busy, sequences, prev))
            last = self.by_layer[il][-1]
            prev = self.effective(last, place.groups[last.name], tokens).where
        for g in self.by_layer[None]:  # token_embd and the output head
            total.add(self.global_terms(g, place, tokens, cpu_busy, prev))
        if self.traits.ggml_cpu and tokens == 1 and self.profile.cpu.llamacpp_decode_cache_speedup:
            faster = self.host_cache_speedup(place, depth)
            total.total = total.total - total.cpu * (1 - 1 / faster)
            total.cpu = total.cpu / faster
        return total

    def host_cache_speedup(self, place: TierPlacement, depth):
        """How many times faster than streaming llama.cpp's host decodes a token
        (`llamacpp_decode_cache_speedup`) at the bytes its host part touches token after token:
        every tensor it holds but the embedding (a routed stack whole, as tokens choose other
        experts) and its KV cells at `depth`. A layer by layer sum cannot see this, so the solver's objective prices
        a decode streaming; its predictions do not."""
        hp = self.spec.hparams
        nbytes = sum(g.nbytes for g in self.groups
                     if g.kind != EMBD and not place.groups[g.name].on_gpu)  # fmt: skip
        for il, kv in place.kv.items():
            if not kv.on_gpu and not hp.recurrent(il):
                cells = depth + 1
                if self.spec.is_swa(il):
                    cells = np.minimum(cells, hp.n_swa + 1)
                nbytes = nbytes + cells * self.cell_nbytes
        table = self.profile.cpu.llamacpp_decode_cache_speedup
        return np.vectorize(lambda b: table.at(ANY_TYPE, b), otypes=[float])(nbytes)

    # -- a request -------------------------------------------------------------------------------

    def prompt_ubatches(self, tiers: list[int]) -> list[tuple[int, int, int]]:
        """(tier, tokens, depth) of each prompt ubatch."""
        out, depth, left = [], 0, self.w.prompt_tokens
        largest = max(tiers)
        while left > 0:
            n = min(left, largest)
            tier = min(t for t in tiers if t >= n)
            out.append((tier, n, depth))
            depth, left = depth + n, left - n
        return out

    def decode_tier(self, tiers: list[int]) -> int:
        fitting = [t for t in tiers if t >= self.w.users]
        return min(fitting) if fitting else max(tiers)


def switch_seconds(cm: CostModel, a: TierPlacement, b: TierPlacement) -> float:
    """Re-pinning what b pins where a did not (another GPU counts), and b's pinned KV likewise,
    each over its destination GPU's PCIe."""
    moved: dict[int, float] = {}
    for g in cm.groups:
        to = b.groups[g.name]
        if to.kind == PINNED and a.groups[g.name] != to:
            moved[to.device] = moved.get(to.device, 0.0) + g.nbytes
    for il, to in b.kv.items():
        if to.kind == PINNED and a.kv[il] != to:
            kv = cm.cell_nbytes * cm.w.prompt_tokens * cm.w.users
            moved[to.device] = moved.get(to.device, 0.0) + kv
    return sum(n / (cm.profile.gpus[d].h2d_gbps.value * 1e9) for d, n in moved.items())


@dataclass(frozen=True)
class Shape:
    """One kind of ubatch a request runs, and how many times it counts."""

    tier: int
    tokens: int
    depth: int  # cached tokens per sequence before it
    sequences: int
    weight: float  # multiplier of its time in the request
    part: str  # "prefill" or "decode"


def request_shapes(cm: CostModel, tiers: list[int]) -> tuple[list[Shape], int, int]:
    """The ubatches of the workload's request (formula 8), with the prefill tier that ends the
    prompt and the decode tier (between which the plan switches)."""
    w = cm.w
    shapes = [Shape(t, n, d, 1, w.users, "prefill") for t, n, d in cm.prompt_ubatches(tiers)]
    dt = cm.decode_tier(tiers)
    half = w.gen_tokens / 2
    for depth in (w.prompt_tokens, w.prompt_tokens + w.gen_tokens):
        shapes.append(Shape(dt, w.users, depth, w.users, half, "decode"))
    last_prefill = shapes[0].tier if w.prompt_tokens else dt
    for s in shapes:
        if s.part == "prefill":
            last_prefill = s.tier
    return shapes, last_prefill, dt


def shape_terms(cm: CostModel, tiers: dict[int, TierPlacement], shapes: list[Shape]) -> list[Terms]:
    """Each shape's ubatch terms; shapes differing only in depth are priced in one vectorized
    call (attention is the only term that depends on depth)."""
    groups: dict[tuple[int, int, int], list[int]] = {}
    for i, s in enumerate(shapes):
        groups.setdefault((s.tier, s.tokens, s.sequences), []).append(i)
    out: list[Terms | None] = [None] * len(shapes)
    for (tier, tokens, sequences), idx in groups.items():
        depths = np.array([shapes[i].depth for i in idx], float)
        t = cm.ubatch_terms(tiers[tier], tokens, depths, sequences)
        cols = [np.broadcast_to(v, depths.shape).tolist()
                for v in (t.gpu, t.copy, t.cpu, t.latency, t.total)]  # fmt: skip
        for j, i in enumerate(idx):
            out[i] = Terms(*(c[j] for c in cols))
    return out


def evaluate(
    tiers: dict[int, TierPlacement],
    spec: ModelSpec,
    profile: HardwareProfile,
    workload: Workload,
    target: str = "refengine",
) -> Prediction:
    """Predicted TTFT, decode time, TPS and end-to-end time of a workload under a plan, run by
    our runtime or (target "llamacpp") by llama.cpp."""
    cm = CostModel(spec, profile, workload, target)
    shapes, last_prefill, dt = request_shapes(cm, sorted(tiers))
    per_tier: dict[int, dict[int, Terms]] = {}
    ttft = decode = 0.0
    for s, t in zip(shapes, shape_terms(cm, tiers, shapes)):
        per_tier.setdefault(s.tier, {})[s.depth] = t
        if s.part == "prefill":
            ttft += s.weight * t.total
        else:
            decode += s.weight * t.total
    switch = switch_seconds(cm, tiers[last_prefill], tiers[dt]) if workload.gen_tokens else 0.0
    ttft, decode = float(ttft), float(decode + switch)
    tps = workload.users * workload.gen_tokens / decode if decode > 0 else 0.0
    return Prediction(ttft, decode, tps, ttft + decode, per_tier, switch)
