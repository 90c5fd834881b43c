"""`refengine bench`: a plan engine timed like llama-bench — prompt processing (pp) and token
generation (tg) at given context depths — next to what the plan's cost model predicts and the
physical bound of each test (streamed bytes over the measured PCIe rate, device-resident weight
bytes over HBM, CPU-placed weight bytes over host memory), and the speedup over a baseline plan
run on the same engine."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from solver.cost import CPU, STREAMED, CostModel, TierPlacement
from solver.groups import EMBD, tensor_groups
from solver.memory import kv_layer_nbytes
from solver.usage import kv_shape


@dataclass
class Row:
    test: str  # "pp512 @ d0", "tg128 @ d4096"
    n_prompt: int
    n_gen: int
    depth: int
    runs_seconds: list[float]  # one per repetition
    predicted_seconds: float
    bound_seconds: float

    @property
    def tokens(self) -> int:
        return self.n_prompt or self.n_gen

    @property
    def measured_seconds(self) -> float:
        return float(np.mean(self.runs_seconds))

    @property
    def tps(self) -> float:
        """llama-bench's avg_ts: the mean of the runs' t/s."""
        return float(np.mean([self.tokens / s for s in self.runs_seconds]))

    @property
    def tps_stddev(self) -> float:
        rates = [self.tokens / s for s in self.runs_seconds]
        return float(np.std(rates, ddof=1)) if len(rates) > 1 else 0.0

    def llama_bench_record(self) -> dict:
        """The record llama-bench -o json writes for this test (its keys, ours beside)."""
        return {"n_prompt": self.n_prompt, "n_gen": self.n_gen, "n_depth": self.depth,
                "avg_ts": self.tps, "stddev_ts": self.tps_stddev,
                "samples_ts": [self.tokens / s for s in self.runs_seconds],
                "predicted_ts": self.tokens / self.predicted_seconds,
                "bound_ts": self.tokens / self.bound_seconds}  # fmt: skip


def bound_seconds(engine, place: TierPlacement, tier: int, profile) -> float:
    """The physical floor of one ubatch: every streamed byte over PCIe, every device-resident
    weight byte read from HBM, every CPU weight byte read from host memory, whichever is longest."""
    spec, gpu = engine.spec, profile.gpus[0]
    streamed = device = host = 0
    for g in tensor_groups(spec):
        loc = place.groups[g.name]
        if loc.kind == CPU:
            host += g.nbytes if g.kind != EMBD else 0
        else:
            device += g.nbytes if g.kind != EMBD else 0
            streamed += g.nbytes if loc.kind == STREAMED else 0
    for il, loc in place.kv.items():
        if loc.kind == STREAMED:
            streamed += kv_layer_nbytes(spec, il, kv_shape(engine.workload, tier))
    return max(
        streamed / (gpu.h2d_gbps.value * 1e9),
        device / (gpu.hbm_gbps.value * 1e9),
        host / (profile.cpu.memory_gbps.value * 1e9),
    )


def _fill(engine, depth: int, rng) -> None:
    engine.reset()
    if depth:
        engine.prefill(rng.integers(0, engine.spec.hparams.n_vocab, depth))


def run_bench(engine, profile, n_prompt: int, n_gen: int, depths: list[int], seed: int = 0,
              repetitions: int = 1):  # fmt: skip
    """Rows of pp{n_prompt} and tg{n_gen} at each depth (the cache filled untimed first), each
    timed `repetitions` times after one untimed run, as llama-bench warms up."""
    rng = np.random.default_rng(seed)
    cm = CostModel(engine.spec, profile, engine.workload, "refengine")
    if getattr(engine, "tally", None) is not None:  # count these runs, not the warm-up
        engine.tally.clear()
    rows = []
    for depth in depths:
        if n_prompt:
            seconds = []
            for _ in range(repetitions + 1):
                _fill(engine, depth, rng)
                ids = rng.integers(0, engine.spec.hparams.n_vocab, n_prompt)
                start = time.perf_counter()
                engine.prefill(ids)
                seconds.append(time.perf_counter() - start)
            seconds = seconds[1:]
            predicted = bound = 0.0
            step = engine.tier_sizes[-1]
            for first in range(0, n_prompt, step):
                n = min(step, n_prompt - first)
                tier = engine.tier_for(n)
                predicted += cm.ubatch_terms(tier.place, n, depth + first).total
                bound += bound_seconds(engine, tier.place, tier.tier, profile)
            rows.append(Row(f"pp{n_prompt} @ d{depth}", n_prompt, 0, depth, seconds, predicted,
                            bound))  # fmt: skip
        if n_gen:
            seconds = []
            for _ in range(repetitions + 1):
                _fill(engine, depth, rng)
                token = int(rng.integers(0, engine.spec.hparams.n_vocab))
                engine.decode(token)  # the first decode after the prefill tier is the switch
                start = time.perf_counter()
                for _ in range(n_gen):
                    engine.decode(token)
                seconds.append(time.perf_counter() - start)
            seconds = seconds[1:]
            tier = engine.tier_for(1)
            predicted = sum(
                cm.ubatch_terms(tier.place, 1, depth + 1 + i).total for i in range(n_gen)
            )
            bound = n_gen * bound_seconds(engine, tier.place, tier.tier, profile)
            rows.append(Row(f"tg{n_gen} @ d{depth}", 0, n_gen, depth, seconds, predicted, bound))
    return rows
