"""llama.cpp's CPU backend measured into the profile's `llamacpp_*` rows: what `--target llamacpp`
prices a CPU-held matrix at. llama.cpp multiplies CPU-held weights with its own kernels (int8
dot products at one token, repacked int8 GEMM from a few tokens on), ours with others (the q8
matvec, BLAS on cached fp32 panels): one row cannot price both — priced at our rates, llama.cpp's
CPU prompts ran 2.8-3.8x faster than predicted (docs/measured/2026-11-26-predictions-vs-runs.txt).

For each type, two synthetic llamas with every matrix of that type, one narrow and one wide, go
through `llama-bench` on the profile's threads: prompts of 64 and 512 tokens and a short
generation. A prompt's rate is the difference of their matrix FLOPs over the difference of their
times; what the narrow one takes beyond its FLOPs at that rate is a layer's cost per prompt token
(its products' starts, the activations' quantization, the nodes between). A generation's rate is
the weight bytes one token of the wide one reads over its time.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import tempfile
from datetime import date
from pathlib import Path
from typing import Callable

from refengine.errors import UserError
from refengine.spec import ModelSpec, load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic
from solver.cost import FFN_PRODUCTS, LAYER_PRODUCTS
from solver.memory import expected_distinct_experts
from solver.profile import (ANY_TYPE, SCORE_TWIN_KV_HEADS, SCORE_WIDE_KV_HEADS, Figure, RateTable,
                            score_row)

from .measure_cpu import (ATTENTION_DIMS, LAYER, MATMUL_TOKENS, MATVEC_TYPES, ROUTED,
                          ROUTED_TWINS, fixed_layer_seconds, layer_config,
                          layer_counts, layer_read_nbytes, matrices, routed_fixed,
                          row_seconds_and_gbps, row_twin_config, row_twins, score_heads,
                          score_twin_config, token_nbytes)

# the products' twins, by `quick`: as deep as a 1B model, so that a prompt runs for seconds over
# weights many times the last-level cache, as a real model's does (two layers, 57 MiB of Q4_K, ran
# 355 GFLOP/s where 16 ran 261 and a 1B Q4_K_M llama 268), and as narrow as the smallest real
# models (priced at a 2048-wide twin's mean rate, SmolLM2's 576-wide prompts ran 0.84-0.91 of
# predicted; these twins put a layer's cost beyond its FLOPs at 2-5 us a token by type, and the
# slope above the mean rate: Q6_K's 798 GFLOP/s where its mean read 717, docs/measured/
# 2026-11-28-product-twins.txt). One head of 64 in both: their attention, small and the same,
# cancels; a 512-token vocabulary, so that the head is noise
WIDE = dict(n_layer=16, n_embd=2048, n_ff=5632, n_head=1, n_head_kv=1, head_dim=64, n_vocab=512)
PRODUCT_TWINS = {False: (dict(WIDE, n_embd=512, n_ff=1536), WIDE),
                 True: (dict(WIDE, n_layer=1, n_embd=256, n_ff=768),
                        dict(WIDE, n_layer=1, n_embd=512, n_ff=1536))}  # fmt: skip
GEN_TOKENS = 16


def prompt_flops(spec: ModelSpec, tokens: int) -> float:
    """A prompt's matrix FLOPs through the layers (llama-bench asks for the last token's logits
    only) and its causal attention: QK^T and PV over 1..tokens keys."""
    hp = spec.hparams
    layers = sum(math.prod(t.shape) for t in matrices(spec) if t.name.startswith("blk."))
    keys = tokens * (tokens + 1) / 2
    attention = 4.0 * hp.n_layer * hp.n_head * hp.head_dim * keys
    return 2.0 * layers * tokens + attention


def bench_runs(llama_bench: Path, model: Path, threads: int, runs: int,
               prompts: tuple[int, ...] = MATMUL_TOKENS, gen: int = GEN_TOKENS,
               depths: tuple[int, ...] = (0,)) -> dict[str, list[dict]]:  # fmt: skip
    """llama-bench's JSON records of one run, by test: "pp64", "pp512", "tg16" (no prompt test
    when `prompts` is (0,)); a test at a depth past 0 is keyed "tg16@4096"."""
    cmd = [str(llama_bench), "-m", str(model), "-t", str(threads), "-p",
           ",".join(map(str, prompts)), "-n", str(gen), "-d", ",".join(map(str, depths)), "-r",
           str(runs), "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError(f"llama-bench failed on {model.name}: {out.stderr.strip()[-300:]}")
    records = {}
    for r in json.loads(out.stdout):
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        depth = int(r.get("n_depth", 0))
        records[f"{test}@{depth}" if depth else test] = r
    return records


def bench_alternated(llama_bench: Path, models: list[Path], threads: int, runs: int,
                     *args) -> list[dict[str, dict]]:  # fmt: skip
    """`bench_runs` of each of `models` (twins), one run of each in turn, `runs` times: the host's
    speed drifts over the minutes a measurement takes, and twins run one after the other carried
    that drift into their difference. A test's record holds every run's samples ("samples_ts")."""
    merged = [{} for _ in models]
    for _ in range(runs):
        for model, records in zip(models, merged):
            for test, r in bench_runs(llama_bench, model, threads, 1, *args).items():
                kept = records.setdefault(test, dict(r, samples_ts=[]))
                kept["samples_ts"] = kept["samples_ts"] + list(r["samples_ts"])
    return merged


def median_seconds(record: dict) -> float:
    """A record's median run, as seconds per token."""
    return statistics.median(token_seconds(record))


