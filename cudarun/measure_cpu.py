"""The CPU side of a hardware profile (`solver.profile.CPUProfile`), measured on this machine by
the runtime with its own CPU kernels (`cudarun.kernels.cpu`): a decode's weight rate as the cpu
engine's fused layers read them (`layer_rate_and_fixed`; the lone q8 matvec, int8 activations as
llama.cpp, where that fit fails) and, for prefill token counts, the products on int8 tiles of the
weights repacked once (the types that repack) and on dequantized fp32 panels by BLAS (the
others). The memory figure is a Numba parallel read of at least 1 GiB on the same threads.
Weights rotate over more than twice the last-level cache and inputs are fresh, so no rate is a
cache hit (docs/pshard.md, reason 2).
"""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import date
from pathlib import Path
from typing import Callable

from solver.profile import (ANY_TYPE, PANEL_TYPE, SCORE_TWIN_KV_HEADS, CPUProfile, Figure,
                            RateTable)

from refengine.quants import HOST, measured_on, qtype as as_qtype
from refengine.spec import ModelSpec

from .bench_cpu import GIB, host_read_gbps, last_level_cache_nbytes, matmul_rate
from .kernels import cpu

KERNEL = "cudarun CPU kernels (q8 matvec, int8-tile and fp32-panel matmul)"
MATVEC_TYPES = measured_on(HOST)
MATMUL_TOKENS = (64, 512)
Q8_TOKENS = (8, 64)  # an expert's share of a prompt: from cpu.BLAS_TOKENS to a few dozen


