"""What the cost model predicts for a run with every part on the host's CPU — llama.cpp's CPU
backend (`llama-bench` without a GPU: nothing offloaded) or our cpu engine — per llama-bench
test: pp N (one prompt of N tokens in ubatches of at most `ubatch` tokens, at a depth) and tg N
(N single-token steps from a depth). `scripts/predictions_vs_runs.py` sets these beside the runs."""

from __future__ import annotations

from dataclasses import replace

from refengine.spec import ModelSpec

from .cost import CPU, CostModel, Loc, TierPlacement, Workload
from .groups import tensor_groups
from .profile import HardwareProfile


def all_on_cpu(spec: ModelSpec) -> TierPlacement:
    return TierPlacement({g.name: Loc(CPU) for g in tensor_groups(spec)},
                         {il: Loc(CPU) for il in range(spec.hparams.n_layer)})  # fmt: skip


def cpu_cost_model(spec: ModelSpec, profile: HardwareProfile, target: str, threads: int,
                   n_ctx: int) -> CostModel:  # fmt: skip
    """The cost model of a run on the host alone: the profile without its GPUs (llama.cpp's CPU
    backend has none to offload to)."""
    w = Workload(n_ctx=n_ctx, prompt_tokens=1, gen_tokens=1, threads=threads)
    return CostModel(spec, replace(profile, gpus=()), w, target)


def prompt_seconds(cm: CostModel, n_prompt: int, depth: int, ubatch: int = 512) -> float:
    place, total = all_on_cpu(cm.spec), 0.0
    for first in range(0, n_prompt, ubatch):
        total += float(cm.ubatch_terms(place, min(ubatch, n_prompt - first), depth + first).total)
    return total


def generation_seconds(cm: CostModel, n_gen: int, depth: int) -> float:
    place = all_on_cpu(cm.spec)
    return sum(float(cm.ubatch_terms(place, 1, depth + i).total) for i in range(n_gen))