def token_seconds(record: dict) -> list[float]:
    """A llama-bench record's seconds per token, run by run."""
    return [1.0 / ts for ts in record["samples_ts"]]


# a rate over a difference of two timings is unbounded as the difference nears its noise (a quick
# profile on a loaded machine once put llama.cpp's experts at 626688 GB/s): a difference counts
# when it stands this many standard errors above zero, over at least DIFFERENCE_RUNS runs a side
DIFFERENCE_SIGMAS = 3.0
DIFFERENCE_RUNS = 3


def difference_seconds(slow: list[float], fast: list[float]) -> float | None:
    """The mean of `slow` less the mean of `fast` (two twins' runs), or None where it is not
    DIFFERENCE_SIGMAS standard errors above zero."""
    from statistics import fmean, variance

    difference = fmean(slow) - fmean(fast)
    error = math.sqrt(variance(slow) / len(slow) + variance(fast) / len(fast))
    return difference if difference > DIFFERENCE_SIGMAS * error else None


def measured_differences(twins: Callable[[int], tuple[dict, dict]], runs: int
                         ) -> dict[str, float | None]:  # fmt: skip
    """{test: seconds per token} the slow twin's runs take beyond the fast twin's, both from
    `twins(runs)` (their llama-bench records by test); a test whose difference is lost in the
    noise is run again with twice the runs, its samples pooled, and is None if it still is."""
    runs = max(runs, DIFFERENCE_RUNS)
    slow, fast = ({t: token_seconds(r) for t, r in side.items()} for side in twins(runs))
    differences = {t: difference_seconds(slow[t], fast[t]) for t in slow}
    if any(d is None for d in differences.values()):
        more_slow, more_fast = twins(2 * runs)
        for t in [t for t, d in differences.items() if d is None]:
            slow[t] += token_seconds(more_slow[t])
            fast[t] += token_seconds(more_fast[t])
            differences[t] = difference_seconds(slow[t], fast[t])
    return differences


def twins_seen(llama_bench: Path, paths: list[Path], threads: int, seen: list[dict]
               ) -> Callable[[int], tuple[dict, dict]]:  # fmt: skip
    """A `twins` callable for `measured_differences` over (fast, slow) `paths` that keeps every
    run's seconds per token of each in `seen` (by test), for the figures beside a difference."""

    def twins(n: int) -> tuple[dict, dict]:
        records = bench_alternated(llama_bench, paths, threads, n)
        for kept, twin in zip(seen, records):
            for test, r in twin.items():
                kept.setdefault(test, []).extend(token_seconds(r))
        return records[1], records[0]

    return twins