def measure_cpu(
    threads: int | None = None,
    shape: tuple[int, int] = (4096, 4096),
    quick: bool = False,
    progress: Callable[[str], None] = lambda s: None,
    types: tuple[str, ...] = MATVEC_TYPES,
) -> CPUProfile:
    """`quick`: one timed pass per figure over a rotation of 2x the last-level cache (a rough
    profile in seconds, for tests); otherwise the median of 5 over at least 1 GiB."""
    threads = threads or os.cpu_count() or 1
    llc = last_level_cache_nbytes()
    today = date.today().isoformat()
    src = f"measured: refengine profile {today}, {KERNEL}"
    runs = 1 if quick else 5
    nbytes = 2 * llc if quick else max(GIB, 2 * llc)

    progress("host memory bandwidth")
    memory_gbps = Figure(
        host_read_gbps(threads, nbytes, runs),
        f"{src}; Numba parallel read of {nbytes >> 20} MiB on {threads} threads, median of {runs}",
    )
    progress("a decoded token's own cost and the output head")
    token = token_seconds(threads, quick)
    head_row, head_gbps = our_head_rates(threads, quick, token)
    matvec, matmul, q8, tiles = {}, {}, {}, {}
    for name in types:
        progress(f"matvec {name}")
        r = matmul_rate(name, shape, 1, threads, runs, nbytes)
        matvec[name] = {
            threads: Figure(
                r.gbps,
                f"{src}; {r.path} path, {shape[0]}x{shape[1]} rotated over {nbytes >> 20} MiB",
            )
        }
        progress(f"matmul {name}")
        row, paths = {}, set()
        for tokens in MATMUL_TOKENS:
            # compute-bound: two tensors rotate, as cache hits hardly change the rate
            r = matmul_rate(name, shape, tokens, threads, runs, rotate_nbytes=1)
            row[tokens] = Figure(r.gflops, f"{src}; {r.path} path, {tokens} tokens")
            paths.add(r.path)
        matmul[name] = row
        if paths == {"q8gemm"}:  # what our host's prompt runs for the type
            tiles[name] = row
        if as_qtype(name).ggml in cpu.Q8_ROWS:
            progress(f"q8 rows {name}")
            q8[name] = {tokens: Figure(r.gflops, f"{src}; q8 path on {tokens} tokens")
                        for tokens in Q8_TOKENS
                        for r in [matmul_rate(name, shape, tokens, threads, runs,
                                              rotate_nbytes=1, q8=True)]}  # fmt: skip
    # the runtime's host prefill multiplies fp32 panels it dequantized once and keeps
    # (`hostmath.HostMath`): BLAS on fp32, whatever the file's type
    progress("matmul on cached fp32 panels")
    matmul[PANEL_TYPE] = {
        tokens: Figure(r.gflops, f"{src}; {r.path} path on fp32 weights, {tokens} tokens")
        for tokens in MATMUL_TOKENS
        for r in [matmul_rate(PANEL_TYPE, shape, tokens, threads, runs, rotate_nbytes=1)]
    }
    progress("host attention and gated activation")
    score, row = attention_costs(quick, runs)
    decode_score = decode_attention_costs(threads, quick)
    glu, gelu = (glu_seconds(quick, runs, act) for act in ("silu", "gelu"))
    quantize = quantize_seconds(quick, runs)
    rope_angle, rope = rope_seconds(quick, runs)
    rope_twins = (f"cpu_ops.rope, serial, over {128 if quick else 512} tokens x "
                  f"{' and '.join(map(str, ROPE_HEADS))} heads of 128")
    others = [t for t in types if t != LAYER["qtype"] and t in matvec and not quick]
    layers = " and ".join(map(str, layer_counts(quick)))
    per_type = {}
    for t in [LAYER["qtype"]] + others:
        progress(f"a decode layer's rate and fixed cost, {t}")
        decoding = twins_rate(quick).replace("llamas", f"{t} llamas")
        in_layer = layer_rate_and_fixed(threads, quick, t)
        if in_layer:
            gbps, fixed_seconds = in_layer
            matvec[t] = {threads: Figure(gbps, f"{src}; {decoding}, per byte")}
            per_type[t] = Figure(fixed_seconds, f"{src}; {decoding}, per layer")
        else:  # the lone matvec's rate, the small twins' slope beyond it
            gbps = matvec[t][threads].value if t in matvec else memory_gbps.value
            per_type[t] = Figure(layer_seconds(threads, quick, gbps, qtype=t)[0],
                                 f"{src}; the cpu engine decoding synthetic {t} llamas of "
                                 f"{layers} layers, the slope per layer less its bytes at the "
                                 "lone matvec's rate")  # fmt: skip
    layer_gbps = matvec[LAYER["qtype"]][threads].value if LAYER["qtype"] in matvec else (
        memory_gbps.value)  # fmt: skip

    def fixed(kinds: tuple, t: str | None = None) -> list[float]:  # twins of type t
        gbps = layer_gbps if t is None else matvec[t][threads].value
        return layer_seconds(threads, quick, gbps, kinds, qtype=t)

    per_layer = per_type[ANY_TYPE] = per_type[LAYER["qtype"]]
    per_routed_layer, per_expert = routed_fixed(*fixed(ROUTED_TWINS))
    per_expert_type = {LAYER["qtype"]: per_expert, ANY_TYPE: per_expert} | {
        t: routed_fixed(*fixed(ROUTED_TWINS, t))[1] for t in others}
    q8_gflops = (q8[LAYER["qtype"]] if LAYER["qtype"] in q8 else matmul[types[0]])[Q8_TOKENS[-1]]
    slot = routed_slot_seconds(threads, quick, q8_gflops.value, glu)
    handoff = handoff_seconds(quick, runs)
    twin_ff = (TINY if quick else LAYER)["n_ff"]
    twins = ("the cpu engine decoding synthetic llamas of one layer whose Q8_0 heads hold the "
             f"same bytes in {' and '.join(str(v) for _, v in row_twins(quick))} rows")
    matvec[ANY_TYPE] = matvec[types[0]]
    matmul[ANY_TYPE] = matmul[types[0]]
    measured = CPUProfile(
        name=_cpu_name(),
        threads=threads,
        memory_gbps=memory_gbps,
        matvec_gbps=RateTable("GB/s", matvec),
        matmul_gflops=RateTable("GFLOP/s", matmul),
        attention_score_seconds=RateTable("s", {ANY_TYPE: {
            dim: Figure(x, f"{src}; hostmath.attention_blas, 16/4 heads of {dim}, 512 tokens "
                           f"over 512 and {LONG_KEYS} keys, the per-score slope")
            for dim, x in score.items()}}),  # fmt: skip
        attention_row_seconds=Figure(row, f"{src}; the same two runs' per-row intercept"),
        decode_score_seconds=RateTable("s", {ANY_TYPE: {
            dim: Figure(x, f"{src}; the cpu engine decoding synthetic llamas of "
                           f"{'tiny layers' if quick else DECODE_TWIN_MATRICES}, 8/2 heads of "
                           f"{dim}, at depth {'512' if quick else '4096'} and 0, the per-score "
                           "difference")
            for dim, x in decode_score.items()}}),  # fmt: skip
        glu_element_seconds=Figure(glu, f"{src}; cpu_ops.gated (SiLU) over 512 x 8192, serial"),
        gelu_element_seconds=Figure(gelu, f"{src}; cpu_ops.gated (GELU) over 512 x 8192, serial"),
        rope_angle_seconds=Figure(rope_angle, f"{src}; {rope_twins}, the intercept per angle"),
        rope_element_seconds=Figure(rope, f"{src}; {rope_twins}, the slope per element"),
        token_seconds=Figure(token, f"{src}; the cpu engine decoding synthetic Q8_0 llamas of "
                                    f"{layers} layers, the intercept at none"),
        head_row_seconds=Figure(head_row, f"{src}; {twins}, per row"),
        head_gbps=Figure(head_gbps, f"{src}; {twins}, per byte"),
        layer_activation_seconds=Figure(twin_ff * glu, f"{src}; the layer twins' SiLU gate over "
                                                       f"{twin_ff} elements at the gate's rate"),
        layer_seconds=per_layer,
        layer_type_seconds=RateTable("s", {t: {threads: x} for t, x in per_type.items()}),
        routed_layer_seconds=Figure(per_routed_layer, f"{src}; the same with synthetic "
                                                      "qwen3moe (8 experts, 2 and 6 used), the "
                                                      "intercept at none used"),
        expert_seconds=Figure(per_expert, f"{src}; the same qwen3moe, the slope per expert "
                                          "used"),
        expert_type_seconds=RateTable("s", {t: {threads: Figure(x, f"{src}; the same routed "
                                                                f"twins with every matrix {t}, "
                                                                "the slope per expert used")}
                                            for t, x in per_expert_type.items()}),  # fmt: skip
        q8_matmul_gflops=RateTable("GFLOP/s", q8),
        tile_gflops=RateTable("GFLOP/s", tiles),
        quantize_value_seconds=Figure(quantize, f"{src}; cpu.quantize_activations over "
                                                f"{' x '.join(map(str, QUANTIZE_SHAPE))}, serial"),
        routed_slot_seconds=Figure(slot, f"{src}; the cpu engine's prompts of {SLOT_LAYERS}-layer "
                                         "qwen3moe twins (8 experts 64 wide, 2 and 6 used), the "
                                         "slope per slot less its products and activation, per "
                                         "element of the token's and the expert's widths"),
        routed_handoff_seconds=Figure(handoff, f"{src}; a {HANDOFF_SHAPES[quick][0]}-token fp32 "
                                               "panel product right after a parallel Numba "
                                               "kernel, less the same product alone (medians)"),
        sync_seconds=Figure(
            20e-6,
            "derived: typical CUDA event wait + launch of a copy, "
            "not measurable without a GPU; the kernels issue measures it",
        ),
    )
    progress("a prompt layer's cost beyond its price")
    tokens, counts = prompt_twins(quick)
    beyond = Figure(prompt_layer_element_seconds(threads, quick, measured),
                    f"{src}; the cpu engine's prompts of {tokens} tokens on synthetic Q8_0 llamas "
                    f"of {' and '.join(map(str, counts))} layers, the slope per layer less the "
                    "cost model's price of a layer (this profile's other figures), per token and "
                    "element of n_embd")  # fmt: skip
    return replace(measured, prompt_layer_element_seconds=beyond)


