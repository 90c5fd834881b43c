"""llama.cpp's CPU backend measured into the profile's `llamacpp_*` rows: what `--target llamacpp`
prices a CPU-held matrix at. llama.cpp multiplies CPU-held weights with its own kernels (int8
dot products at one token, repacked int8 GEMM from a few tokens on), ours with others (the q8
matvec, BLAS on cached fp32 panels): one row cannot price both — priced at our rates, llama.cpp's
CPU prompts ran 2.8-3.8x faster than predicted (docs/measured/2026-11-26-predictions-vs-runs.txt).

For each type, a synthetic llama model with every matrix of that type goes through `llama-bench`
on the profile's threads: prompts of 64 and 512 tokens and a short generation. A prompt's rate is
its matrix and attention FLOPs over its time; a generation's, the weight bytes one token reads
over its time. The other ops (norms, RoPE, softmax) ride in both, as they do in a real model.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from datetime import date
from pathlib import Path
from typing import Callable

from refengine.errors import UserError
from refengine.spec import ModelSpec, load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic
from solver.memory import kv_cell_nbytes
from solver.profile import Figure, RateTable

from .measure_cpu import MATMUL_TOKENS, MATVEC_TYPES, ROUTED, TINY_LAYERS, tiny_config

# wide enough that the matrices, not the per-op overheads, take the time; as deep as a 1B model,
# so that a prompt runs for seconds over weights many times the last-level cache, as a real
# model's does (two layers, 57 MiB of Q4_K, ran 355 GFLOP/s where 16 ran 261 and a 1B Q4_K_M
# llama 268: priced at the two layers' rate, real models' prompts ran 0.60-0.76 of predicted);
# a 512-token vocabulary so the head is noise
SHAPE = dict(n_layer=16, n_embd=2048, n_ff=5632, n_head=16, n_head_kv=16, n_vocab=512)
QUICK_SHAPE = dict(n_layer=1, n_embd=512, n_ff=1536, n_head=4, n_head_kv=4, n_vocab=512)
GEN_TOKENS = 16


def matrices(spec: ModelSpec) -> list:
    """The matrices a token multiplies by (the embedding is a row lookup)."""
    return [t for t in spec.tensors if len(t.shape) >= 2 and t.name != "token_embd.weight"]


def prompt_flops(spec: ModelSpec, tokens: int) -> float:
    """A prompt's matrix FLOPs through the layers (llama-bench asks for the last token's logits
    only) and its causal attention: QK^T and PV over 1..tokens keys."""
    hp = spec.hparams
    layers = sum(math.prod(t.shape) for t in matrices(spec) if t.name.startswith("blk."))
    keys = tokens * (tokens + 1) / 2
    attention = 4.0 * hp.n_layer * hp.n_head * hp.head_dim * keys
    return 2.0 * layers * tokens + attention


def token_nbytes(spec: ModelSpec) -> int:
    """The weight bytes one generated token reads: every matrix, the head included."""
    return sum(t.nbytes for t in matrices(spec))


def bench(llama_bench: Path, model: Path, threads: int, runs: int,
          prompts: tuple[int, ...] = MATMUL_TOKENS, gen: int = GEN_TOKENS,
          depths: tuple[int, ...] = (0,)) -> dict[str, float]:  # fmt: skip
    """{"pp64": t/s, "pp512": t/s, "tg16": t/s} of one llama-bench run (no prompt test when
    `prompts` is (0,)); a test at a depth past 0 is keyed "tg16@4096"."""
    cmd = [str(llama_bench), "-m", str(model), "-t", str(threads), "-p",
           ",".join(map(str, prompts)), "-n", str(gen), "-d", ",".join(map(str, depths)), "-r",
           str(runs), "-o", "json"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise UserError(f"llama-bench failed on {model.name}: {out.stderr.strip()[-300:]}")
    rates = {}
    for r in json.loads(out.stdout):
        test = f"pp{r['n_prompt']}" if r["n_prompt"] else f"tg{r['n_gen']}"
        depth = int(r.get("n_depth", 0))
        rates[f"{test}@{depth}" if depth else test] = float(r["avg_ts"])
    return rates


def layer_seconds(llama_bench: Path, threads: int, runs: int, tmp: Path,
                  kind: dict | None = None) -> float:  # fmt: skip
    """llama.cpp's fixed cost of a layer per decoded token: tiny llamas (or, `ROUTED`, tiny
    qwen3moe) of TINY_LAYERS layers generate; the slope per layer (its graph's nodes, whatever
    their width)."""
    per_token = []
    for n_layer in TINY_LAYERS:
        path = tmp / f"tiny-{n_layer}.gguf"
        write_synthetic(path, tiny_config(n_layer, kind))
        per_token.append(1.0 / bench(llama_bench, path, threads, runs, (0,), 64)["tg64"])
    return max((per_token[1] - per_token[0]) / (TINY_LAYERS[1] - TINY_LAYERS[0]), 0.0)


# a decode whose time at depth is its attention: small matrices, grouped heads (4 query heads a
# KV head, as most models), a deep cache
ATTENTION_SHAPE = dict(n_layer=8, n_embd=512, n_ff=512, n_head=8, n_head_kv=2, n_vocab=512)
ATTENTION_DEPTH = 4096


def attention_gbps(llama_bench: Path, threads: int, runs: int, tmp: Path,
                   depth: int = ATTENTION_DEPTH) -> float:  # fmt: skip
    """llama.cpp's CPU decode attention as the rate it reads the cache at, counted as the cost
    model counts it (each query head reads its KV head's cells: fp16 K and V): a generated
    token's time at `depth` less its time at 0, over those bytes."""
    path = tmp / "attention.gguf"
    write_synthetic(path, SyntheticConfig("llama", **ATTENTION_SHAPE))
    spec = load_spec(str(path))
    rates = bench(llama_bench, path, threads, runs, (0,), GEN_TOKENS, (0, depth))
    generated = f"tg{GEN_TOKENS}"
    deeper_seconds = 1.0 / rates[f"{generated}@{depth}"] - 1.0 / rates[generated]
    hp = spec.hparams
    nbytes = hp.n_layer * depth * kv_cell_nbytes(spec, "f16") * hp.n_head / hp.n_head_kv
    return nbytes / max(deeper_seconds, 1e-9) / 1e9


def measure_llamacpp_cpu(
    llama_bench: Path,
    threads: int,
    quick: bool = False,
    progress: Callable[[str], None] = lambda s: None,
    types: tuple[str, ...] = MATVEC_TYPES,
) -> tuple[RateTable, RateTable, Figure, Figure, Figure]:
    """(llama.cpp's CPU matmul GFLOP/s by type and prompt tokens, its decode weight GB/s by type
    and threads, its fixed cost of a layer per token, a routed layer's, its decode attention's
    cache GB/s), measured with `llama_bench` (a llama.cpp build's llama-bench)."""
    shape, runs = (QUICK_SHAPE, 1) if quick else (SHAPE, 3)
    src = (f"measured: refengine profile {date.today().isoformat()}, llama-bench -t {threads} "
           f"on a synthetic llama ({shape['n_layer']} layers, {shape['n_embd']} x "
           f"{shape['n_ff']}) of the type, mean of {runs}")  # fmt: skip
    matmul, matvec = {}, {}
    with tempfile.TemporaryDirectory(prefix="refengine-llamacpp-") as tmp:
        for name in types:
            progress(f"llama.cpp CPU {name}")
            path = Path(tmp) / f"{name}.gguf"
            write_synthetic(path, SyntheticConfig("llama", qtype=name, **shape))
            spec = load_spec(str(path))
            rates = bench(llama_bench, path, threads, runs)
            matmul[name] = {
                t: Figure(prompt_flops(spec, t) * rates[f"pp{t}"] / t / 1e9, f"{src}; pp{t}")
                for t in MATMUL_TOKENS
            }
            matvec[name] = {
                threads: Figure(token_nbytes(spec) * rates[f"tg{GEN_TOKENS}"] / 1e9,
                                f"{src}; tg{GEN_TOKENS}, weight bytes per token")  # fmt: skip
            }
            path.unlink()
        progress("llama.cpp's fixed cost of a layer")
        per_layer = Figure(layer_seconds(llama_bench, threads, runs, Path(tmp)),
                           f"{src.split(' on a synthetic')[0]}; tiny synthetic llamas of "
                           f"{' and '.join(map(str, TINY_LAYERS))} layers generating 64 tokens, "
                           "the slope per layer")  # fmt: skip
        per_routed_layer = Figure(layer_seconds(llama_bench, threads, runs, Path(tmp), ROUTED),
                                  per_layer.source.replace("llamas", "qwen3moe (8 experts, 2 "
                                                                     "used)"))  # fmt: skip
        progress("llama.cpp's decode attention")
        depth = ATTENTION_DEPTH // (8 if quick else 1)
        attention = Figure(attention_gbps(llama_bench, threads, runs, Path(tmp), depth),
                           f"{src.split(' on a synthetic')[0]}; a synthetic llama of "
                           f"{ATTENTION_SHAPE['n_layer']} layers, 8 query heads over 2 KV heads "
                           f"of 64, generating at depth {depth} and 0: the cache bytes its query "
                           "heads read over the difference")  # fmt: skip
    return (RateTable("GFLOP/s", matmul), RateTable("GB/s", matvec), per_layer, per_routed_layer,
            attention)