def product_rates(llama_bench: Path, threads: int, runs: int, tmp: Path, qtype: str,
                  quick: bool = False) -> tuple[dict, dict, float]:  # fmt: skip
    """({prompt tokens: GFLOP/s}, {prompt tokens: seconds per layer and token beyond the FLOPs},
    decode GB/s) of llama.cpp's products of `qtype`: PRODUCT_TWINS, llamas whose every matrix is
    of the type. Where the difference is lost in the noise, the wide twin's mean rate and no cost
    beyond it."""
    paths, specs = [], []
    for i, shape in enumerate(PRODUCT_TWINS[quick]):
        paths.append(tmp / f"{qtype}-{i}.gguf")
        write_synthetic(paths[-1], SyntheticConfig("llama", qtype=qtype, **shape))
        specs.append(load_spec(str(paths[-1])))
    seen = [{}, {}]  # narrow, wide
    differences = measured_differences(twins_seen(llama_bench, paths, threads, seen), runs)
    for path in paths:
        path.unlink()
    n_layer = specs[0].hparams.n_layer
    rates, beyond = {}, {}
    for t in MATMUL_TOKENS:
        narrow, wide = (prompt_flops(spec, t) / t for spec in specs)  # per token
        seconds = [statistics.fmean(side[f"pp{t}"]) for side in seen]
        if differences[f"pp{t}"]:
            rates[t] = (wide - narrow) / differences[f"pp{t}"] / 1e9
            beyond[t] = max(seconds[0] - narrow / (rates[t] * 1e9), 0.0) / n_layer
        else:
            rates[t] = wide / seconds[1] / 1e9
    gbps = token_nbytes(specs[1]) / statistics.fmean(seen[1][f"tg{GEN_TOKENS}"]) / 1e9
    return rates, beyond, gbps


# llama.cpp's layer twins' depths: past the cache. It decoded 512-wide Q8_0 llamas of up to 24
# layers (77 MB a token) at 20-25 GB/s from the last-level cache and from 36 layers (116 MB) on at
# ~12 GB/s; twins of 12 and 36 layers straddled that, and the layer cost taken off their slope read
# 81-152 us from one profile to the next where the slope past it is 63-73 us beyond the bytes
# (docs/measured/2026-12-07-llamacpp-layer-twins.txt). Ours has no such cliff (LAYER_COUNTS)
LLAMACPP_LAYER_COUNTS = (36, 108)


def llamacpp_layer_counts(quick: bool) -> tuple[int, int]:
    return layer_counts(True) if quick else LLAMACPP_LAYER_COUNTS


def layer_seconds(llama_bench: Path, threads: int, runs: int, tmp: Path, gbps: float,
                  quick: bool = False, kinds: tuple = (None,)) -> list[float]:  # fmt: skip
    """llama.cpp's fixed cost of a layer per decoded token, as ours is measured
    (`measure_cpu.fixed_layer_seconds`), for each of `kinds`: llamas (None) or qwen3moe (ROUTED,
    MORE_USED) of two depths generate; the slope per layer less its bytes at `gbps`, llama.cpp's
    rate for LAYER's type. Run after run, every twin generates once in turn (`measure_cpu.
    layer_seconds` times ours token by token in turn): the median run of each."""
    paths, counts = [], llamacpp_layer_counts(quick)
    for i, kind in enumerate(kinds):
        for n_layer in counts:
            paths.append(tmp / f"layers-{i}-{n_layer}.gguf")
            write_synthetic(paths[-1], layer_config(n_layer, kind, quick))
    per_token = [median_seconds(records["tg64"]) for records in
                 bench_alternated(llama_bench, paths, threads, max(runs, 3), (0,), 64)]
    specs = [load_spec(str(path)) for path in paths]
    for path in paths:
        path.unlink()
    return fixed_layer_seconds(per_token, counts, specs, gbps)


# llama.cpp's decode from the last-level cache: Q8_0 llamas of LAYER's width from a few layers to
# the deepest layer twin, whose per-layer time is the streaming reference. On this host twins of up
# to 24 layers (77 MB a token) decoded at 20-25 GB/s and from 36 (116 MB) on at ~12, and
# SmolLM2-135M's ~100 MB a token ran 1.47x its streaming price in sitting z (docs/measured/
# 2026-12-07-llamacpp-layer-twins.txt). A ladder, as the cliff's place is the host's
CACHE_LADDER = {False: (3, 6, 12, 18, 24, 30, 36, 108), True: (1, 2, 10)}