# a prompt layer's cost beyond its price: twins of LAYER's shape (`quick`: TINY's) at two depths
# prefill a prompt of this many tokens, in turn
PROMPT_TWIN_TOKENS = {False: 512, True: 64}
PROMPT_TWIN_LAYERS = {False: (4, 16), True: (2, 6)}


def prompt_twins(quick: bool) -> tuple[int, tuple[int, int]]:
    return PROMPT_TWIN_TOKENS[quick], PROMPT_TWIN_LAYERS[quick]


def prompt_layer_element_seconds(threads: int, quick: bool, cpu_profile: CPUProfile) -> float:
    """Seconds per prompt token and element of n_embd that our cpu engine's prompt layer takes
    beyond what the cost model prices of it from `cpu_profile` (every other figure measured): the
    slope per layer of two twins' prefill times less that of their prices, over tokens x width.
    What it stands for scales with the activations' width (norms, residual adds, their passes
    between calls): the 512-wide twins' figure priced SmolLM2 (576), Gemma-3 (640) and a
    qwen2-1.5B (1536) within 3-10% in three runs, where a cost per layer and token priced the
    qwen2-1.5B 5% further off."""
    import tempfile

    import numpy as np

    from solver.cpu_tests import cpu_cost_model, prompt_seconds
    from solver.profile import HardwareProfile

    tokens, counts = prompt_twins(quick)
    host = HardwareProfile(cpu_profile.name, (), cpu_profile)
    engines = []
    with tempfile.TemporaryDirectory(prefix="refengine-prompt-") as tmp:
        for n_layer in counts:
            engines.append(twin_engine(Path(tmp) / f"{n_layer}.gguf",
                                       layer_config(n_layer, quick=quick), threads, 2 * tokens))
        ids = np.arange(tokens) % engines[0].spec.hparams.n_vocab

        def prompt(engine):
            engine.reset()
            engine.prefill(ids)

        seconds = _median_seconds([lambda e=e: prompt(e) for e in engines], 3 if quick else 11,
                                  fastest=quick)  # fmt: skip
    priced = [prompt_seconds(cpu_cost_model(e.spec, host, "refengine", threads, 2 * tokens),
                             tokens, 0) for e in engines]  # fmt: skip
    return beyond_price(seconds, priced, counts, tokens * engines[0].spec.hparams.n_embd)


def beyond_price(seconds: list[float], priced: list[float], counts: tuple[int, int],
                 elements: int) -> float:  # fmt: skip
    """Seconds per element that twins of `counts` layers took a layer beyond their price: the
    slope of their times less the slope of their prices, over each layer's `elements`; a noisy
    pair below its price reads none, not a negative cost."""
    slope = (seconds[1] - seconds[0]) / (counts[1] - counts[0])
    priced_slope = (priced[1] - priced[0]) / (counts[1] - counts[0])
    return max(slope - priced_slope, 0.0) / elements


LONG_KEYS = 4608
ATTENTION_DIMS = (64, 128, 256)  # head sizes: the small models, most others, Gemma-3


