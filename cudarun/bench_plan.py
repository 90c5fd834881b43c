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
from solver.groups import EMBD, EXPERTS, tensor_groups
from solver.memory import kv_layer_nbytes
from solver.shares import group_share_nbytes
from solver.tensor_split import share_fractions, split_operations
from solver.tensor_split import ubatch_terms as split_terms
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
    # expert stacks copied up per token: counted by the engine over the timed runs, and the cost
    # model's expectation
    expert_nbytes: float = 0.0
    predicted_expert_nbytes: float = 0.0

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


def bound_seconds(engine, place: TierPlacement, tier: int, profile, cm: CostModel,
                  tokens: int) -> float:  # fmt: skip
    """The physical floor of one ubatch of `tokens`: every streamed byte over PCIe (a routed
    stack's expected experts), every device-resident weight byte read from HBM, every CPU weight
    byte read from host memory, whichever is longest."""
    spec, gpu = engine.spec, profile.gpus[0]
    if getattr(engine, "shares", None) is not None:  # a tensor split: the largest share, at once
        device = max(sum(group_share_nbytes(spec, g.tensors, engine.shares, d)
                         for g in tensor_groups(spec) if g.kind != EMBD)
                     for d in engine.shares.devices)  # fmt: skip
        return device / (gpu.hbm_gbps.value * 1e9)
    streamed, device, host = cm.expert_copy_nbytes(place, tokens), 0, 0
    for g in tensor_groups(spec):
        loc = place.groups[g.name]
        if loc.kind == CPU:
            host += g.nbytes if g.kind != EMBD else 0
        else:
            device += g.nbytes if g.kind != EMBD else 0
            streamed += g.nbytes if loc.kind == STREAMED and g.kind != EXPERTS else 0
    for il, loc in place.kv.items():
        if loc.kind == STREAMED:
            streamed += kv_layer_nbytes(spec, il, kv_shape(engine.workload, tier))
    return max(
        streamed / (gpu.h2d_gbps.value * 1e9),
        device / (gpu.hbm_gbps.value * 1e9),
        host / (profile.cpu.memory_gbps.value * 1e9),
    )


def ubatch_seconds(engine, cm: CostModel, tier, tokens: int, depth: int) -> float:
    """The cost model's time of one ubatch of the engine's plan (a tensor split's, by its
    shares)."""
    if getattr(engine, "shares", None) is not None:
        return split_terms(cm, share_fractions(engine.shares), tokens, depth, 1).total
    return cm.ubatch_terms(tier.place, tokens, depth).total


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
    if getattr(engine, "expert_lookups", None) is not None:
        engine.expert_lookups.clear()
    rows = []
    for depth in depths:
        if n_prompt:
            seconds, copied = [], []
            for _ in range(repetitions + 1):
                _fill(engine, depth, rng)
                ids = rng.integers(0, engine.spec.hparams.n_vocab, n_prompt)
                before, start = _expert_nbytes(engine), time.perf_counter()
                engine.prefill(ids)
                seconds.append(time.perf_counter() - start)
                copied.append(_expert_nbytes(engine) - before)
            predicted = bound = experts = 0.0
            step = engine.tier_sizes[-1]
            for first in range(0, n_prompt, step):
                n = min(step, n_prompt - first)
                tier = engine.tier_for(n)
                predicted += ubatch_seconds(engine, cm, tier, n, depth + first)
                bound += bound_seconds(engine, tier.place, tier.tier, profile, cm, n)
                experts += cm.expert_copy_nbytes(tier.place, n)
            rows.append(Row(f"pp{n_prompt} @ d{depth}", n_prompt, 0, depth, seconds[1:],
                            predicted, bound, np.mean(copied[1:]) / n_prompt,
                            experts / n_prompt))  # fmt: skip
        if n_gen:
            seconds, copied = [], []
            for _ in range(repetitions + 1):
                _fill(engine, depth, rng)
                token = int(rng.integers(0, engine.spec.hparams.n_vocab))
                # the first decode after the prefill tier is the switch
                token = int(np.argmax(engine.decode(token)))
                before, start = _expert_nbytes(engine), time.perf_counter()
                for _ in range(n_gen):  # greedy: an expert cache sees a real generation's routing
                    token = int(np.argmax(engine.decode(token)))
                seconds.append(time.perf_counter() - start)
                copied.append(_expert_nbytes(engine) - before)
            tier = engine.tier_for(1)
            predicted = sum(ubatch_seconds(engine, cm, tier, 1, depth + 1 + i) for i in range(n_gen))
            bound = n_gen * bound_seconds(engine, tier.place, tier.tier, profile, cm, 1)
            rows.append(Row(f"tg{n_gen} @ d{depth}", 0, n_gen, depth, seconds[1:], predicted,
                            bound, np.mean(copied[1:]) / n_gen,
                            cm.expert_copy_nbytes(tier.place, 1)))  # fmt: skip
    return rows


def operation_lines(engine, profile) -> list[str]:
    """Per tier and ubatch size run: what each ubatch moved between the CPU and the devices, as
    the schedule the engine issued counts it (copies, all-reduces, hops: `counts.
    schedule_operations`), beside the cost model's count."""
    tally = getattr(engine, "tally", None)
    if tally is None:
        return []
    cm = CostModel(engine.spec, profile, engine.workload, "refengine")
    out = []
    for (t, n, _), (ubatches, total) in sorted(tally.rows.items()):
        if engine.shares is not None:
            want = split_operations(engine.spec.hparams.n_layer, len(engine.shares.devices))
        else:
            want = cm.ubatch_operations(engine.tiers[t].place, n)
        got = [getattr(engine.tiers[t].operations, f) for f in OPERATIONS]
        out.append(f"tier {t}, {n}-token ubatches ({ubatches} run): per ubatch "
                   + ", ".join(f"{g} {f.replace('_', '-')}" for g, f in zip(got, OPERATIONS))
                   + " issued; the cost model's "
                   + ", ".join(f"{getattr(want, f)}" for f in OPERATIONS))  # fmt: skip
    return out


OPERATIONS = ("copies", "all_reduces", "hops")


def _expert_nbytes(engine) -> int:
    """The expert bytes the engine has copied so far (the cpu engine copies none)."""
    return getattr(engine, "expert_copied_nbytes", 0)