def cache_speedups(llama_bench: Path, threads: int, runs: int, tmp: Path,
                   quick: bool = False) -> dict[int, float]:  # fmt: skip
    """{bytes a token reads: how many times faster than streaming} of llama.cpp's decode on
    CACHE_LADDER's twins, generating 64 tokens in turn: the deepest twin's time per layer times
    a twin's layers over that twin's time (the deepest reads 1)."""
    counts, paths = CACHE_LADDER[quick], []
    for n_layer in counts:
        paths.append(tmp / f"ladder-{n_layer}.gguf")
        write_synthetic(paths[-1], layer_config(n_layer, quick=quick))
    seconds = [median_seconds(records["tg64"]) for records in
               bench_alternated(llama_bench, paths, threads, max(runs, 3), (0,), 64)]
    nbytes = [token_nbytes(load_spec(str(path))) for path in paths]
    for path in paths:
        path.unlink()
    # (as one quotient: the deepest reads exactly 1, where n * (t / n) / t may round below it)
    return {b: n * seconds[-1] / (counts[-1] * s) for b, n, s in zip(nbytes, counts, seconds)}


HEAD_RUNS = 5


def head_rates(llama_bench: Path, threads: int, runs: int, tmp: Path,
               quick: bool) -> tuple[float, float]:  # fmt: skip
    """(seconds per row, GB/s) of llama.cpp's output head in a decode (`row_seconds_and_gbps`
    on ROW_TWINS). Five runs at least: their rows' difference is a tenth of their time, and
    profile y's three runs a side lost it (rows free at 12.3 GB/s, where twins run beside real
    files read 16.4 GB/s and 7.1 ns a row, and priced Gemma-3's decode within 5%)."""
    paths = [tmp / f"rows-{width}.gguf" for width, _ in row_twins(quick)]
    for path, (width, vocab) in zip(paths, row_twins(quick)):
        write_synthetic(path, row_twin_config(width, vocab))
    seconds = [median_seconds(records["tg32"]) for records in
               bench_alternated(llama_bench, paths, threads, max(runs, HEAD_RUNS), (0,), 32)]
    specs = [load_spec(str(path)) for path in paths]
    for path in paths:
        path.unlink()
    return row_seconds_and_gbps(tuple(seconds), specs)


# the attention twins' layers x head size: a cache as large as a real model's, 64 MiB at depth
# 4096, past the host's last-level cache. 4-layer twins, whose cache stayed in it, read 2.1 or 3.3
# ns per key and query head of 128 from one run to the next; 32 layers of 64 and of 128 read
# within 10% of a qwen2-1.5B and a llama-1B shape run beside them
SCORE_LAYER_DIMS = 32 * 64
# the depths they run at: the depths the predictions are checked at
SCORE_DEPTHS = (2048, 4096)
# and their KV heads: through sittings l-q the twins of 2 read 1.45-1.5 ns per query head and key
# of 64 at depth 2048 where qwen3moe-2b (4 KV heads) and llama-1B (8) ran ~1.9-2.0 and qwen2-1.5B
# (2) ran as its twin; in another hour all of them ran ~2.0 (docs/measured/2026-11-28-kv-heads.txt)
SCORE_KV_HEADS = (SCORE_TWIN_KV_HEADS, SCORE_WIDE_KV_HEADS)