def attention_costs(quick: bool, runs: int) -> tuple[dict[int, float], float]:
    """({head size: seconds per score}, seconds per query row) of the host prefill's attention:
    for each head size, the time at 512 and LONG_KEYS keys for 512 tokens, fitted as
    rows * (keys * score + row). The per-row term is the mask, the softmax's reductions and the
    per-head products' setup: taken at the largest head size."""
    import numpy as np

    from .hostmath import attention_blas

    heads, kv_heads, tokens = 16, 4, (128 if quick else 512)
    long = LONG_KEYS // (4 if quick else 1)
    rng = np.random.default_rng(0)
    rows, per_score, per_row = heads * tokens, {}, 0.0
    for dim in ATTENTION_DIMS:
        seconds = []
        for keys in (tokens, long):
            q = rng.standard_normal((tokens, heads, dim)).astype(np.float32)
            k = rng.standard_normal((keys, kv_heads, dim)).astype(np.float16)
            q_pos, k_pos = np.arange(keys - tokens, keys), np.arange(keys)
            seconds.append(_median_seconds(
                lambda: attention_blas(q, k, k, q_pos, k_pos, 0.1), runs))  # fmt: skip
        per_score[dim] = max((seconds[1] - seconds[0]) / (rows * (long - tokens)), 0.0)
        per_row = max(seconds[0] / rows - tokens * per_score[dim], 0.0)
    return per_score, per_row


SCORE_HEADS = 8  # query heads of the attention twins, over SCORE_TWIN_KV_HEADS KV heads


def score_twin_config(n_layer: int, head_dim: int, n_ctx: int,
                      kv_heads: int = SCORE_TWIN_KV_HEADS, **matrices):  # fmt: skip
    """A synthetic llama whose time at depth is its attention: small matrices (unless `matrices`
    sizes them: n_embd, n_ff, qtype), `kv_heads` KV heads of `head_dim` under SCORE_HEADS query
    heads for every SCORE_TWIN_KV_HEADS, a 512-token vocabulary."""
    from refengine.synthetic import SyntheticConfig

    return SyntheticConfig("llama", n_layer=n_layer, **({"n_embd": 256, "n_ff": 256} | matrices),
                           n_head=score_heads(kv_heads), n_head_kv=kv_heads, head_dim=head_dim,
                           n_vocab=512, n_ctx_train=n_ctx)  # fmt: skip


def score_heads(kv_heads: int) -> int:
    """An attention twin's query heads over `kv_heads`."""
    return SCORE_HEADS * kv_heads // SCORE_TWIN_KV_HEADS


def twin_engine(path: Path, config, threads: int, n_ctx: int):
    """The cpu engine, warmed up, on a synthetic file written from `config` at `path`."""
    from refengine.spec import load_spec
    from refengine.synthetic import write_synthetic

    from .cpu_engine import CpuEngine

    engine = CpuEngine(load_spec(str(write_synthetic(path, config))), threads=threads,
                       n_ctx=n_ctx)  # fmt: skip
    engine.warm_up()
    return engine


# the decode attention twins' matrices: a 1B model's layer (~38 MB of Q4_K) between attentions.
# Between the tiny twin's matrices of 256, a score cost 13-26% less than between these
# (docs/measured/2026-12-07-decode-score-twins.txt)
DECODE_TWIN_MATRICES = dict(n_embd=2048, n_ff=8192, qtype="Q4_K")


def decode_attention_costs(threads: int, quick: bool) -> dict[int, float]:
    """{head size: seconds per query head and key} of our decode's attention as the cpu engine
    runs it (the fused layer's, cell by cell): synthetic llamas with a real model's layers
    (DECODE_TWIN_MATRICES; tiny with `quick`), 8 query heads over 2 KV heads of the size,
    decoding at a depth and at 0; the difference per layer, query head and key. (The kernel timed
    on its own ran ~25% faster than inside a model's decode.) The two depths are two engines
    decoding in turn, each side's least disturbed token taken: timed one depth after the other, a
    busy host's burst during one read 5e-6 s a score where a quiet sitting reads 2-8e-8."""
    import tempfile

    import numpy as np

    from .cpu_engine import CpuEngine

    depth, tokens, n_layer = (512, 8, 2) if quick else (4096, 48, 4)
    per_score = {}
    with tempfile.TemporaryDirectory(prefix="refengine-attention-") as tmp:
        for dim in ATTENTION_DIMS:
            n_ctx = depth + 4 * tokens
            config = score_twin_config(n_layer, dim, 2 * depth,
                                       **({} if quick else DECODE_TWIN_MATRICES))  # fmt: skip
            shallow = twin_engine(Path(tmp) / f"{dim}.gguf", config, threads, n_ctx)
            deep = CpuEngine(shallow.spec, threads=threads, n_ctx=n_ctx)
            deep.warm_up()
            for engine, fill in ((shallow, 4), (deep, depth)):
                engine.prefill(np.arange(fill) % 512)
            seconds = _median_seconds([lambda: shallow.decode(7), lambda: deep.decode(7)],
                                      tokens, fastest=True)  # fmt: skip
            per_score[dim] = max((seconds[1] - seconds[0]) / (n_layer * SCORE_HEADS * depth), 0.0)
    return per_score