def score_layers(head_dim: int, quick: bool, kv_heads: int = SCORE_TWIN_KV_HEADS) -> int:
    """The twin's layers: as much attention work whatever its heads."""
    layers = 4 if quick else SCORE_LAYER_DIMS // head_dim
    return max(layers * SCORE_TWIN_KV_HEADS // kv_heads, 1)


def attention_score_seconds(llama_bench: Path, threads: int, runs: int, tmp: Path,
                            quick: bool = False) -> tuple[dict, dict]:  # fmt: skip
    """({(depth, KV heads): {head size: seconds}} of llama.cpp's CPU attention in a prompt, per
    layer, query head, token and key; the same in a decode): for each of ATTENTION_DIMS,
    synthetic llamas of small matrices (each of SCORE_KV_HEADS KV heads of the size, `score_heads`
    query heads over them) run a prompt and a decode at each of SCORE_DEPTHS and at 0; the
    difference per layer, query head, token and key. (Priced as our F16 BLAS rate instead,
    SmolLM2's prompt at depth 4096 ran 0.68 of predicted; as the cache bytes read at a rate
    measured on 64-wide heads, qwen2-1.5B's decode at depth 2048 ran 1.14.)"""
    depths, tokens = ((256, 512), 64) if quick else (SCORE_DEPTHS, 512)
    prompt, decode = {}, {}
    for dim in ATTENTION_DIMS:
        twins = [(kv, score_layers(dim, quick, kv), tmp / f"attention-{dim}-{kv}.gguf")
                 for kv in SCORE_KV_HEADS]  # fmt: skip
        for kv, layers, path in twins:
            write_synthetic(path, score_twin_config(layers, dim, 2 * (depths[-1] + tokens), kv))
        records = bench_alternated(llama_bench, [path for *_, path in twins], threads,
                                   max(runs, 3), (tokens,), GEN_TOKENS, (0, *depths))  # fmt: skip
        for (kv, layers, path), twin in zip(twins, records):
            path.unlink()
            for table, test in ((prompt, f"pp{tokens}"), (decode, f"tg{GEN_TOKENS}")):
                for d in depths:
                    deeper_seconds = (median_seconds(twin[f"{test}@{d}"])
                                      - median_seconds(twin[test]))  # fmt: skip
                    table.setdefault((d, kv), {})[dim] = max(
                        deeper_seconds / (layers * score_heads(kv) * d), 0.0)
    return prompt, decode


# llama.cpp's routed experts (mul_mat_id: each expert's rows over the tokens it drew) run slower
# than its dense products, on a prompt and in a decode: two routed models differing only in their
# experts' width. At LAYER's 512 width (experts 256 and 1024 wide) the prompt's rate at 16 tokens
# an expert swung 68-90 GFLOP/s between three measurements in a row and 74-135 between profiles,
# while it ran 104-128 at 1024 (experts 512 and 2048): as wide as the narrowest routed models,
# where a product, not its call, takes the time (docs/measured/2026-11-27-expert-twins.txt)
EXPERT_TWIN = dict(n_embd=1024, n_head=16, n_head_kv=4)
EXPERT_WIDTHS = {False: (512, 2048), True: (256, 1024)}  # by `quick`
# a third twin chooses MORE_SLOTS times the experts of as many (so that each draws as many tokens,
# at the same FLOPs a token and expert): what each (token, expert chosen) costs beyond its FLOPs.
# Priced by Q8_0's twins whatever their type, qwen3moe-2b's (Q4_K and Q6_K) prompts ran 0.96-1.20
# of predicted; by their type's rate alone, 0.86; with this, 0.92 (0.3-2.7 us a token and expert
# chosen by type: the rows' gather and quantization, docs/measured/2026-11-28-product-twins.txt)
MORE_SLOTS = 2
# a fourth, a dense qwen3 whose FFN has the narrow twin's FLOPs a token: what a routed FFN costs
# a prompt token beyond what a dense one of its FLOPs does (the router's softmax and top-k, the
# experts' weighting and sum). Without it qwen3moe twins of 8 and of 32 experts ran 1.18-1.25x
# their price at pp512 while their dense twins ran 1.17 (6.2 us a layer and token more, Q4_K,
# docs/measured/2026-11-28-routed-twins.txt)


def expert_twin(width: int, quick: bool, qtype: str, more: bool = False, dense: bool = False):
    """A twin of `expert_rates`: a qwen3moe (ROUTED) at EXPERT_TWIN's width (`quick`: TINY's)
    whose every matrix is `qtype` and whose experts are `width` wide; `more`: MORE_SLOTS times the
    experts, of which MORE_SLOTS times as many are chosen; `dense`: a qwen3 whose FFN is as wide
    as the experts a token chooses."""
    from dataclasses import replace

    twin = replace(layer_config(layer_counts(quick)[0], ROUTED, quick, qtype), n_ff_exp=width,
                   **({} if quick else EXPERT_TWIN))  # fmt: skip
    if dense:
        return replace(twin, arch="qwen3", n_ff=width * twin.n_expert_used, n_expert=0,
                       n_expert_used=0, n_ff_exp=0)  # fmt: skip
    return replace(twin, n_expert=twin.n_expert * MORE_SLOTS,
                   n_expert_used=twin.n_expert_used * MORE_SLOTS) if more else twin


def expert_rates(llama_bench: Path, threads: int, runs: int, tmp: Path, qtype: str,
                 expert_seconds: float, dense: tuple[dict[int, float], dict[int, float]],
                 quick: bool = False) -> tuple[dict, dict, dict, float | None]:  # fmt: skip
    """({tokens an expert draws: GFLOP/s} on a prompt, {prompt tokens: seconds per layer, token
    and expert chosen}, {prompt tokens: seconds per layer and token}, decode GB/s) of llama.cpp's
    routed experts of `qtype`: qwen3moe models (ROUTED, EXPERT_TWIN's width) whose experts are
    EXPERT_WIDTHS wide run pp64, pp512 and tg16 (`expert_twin`); the difference of their times over
    the difference of their expert FLOPs (a prompt) or of the expert bytes a token reads (a
    decode). The narrow one's twin with MORE_SLOTS times the experts chosen takes, beyond it,
    those FLOPs at that rate, `expert_seconds` for each expert more a ubatch touches, and the cost
    of each (token, expert chosen). Its dense twin takes, short of it, its FFN's products at
    `dense`'s rates (the type's ({prompt tokens: GFLOP/s}, {prompt tokens: seconds per layer and
    token beyond}) from `product_rates`, the FFN's share of the latter) against the experts' FLOPs
    at their rate, their starts and slots, and a routed layer's own cost per token. A difference
    lost in the noise (`measured_differences`) gives no figure: that prompt's rows are left out,
    the decode's is None."""
    n_layer = layer_counts(quick)[0]
    widths = EXPERT_WIDTHS[quick]
    configs = [expert_twin(w, quick, qtype) for w in widths]
    configs.append(expert_twin(widths[0], quick, qtype, more=True))
    configs.append(expert_twin(widths[0], quick, qtype, dense=True))
    paths, specs = [tmp / f"experts-{qtype}-{i}.gguf" for i in range(4)], []
    for path, config in zip(paths, configs):
        write_synthetic(path, config)
        specs.append(load_spec(str(path)))
    nbytes = [layer_read_nbytes(spec) * n_layer for spec in specs]  # differ in their experts'
    wider = measured_differences(twins_seen(llama_bench, paths[:2], threads, [{}, {}]), runs)
    more = measured_differences(twins_seen(llama_bench, paths[::2], threads, [{}, {}]),
                                runs)
    routed = measured_differences(twins_seen(llama_bench, [paths[3], paths[0]], threads,
                                             [{}, {}]), runs)  # fmt: skip
    for path in paths:
        path.unlink()
    hp, extra = specs[0].hparams, specs[2].hparams
    flops_per_token = (2.0 * 3 * hp.n_embd * (widths[1] - widths[0])
                       * hp.n_expert_used * n_layer)  # fmt: skip
    more_flops = 2.0 * 3 * hp.n_embd * widths[0] * (extra.n_expert_used - hp.n_expert_used)
    ffn_flops = 2.0 * 3 * hp.n_embd * widths[0] * hp.n_expert_used  # a token's, either twin's
    prompt, slots, own = {}, {}, {}
    for t in MATMUL_TOKENS:
        touched = expected_distinct_experts(hp.n_expert, hp.n_expert_used, t)
        drawn = round(t * hp.n_expert_used / touched)
        if not wider[f"pp{t}"]:
            continue
        prompt[drawn] = flops_per_token / wider[f"pp{t}"] / 1e9
        if more[f"pp{t}"]:
            more_touched = expected_distinct_experts(extra.n_expert, extra.n_expert_used, t)
            beyond = (more[f"pp{t}"] / n_layer - more_flops / (prompt[drawn] * 1e9)
                      - (more_touched - touched) * expert_seconds / t)  # fmt: skip
            slots[t] = max(beyond, 0.0) / (extra.n_expert_used - hp.n_expert_used)
        rates, beyond_dense = dense
        if routed[f"pp{t}"] and t in slots and t in rates:
            experts = (ffn_flops / (prompt[drawn] * 1e9) + touched * expert_seconds / t
                       + hp.n_expert_used * slots[t])  # fmt: skip
            products = (ffn_flops / (rates[t] * 1e9)
                        + FFN_PRODUCTS / LAYER_PRODUCTS * beyond_dense.get(t, 0.0))  # fmt: skip
            own[t] = max(routed[f"pp{t}"] / n_layer - experts + products, 0.0)
    decode_seconds = wider[f"tg{GEN_TOKENS}"]
    gbps = (nbytes[1] - nbytes[0]) / decode_seconds / 1e9 if decode_seconds else None
    return prompt, slots, own, gbps


def measure_llamacpp_cpu(
    llama_bench: Path,
    threads: int,
    quick: bool = False,
    progress: Callable[[str], None] = lambda s: None,
    types: tuple[str, ...] = MATVEC_TYPES,
) -> dict[str, RateTable | Figure]:
    """llama.cpp's CPU rows of the profile (`CPUProfile`'s llamacpp_* fields), measured with
    `llama_bench` (a llama.cpp build's llama-bench): by type, its products' GFLOP/s and a layer's
    cost per token beyond them by prompt tokens, its decode weight GB/s by threads; its fixed
    cost of a layer per token and a routed layer's; by type, its routed experts' prompt GFLOP/s by
    tokens an expert draws and their cost per token and expert chosen; their decode GB/s; its
    attention's time per query head and key in a prompt and a decode."""
    runs = 1 if quick else 3
    narrow, wide = PRODUCT_TWINS[quick]
    short = f"measured: refengine profile {date.today().isoformat()}, llama-bench -t {threads}"
    src = (f"{short}; synthetic llamas ({wide['n_layer']} layers, {narrow['n_embd']} x "
           f"{narrow['n_ff']} and {wide['n_embd']} x {wide['n_ff']}) of the type, at least "
           f"{max(runs, DIFFERENCE_RUNS)} runs each")  # fmt: skip
    twins_head = (f"{short}; synthetic llamas of one layer whose Q8_0 heads hold the same bytes "
                  "in 4x the rows, generating 32 tokens")
    matmul, beyond, matvec = {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="refengine-llamacpp-") as tmp:
        progress("llama.cpp's output head")
        head_row, head_gbps = head_rates(llama_bench, threads, runs, Path(tmp), quick)
        for name in types:
            progress(f"llama.cpp CPU {name}")
            rates, layer, gbps = product_rates(llama_bench, threads, runs, Path(tmp), name, quick)
            matmul[name] = {t: Figure(x, f"{src}; pp{t}: the difference of their FLOPs over "
                                         "the difference of their times")
                            for t, x in rates.items()}  # fmt: skip
            beyond[name] = {t: Figure(x, f"{src}; pp{t}: the narrow one's time beyond its FLOPs "
                                         "at that rate, per layer and token")
                            for t, x in layer.items()}  # fmt: skip
            matvec[name] = {threads: Figure(gbps, f"{src}; the wide one's tg{GEN_TOKENS}, weight "
                                                  "bytes per token")}  # fmt: skip
        progress("llama.cpp's fixed cost of a layer")
        qtype = LAYER["qtype"]
        gbps = (matvec.get(qtype) or next(iter(matvec.values())))[threads].value
        depths = " and ".join(map(str, llamacpp_layer_counts(quick)))
        per_layer = Figure(layer_seconds(llama_bench, threads, runs, Path(tmp), gbps, quick)[0],
                           f"{short}; synthetic {qtype} llamas of {depths} layers generating 64 "
                           f"tokens, the slope per layer less its bytes at llama.cpp's {qtype} "
                           "rate")  # fmt: skip
        progress("llama.cpp's decode from the cache")
        speedups = cache_speedups(llama_bench, threads, runs, Path(tmp), quick)
        how = (f"{short}; synthetic {qtype} llamas of {' '.join(map(str, CACHE_LADDER[quick]))} "
               "layers generating 64 tokens in turn: the deepest's time a layer times the "
               "layers, over the time")
        cached = RateTable("x", {ANY_TYPE: {b: Figure(x, how) for b, x in speedups.items()}})
        routed, per_expert = routed_fixed(*layer_seconds(llama_bench, threads, runs, Path(tmp),
                                                         gbps, quick, ROUTED_TWINS))  # fmt: skip
        qwen3moe = per_layer.source.replace("llamas", "qwen3moe (8 experts, 2 and 6 used)")
        per_routed_layer = Figure(routed, f"{qwen3moe}, the intercept at none used")
        per_expert = Figure(per_expert, f"{qwen3moe}, the slope per expert used")
        width = expert_twin(EXPERT_WIDTHS[quick][0], quick, qtype).n_embd
        twins = (f"{short}; synthetic qwen3moe ({width} wide, 8 experts, 2 used) of the type with "
                 f"experts {' and '.join(map(str, EXPERT_WIDTHS[quick]))} wide")  # fmt: skip
        noise = (f" (at least {max(runs, DIFFERENCE_RUNS)} runs a side, the difference "
                 f"{DIFFERENCE_SIGMAS:g} standard errors above 0)")
        experts, slots, owns, decodes = {}, {}, {}, {}
        for name in types:
            progress(f"llama.cpp's routed {name} experts")
            dense = ({t: x.value for t, x in matmul[name].items()},
                     {t: x.value for t, x in beyond[name].items()})
            prompt, slot, own, gbps = expert_rates(llama_bench, threads, runs, Path(tmp), name,
                                                   per_expert.value, dense, quick)  # fmt: skip
            experts[name] = {drawn: Figure(x, f"{twins}, pp64 and pp512: the difference, "
                                              f"{drawn} tokens an expert{noise}")
                             for drawn, x in prompt.items()}  # fmt: skip
            slots[name] = {t: Figure(x, f"{twins}, and the narrow one's twin choosing 4 of 16: "
                                        f"pp{t}, the difference beyond its FLOPs and experts, per "
                                        f"layer, token and expert chosen{noise}")
                           for t, x in slot.items()}  # fmt: skip
            owns[name] = {t: Figure(x, f"{twins}, and the narrow one's dense qwen3 twin whose FFN "
                                       f"is as wide as the experts a token chooses: pp{t}, the "
                                       "difference beyond the experts' FLOPs, starts and slots "
                                       "less the dense FFN's products, per layer and token{noise}")
                          for t, x in own.items()}  # fmt: skip
            decodes[name] = gbps
        decode = decodes.get(qtype) or next((x for x in decodes.values() if x), None)
        progress("llama.cpp's attention")
        prompt_scores, decode_scores = attention_score_seconds(llama_bench, threads, runs,
                                                               Path(tmp), quick)  # fmt: skip
        scores = {test: RateTable("s", {score_row(depth, kv): {
            dim: Figure(x, f"{short}; a synthetic llama of {score_layers(dim, quick, kv)} "
                           f"layers, {score_heads(kv)} query heads over {kv} KV heads of {dim}, "
                           f"{test} at depth {depth} and 0: the difference per layer, query "
                           "head, token and key")
            for dim, x in cells.items()} for (depth, kv), cells in table.items()})
            for test, table in (("a prompt", prompt_scores), ("a decode", decode_scores))}
    return dict(llamacpp_matmul_gflops=RateTable("GFLOP/s", with_any(matmul, qtype)),
                llamacpp_prompt_layer_seconds=table_or_none("s", beyond, qtype),
                llamacpp_matvec_gbps=RateTable("GB/s", matvec),
                llamacpp_head_row_seconds=Figure(head_row, f"{twins_head}, per row"),
                llamacpp_head_gbps=Figure(head_gbps, f"{twins_head}, per byte"),
                llamacpp_decode_cache_speedup=cached,
                llamacpp_layer_seconds=per_layer, llamacpp_routed_layer_seconds=per_routed_layer,
                llamacpp_expert_seconds=per_expert,
                llamacpp_expert_gflops=table_or_none("GFLOP/s", experts, qtype),
                llamacpp_expert_slot_seconds=table_or_none("s", slots, qtype),
                llamacpp_routed_token_seconds=table_or_none("s", owns, qtype),
                llamacpp_expert_gbps=decode and Figure(
                    decode, f"{twins.replace('of the type', f'of {qtype}')}, tg{GEN_TOKENS}: the "
                            "difference of the expert bytes a token reads over the difference of "
                            f"the times{noise}"),
                llamacpp_prompt_score_seconds=scores["a prompt"],
                llamacpp_decode_score_seconds=scores["a decode"])


def table_or_none(unit: str, rows: dict[str, dict], qtype: str) -> RateTable | None:
    """The rows as a table (`with_any`), or None where every type's row was left out (each a
    difference of two runs lost in the noise): the cost model then prices nothing beyond the
    products' FLOPs, where an empty table would have no row to price a type by."""
    return RateTable(unit, with_any(rows, qtype)) if any(rows.values()) else None


def with_any(rows: dict[str, dict], qtype: str) -> dict[str, dict]:
    """Rows by type, empty ones dropped, with `qtype`'s (LAYER's) standing for a type not measured
    (or the first measured)."""
    rows = {name: row for name, row in rows.items() if row}
    if rows:
        rows[ANY_TYPE] = rows.get(qtype) or next(iter(rows.values()))
    return rows