def glu_seconds(quick: bool, runs: int, act: str = "silu") -> float:
    """Seconds per element of the gated activation act(gate) * up, run as a prompt's ubatch runs
    it: serially, beside BLAS's threads (`hostmath._numba_owns`)."""
    import numpy as np

    from .kernels import cpu_ops

    shape = (128, 2048) if quick else (512, 8192)
    gate, up = (np.random.default_rng(1).standard_normal(shape).astype(np.float32) for _ in "gu")
    return _median_seconds(lambda: cpu_ops.gated(gate, up, act == "gelu", parallel=False),
                           runs) / gate.size  # fmt: skip


QUANTIZE_SHAPE = (512, 4096)


def quantize_seconds(quick: bool, runs: int) -> float:
    """Seconds per value of a prompt's activations quantized for its int8 tiles, as a ubatch runs
    it: serially, once per product input."""
    import numpy as np

    x = np.random.default_rng(2).standard_normal(QUANTIZE_SHAPE).astype(np.float32)
    cpu.quantize_activations(x)  # compiled
    return _median_seconds(lambda: cpu.quantize_activations(x), runs) / x.size


ROPE_HEADS = (1, 16)  # the twins: the angles' cost is the same, the rotated elements' 16x


def rope_seconds(quick: bool, runs: int) -> tuple[float, float]:
    """RoPE as a prompt's ubatch runs it (serially, beside BLAS), on [tokens, heads, 128] blocks
    (NeoX halves) of 1 and 16 heads: (seconds per token and rotated pair — its angle's sine and
    cosine, which a call computes once for all its heads —, seconds per rotated element). A
    per-element figure alone, measured on 16 heads, priced Gemma-3's one KV head 6x cheap."""
    import numpy as np

    from .kernels import cpu_ops

    tokens, dim = (128 if quick else 512), 128
    seconds = []
    for heads in ROPE_HEADS:
        x = np.random.default_rng(2).standard_normal((tokens, heads, dim)).astype(np.float32)
        positions = np.arange(tokens)
        seconds.append(_median_seconds(
            lambda: cpu_ops.rope(x, positions, dim, 1e4, 1.0, True, parallel=False), runs))
    few, many = ROPE_HEADS
    per_element = max((seconds[1] - seconds[0]) / (tokens * (many - few) * dim), 0.0)
    per_angle = max((seconds[0] - tokens * few * dim * per_element) / (tokens * dim // 2), 0.0)
    return per_angle, per_element


# a layer's fixed cost is measured where a real model's layers run: 512 wide, two models of 12
# and 36 layers (40 and 119 MiB; our engine decodes them at the same cost a layer as it does
# 108 layers, llama.cpp's 12 from the cache: its twins are deeper, `measure_llamacpp.
# LLAMACPP_LAYER_COUNTS`). Tiny llamas (64 wide, in cache) measured 26 us a layer where layers of
# 512-2048 cost 51-68 us beyond their bytes: per parallel region, its threads' first reads of a
# matrix from memory
LAYER_COUNTS = (12, 36)
LAYER = dict(n_embd=512, n_ff=1536, n_head=8, n_head_kv=2, n_vocab=512, qtype="Q8_0")
ROUTED = dict(arch="qwen3moe", n_expert=8, n_expert_used=2, n_ff_exp=512)
MORE_USED = dict(ROUTED, n_expert_used=6)  # its twin: the cost of each chosen expert
# `quick` (tests): tiny llamas of few layers, in cache, seconds to measure
TINY_LAYERS = (2, 10)
TINY = dict(n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=512, qtype="Q8_0")
TINY_ROUTED = dict(ROUTED, n_ff_exp=64)


def layer_config(n_layer: int, kind: dict | None = None, quick: bool = False,
                 qtype: str | None = None):  # fmt: skip
    """A llama of `n_layer` layers at a real model's width (`quick`: tiny), or, `kind`: ROUTED,
    a qwen3moe; `qtype`: every matrix of that type instead of LAYER's."""
    from refengine.synthetic import SyntheticConfig

    shape, routed = (TINY, TINY_ROUTED) if quick else (LAYER, ROUTED)
    if kind:
        routed = dict(routed, n_expert_used=kind["n_expert_used"])
    return SyntheticConfig(n_layer=n_layer, **{"arch": "llama", **shape,
                                               **(routed if kind else {}),
                                               **({"qtype": qtype} if qtype else {})})  # fmt: skip


ROUTED_TWINS = (ROUTED, MORE_USED)


def routed_fixed(a: float, b: float) -> tuple[float, float]:
    """(a routed layer's fixed cost before its experts, the fixed cost of each expert it chose)
    from its fixed cost with ROUTED's (`a`) and MORE_USED's (`b`) counts of chosen experts (a
    decode's expert products are small, and each costs its own start beyond its bytes)."""
    k0, k1 = ROUTED["n_expert_used"], MORE_USED["n_expert_used"]
    per_expert = max((b - a) / (k1 - k0), 0.0)
    return max(a - k0 * per_expert, 0.0), per_expert


# a prompt's routed FFN on our host, beyond its products and act(gate) * up: each (token, slot)'s
# rows grouped by expert, gathered, scattered back, and weighted into the sum. Twins of 2 and 6
# slots at experts narrow enough (64) that these, not the products, are most of the difference
SLOT_TWIN = dict(ROUTED, n_ff_exp=64)
SLOT_LAYERS = 8


def routed_slot_seconds(threads: int, quick: bool, q8_gflops: float, act_seconds: float) -> float:
    """Seconds per (token, slot) and element of the token's width and its expert's of our host's
    routed FFN on a prompt's ubatch (the BLAS tier), beyond the products (at `q8_gflops`, the
    profile's q8 rate) and the gated activation (`act_seconds` per element)."""
    import tempfile

    import numpy as np

    from refengine.synthetic import SyntheticConfig

    tokens, shape = (64, TINY) if quick else (512, LAYER)
    seconds = []
    with tempfile.TemporaryDirectory(prefix="refengine-slots-") as tmp:
        for used in (ROUTED["n_expert_used"], MORE_USED["n_expert_used"]):
            config = SyntheticConfig(n_layer=SLOT_LAYERS, **{"arch": "llama", **shape,
                                     **dict(SLOT_TWIN, n_expert_used=used)})  # fmt: skip
            engine = twin_engine(Path(tmp) / f"{used}.gguf", config, threads, 2 * tokens)
            ids = np.arange(tokens) % 512

            def prompt():
                engine.reset()
                engine.prefill(ids)

            seconds.append(_median_seconds(prompt, 3 if quick else 7))
    hp = engine.spec.hparams
    slots = SLOT_LAYERS * tokens * (MORE_USED["n_expert_used"] - ROUTED["n_expert_used"])
    products = 3 * 2 * hp.n_embd * hp.n_ff_exp / (q8_gflops * 1e9)
    per_slot = (seconds[1] - seconds[0]) / slots - products - hp.n_ff_exp * act_seconds
    return max(per_slot / (hp.n_embd + hp.n_ff_exp), 0.0)


HANDOFF_SHAPES = {False: (512, 1024), True: (64, 256)}  # (tokens, width) by `quick`


def handoff_seconds(quick: bool, runs: int) -> float:
    """Seconds a prompt's BLAS product (a layer's first, fp32 panel) takes right after a
    parallel Numba kernel (the routed experts' q8 kernel) beyond the same product alone: the
    kernel's OpenMP threads spin on after it on the cores BLAS's threads need (a [512, 1024] x
    [1024, 1024] product ran 8.4 ms after one where it ran 4.3 alone)."""
    import statistics
    import time

    import numpy as np

    from .kernels import cpu_ops

    tokens, width = HANDOFF_SHAPES[quick]
    rng = np.random.default_rng(0)
    x, panel = (rng.standard_normal(shape, np.float32) for shape in
                ((tokens, width), (width, width)))  # fmt: skip
    busy = rng.standard_normal((tokens, 8 * width), np.float32)

    def product() -> float:
        start = time.perf_counter()
        np.matmul(x, panel.T)
        return time.perf_counter() - start

    alone, after = [], []
    product()  # compiled and warm
    cpu_ops.gated(busy, busy, False)
    for _ in range(4 * max(runs, 3)):  # the spin's toll varies run to run (0-6 ms)
        time.sleep(0.05)  # every thread asleep
        alone.append(product())
        cpu_ops.gated(busy, busy, False)  # parallel at this size
        after.append(product())
    return max(statistics.median(after) - statistics.median(alone), 0.0)


def layer_counts(quick: bool) -> tuple[int, int]:
    return TINY_LAYERS if quick else LAYER_COUNTS


def layer_read_nbytes(spec) -> float:
    """The weight bytes a decoded token reads of one layer (blk.0): every matrix, an expert
    stack's chosen experts only."""
    hp, total = spec.hparams, 0.0
    for t in spec.tensors:
        if t.name.startswith("blk.0.") and len(t.shape) >= 2:
            total += t.nbytes * (hp.n_expert_used / hp.n_expert if len(t.shape) == 3 else 1.0)
    return total


def fixed_layer_seconds(per_token: list[float], counts: tuple[int, int], specs: list,
                        gbps: float) -> list[float]:  # fmt: skip
    """Each kind's layer fixed cost: the slope per layer of its two models' decode times (kind
    after kind in `per_token` and `specs`, each kind's twins at `counts`' depths), less the
    layer's bytes at `gbps` (the rate the cost model prices them at)."""
    out = []
    for i in range(0, len(per_token), 2):
        slope = (per_token[i + 1] - per_token[i]) / (counts[1] - counts[0])
        out.append(max(slope - layer_read_nbytes(specs[i]) / (gbps * 1e9), 0.0))
    return out


# the output head in a decode, priced apart: its rows' own cost (each dot product's start and
# final sum) beyond its bytes, and its bytes' rate. llama.cpp read a 262144 x 512 head 46% slower
# than a 65536 x 2048 one of the same bytes (a layer's rows are in its fixed cost and rate: a
# per-row cost charged to every matrix over-priced llama.cpp's decodes by 8-25%). Twins of one
# small layer whose Q8_0 heads hold the same bytes in 4x the rows; (width, vocabulary)
ROW_TWINS = ((512, 262144), (2048, 65536))
QUICK_ROW_TWINS = ((128, 16384), (512, 4096))


def row_twin_config(width: int, vocab: int):
    from refengine.synthetic import SyntheticConfig

    return SyntheticConfig("llama", n_layer=1, n_embd=width, n_ff=256, n_head=width // 64,
                           n_head_kv=width // 64, n_vocab=vocab, qtype="Q8_0")  # fmt: skip


def row_twins(quick: bool) -> tuple[tuple[int, int], ...]:
    return QUICK_ROW_TWINS if quick else ROW_TWINS


def decode_rows(spec) -> int:
    """The matrix rows a decoded token reads: every matrix's (the embedding is a row lookup), an
    expert stack's chosen experts' only."""
    hp, rows = spec.hparams, 0
    for t in spec.tensors:
        if len(t.shape) == 2 and t.name != "token_embd.weight":
            rows += t.shape[0]
        elif len(t.shape) == 3:
            rows += t.shape[1] * hp.n_expert_used
    if spec.tied_output:
        rows += spec.by_name["token_embd.weight"].shape[0]
    return rows


def matrices(spec: ModelSpec) -> list:
    """The matrices a token multiplies by (the embedding is a row lookup)."""
    return [t for t in spec.tensors if len(t.shape) >= 2 and t.name != "token_embd.weight"]


def token_nbytes(spec: ModelSpec) -> int:
    """The weight bytes one generated token reads: every matrix, the head included."""
    return sum(t.nbytes for t in matrices(spec))


def row_seconds_and_gbps(seconds: tuple[float, float], specs,
                         token: float = 0.0) -> tuple[float, float]:  # fmt: skip
    """(seconds per row, GB/s) that price both twins' decode times, less `token` (a decoded
    token's own cost), as bytes / rate + rows x seconds per row (two equations, two unknowns).
    Where noise leaves either negative (on two busy cores a quick profile's twins read a negative
    cost per byte: 1e6 GB/s), the rows go free and the bytes take both times (least squares)."""
    (b1, b2), (r1, r2) = ([token_nbytes(s) for s in specs], [decode_rows(s) for s in specs])
    (t1, t2), det = (t - token for t in seconds), b1 * r2 - b2 * r1
    per_byte = (t1 * r2 - t2 * r1) / det
    per_row = (b1 * t2 - b2 * t1) / det
    if per_byte <= 0 or per_row < 0:
        per_row, per_byte = 0.0, (b1 * t1 + b2 * t2) / (b1 * b1 + b2 * b2)
    return per_row, 1.0 / per_byte / 1e9


def our_head_rates(threads: int, quick: bool, token: float = 0.0) -> tuple[float, float]:
    """(seconds per row, GB/s) of our cpu engine's output head in a decode
    (`row_seconds_and_gbps` on ROW_TWINS, less `token`, the decoded token's own cost: left in,
    a head's bytes carried it, a 30 MB head 0.2 of it and a 178 MB one 1.3)."""
    import tempfile

    import numpy as np

    engines = []
    with tempfile.TemporaryDirectory(prefix="refengine-rows-") as tmp:
        for width, vocab in row_twins(quick):
            engines.append(twin_engine(Path(tmp) / f"{width}.gguf",
                                       row_twin_config(width, vocab), threads, 128))  # fmt: skip
            engines[-1].prefill(np.arange(4))
        seconds = _median_seconds([lambda e=e: e.decode(7) for e in engines],
                                  8 if quick else 64)  # fmt: skip
    return row_seconds_and_gbps(tuple(seconds), [e.spec for e in engines], token)


def layer_seconds(threads: int, quick: bool, gbps: float, kinds: tuple = (None,),
                  qtype: str | None = None) -> list[float]:  # fmt: skip
    """Our cpu engine's fixed cost of a layer per decoded token (`fixed_layer_seconds`) for each
    of `kinds`: None, a dense llama's; ROUTED or MORE_USED, a routed layer's; `gbps`: the
    profile's matvec rate of LAYER's type (of `qtype`, the twins' type, when given)."""
    per_token, specs = twin_decode_seconds(threads, quick, kinds, qtype)
    return fixed_layer_seconds(per_token, layer_counts(quick), specs, gbps)


# a decoded token's bytes are read inside the fused layer kernels (`cpu_layer`), rows of several
# matrices in one parallel region on activations quantized once. A lone 4096x4096 matvec called
# from Python read Q4_K at 18.1 GB/s and Q6_K at 18.1 where a 1B model's layers read them at 21.3
# and 23.6, and it priced qwen2-1.5B's decode at 54.0 ms a token where it ran 48.2 (with the
# layers' rates: 47.6; docs/measured/2026-12-07-in-layer-rates.txt). The rate is that of twins
# whose layers hold a real model's bytes (BIG_LAYER, 34 MB of Q4_K) beside the small layer twins
BIG_LAYER = dict(n_layer=4, n_embd=2048, n_ff=8192)
QUICK_BIG_LAYER = dict(n_layer=2, n_embd=256, n_ff=512)


def big_layer_config(quick: bool, qtype: str | None = None):
    from refengine.synthetic import SyntheticConfig

    shape = (TINY | QUICK_BIG_LAYER) if quick else (LAYER | BIG_LAYER)
    return SyntheticConfig(arch="llama", **(shape | ({"qtype": qtype} if qtype else {})))


def twins_rate(quick: bool) -> str:
    """What `layer_rate_and_fixed` decodes, in words."""
    small, big = (TINY, QUICK_BIG_LAYER) if quick else (LAYER, BIG_LAYER)
    return (f"the cpu engine decoding synthetic llamas {small['n_embd']} wide of "
            f"{' and '.join(map(str, layer_counts(quick)))} layers and {big['n_embd']} x "
            f"{big['n_ff']} of {big['n_layer']}, in turn: the fit of their times to a token's, "
            "each layer's and each byte's cost")


def layer_rate_and_fixed(threads: int, quick: bool, qtype: str) -> tuple[float, float] | None:
    """(GB/s, seconds per layer) of our decode's layers of `qtype`: the small layer twins at
    `layer_counts` and a big one (`big_layer_config`), timed in turn; their times fitted exactly
    as a token's own cost + layers x a layer's fixed cost + weight bytes / the rate. None where
    noise leaves the rate or the fixed cost out of range."""
    import numpy as np

    per_token, specs = twin_decode_seconds(threads, quick, qtype=qtype, big=True)
    terms = np.array([[1.0, s.hparams.n_layer, token_nbytes(s)] for s in specs])
    _, per_layer, per_byte = np.linalg.solve(terms, np.array(per_token))
    if per_byte <= 0 or per_layer < 0:
        return None
    return float(1.0 / per_byte / 1e9), float(per_layer)


def token_seconds(threads: int, quick: bool) -> float:
    """Our cpu engine's cost of a decoded token beyond its layers and its head (the embedding
    row, the final norm, the step's Python): the dense layer twins' intercept
    (`decode_intercept`)."""
    return decode_intercept(twin_decode_seconds(threads, quick)[0], layer_counts(quick))


def decode_intercept(per_token: list[float], counts: tuple[int, int]) -> float:
    """A decode's time at no layers, from two twins' (at `counts` layers): their line's
    intercept."""
    slope = (per_token[1] - per_token[0]) / (counts[1] - counts[0])
    return max(per_token[0] - counts[0] * slope, 0.0)


def twin_decode_seconds(threads: int, quick: bool, kinds: tuple = (None,),
                        qtype: str | None = None,
                        big: bool = False) -> tuple[list[float], list]:  # fmt: skip
    """(a decoded token's seconds, the specs) of each kind's layer twins (`layer_config` at
    `layer_counts`' depths, kind after kind; `big`: then `big_layer_config`'s), every twin timed
    in turn, token by token."""
    import tempfile

    import numpy as np

    tokens, engines = (8 if quick else 96), []
    with tempfile.TemporaryDirectory(prefix="refengine-layers-") as tmp:
        for i, kind in enumerate(kinds):
            for n_layer in layer_counts(quick):
                engines.append(twin_engine(Path(tmp) / f"{i}-{n_layer}.gguf",
                                           layer_config(n_layer, kind, quick, qtype), threads,
                                           4 * tokens))  # fmt: skip
                engines[-1].prefill(np.arange(4))
        if big:
            engines.append(twin_engine(Path(tmp) / "big.gguf", big_layer_config(quick, qtype),
                                       threads, 4 * tokens))  # fmt: skip
            engines[-1].prefill(np.arange(4))
        # a profile's is the median token, as a run's mean prices it (the least disturbed
        # token's slope read 152 us a layer where the median's read 162); the tests' quick
        # profile, measured beside the suite's other worker, takes the least disturbed one
        per_token = _median_seconds([lambda e=e: e.decode(7) for e in engines], tokens,
                                    fastest=quick)  # fmt: skip
    return per_token, [e.spec for e in engines]


def _median_seconds(run, runs: int, fastest: bool = False):
    """The median time of `run` (`fastest`: the least disturbed run's, for a fixed cost of
    microseconds that a busy host's scheduler can inflate a thousandfold). Given a list of runs,
    a list of their times, timed in turn: the host's speed drifts over the seconds a measurement
    takes, and twins timed one after the other carried that drift into their difference (a
    routed layer's fixed cost read 44-62 us and a dense one's 13-57 us in four profiles in a
    row)."""
    import statistics
    import time

    each = run if isinstance(run, list) else [run]
    times = [[] for _ in each]
    for r in each:
        r()  # compiled and warm
    for _ in range(max(runs, 3)):
        for r, seconds in zip(each, times):
            start = time.perf_counter()
            r()
            seconds.append(time.perf_counter() - start)
    medians = [min(t) if fastest else statistics.median(t) for t in times]
    return medians if isinstance(run, list) else medians[0]


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"
