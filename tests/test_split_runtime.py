"""Tensor split in our runtime (issue 20, llama.cpp #19378): each device holds its shares of every
matrix, of the KV heads and of the head, by ratios the budgets allow; two sums a layer over host
memory. Checked against the NumPy engine on the stand-in, with every cross-queue wait shown
needed."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from cudarun.schedule import Compute, Record, Wait, validate
from cudarun.shards import cut_raw, share_bytes
from cudarun.standin import StandInDevice
from cudarun.standin_engine import FAST_DELAYS, StandInEngine
from cudarun.split_parts import SUMS
from refengine.agreement import agreement_along, reference_run
from refengine.engine import NumpyEngine
from refengine.errors import UserError
from refengine.models import resolve_model
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic
from refengine.tokenizer import Tokenizer
from refengine.weights import GGUFWeights
from solver.cost import Workload
from solver.groups import tensor_groups
from solver.profile import for_devices
from solver.shares import FF, FF_EXP, HEADS, VOCAB, cut_of, shares_for, units
from solver.solve import load_profile, solve, solve_plan
from solver.tensor_split import ALL_REDUCES_PER_LAYER, device_nbytes, refengine_split
from solver.tensor_split import share_nbytes_line, split_operations

N_CTX = 128
W = Workload(n_ctx=N_CTX, prompt_tokens=16, gen_tokens=8, threads=2)
pytestmark = pytest.mark.xdist_group("devices")


def split_plan(spec, fractions, tiers=(1, 8)):
    """Our runtime's tensor split over one device a budget: what a device taking part holds at
    least and a fraction of the rest of the model each (0: a device too small to take part)."""
    floor, scaling = share_nbytes_line(spec, W, max(tiers))
    budgets = [int(floor + f * scaling) if f else 0 for f in fractions]
    profile = for_devices(load_profile("h100"), len(budgets))
    return solve_plan(spec, profile, W, list(tiers), budgets, split_mode="tensor")


def test_shares_follow_the_ratios_in_whole_units():
    spec = load_spec(str(resolve_model("smollm2-135m")))
    assert units(spec) == {HEADS: (3, 3), FF: (48, 32), FF_EXP: (0, 1), VOCAB: (49152, 1)}
    s = shares_for(spec, [2.0, 1.0])
    assert s.heads == ((0, 6), (6, 9)) and s.ff == ((0, 1024), (1024, 1536))
    assert s.kv_heads(spec, 0) == (0, 2) and s.kv_heads(spec, 1) == (2, 3)
    assert shares_for(spec, [1.0, 0.0, 1.0]).devices == [0, 2]


@pytest.fixture(scope="module")
def models(small_models, tmp_path_factory):
    """The small models, and a MoE model whose experts' hidden rows are two blocks (the small
    qwen3moe's are one, which no cut divides)."""
    moe = SyntheticConfig("qwen3moe", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                          head_dim=16, n_vocab=300, qtype="Q8_0", n_expert=4, n_expert_used=2,
                          n_ff_exp=64)  # fmt: skip
    return small_models | {"moe": write_synthetic(tmp_path_factory.mktemp("moe") / "m.gguf", moe)}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "moe"])
def test_a_share_is_the_file_tensors_cut(models, arch):
    """Every device's bytes of every group, put back together along each cut, are the file's."""
    spec = load_spec(str(models[arch]))
    weights = GGUFWeights(spec)
    shares = shares_for(spec, [1.0, 2.0])
    for g in tensor_groups(spec):
        for name in g.tensors:
            info, raw = spec.by_name[name], weights.raw(name)
            cuts = [cut_of(spec, name, shares, d) for d in shares.devices]
            if cuts[0] is None:
                continue
            pieces = [cut_raw(raw, info, c) for c in cuts]
            axis = cuts[0].axis if cuts[0].axis < len(info.shape) - 1 else -1
            joined = np.concatenate(pieces, axis=axis)
            if ("attn_k." in name or "attn_v." in name) and spec.hparams.n_head_kv == 1:
                assert all(np.array_equal(p, raw) for p in pieces)  # the one KV head, on each
            else:
                assert np.array_equal(joined, raw), name
        for d in shares.devices:
            assert share_bytes(spec, g, shares, d, weights.raw).size > 0


def test_budgets_and_speeds_set_the_shares_and_a_small_device_is_left_out(small_models):
    spec = load_spec(str(small_models["llama"]))
    whole = device_nbytes(spec, W, 8, shares_for(spec, [1.0]), 0)
    even, _ = refengine_split(spec, W, 8, [whole, whole])
    assert even.ff == ((0, 64), (64, 128))
    budgets = [whole, int(0.7 * whole)]  # the second holds its workspace and less than half
    uneven, _ = refengine_split(spec, W, 8, budgets)
    assert uneven.fraction(VOCAB, 0) > uneven.fraction(VOCAB, 1) > 0
    assert all(device_nbytes(spec, W, 8, uneven, d) <= b for d, b in enumerate(budgets))
    faster, _ = refengine_split(spec, W, 8, [whole, whole], speeds=[3.0, 1.0])
    assert faster.ff == ((0, 96), (96, 128))  # a device three times as fast: three times the rows
    left, excluded = refengine_split(spec, W, 8, [whole, 1000, whole])
    assert left.devices == [0, 2] and excluded[1] > 0
    assert refengine_split(spec, W, 8, [whole // 3, whole // 3])[0] is None
    dropped = split_plan(spec, (0.45, 0.45))  # tier 8's workspace crowds the shares out
    assert list(dropped["tiers"]) == ["1"] and dropped["solver"]["dropped_tiers"] == [8]
    with pytest.raises(UserError, match="cannot hold .* split by tensors"):
        solve_plan(spec, for_devices(load_profile("h100"), 2), W, [1, 8], [whole // 5] * 2,
                   split_mode="tensor")  # fmt: skip
    with pytest.raises(UserError, match="a budget per device"):
        solve_plan(spec, load_profile("h100"), W, [1, 8], [whole], split_mode="tensor")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "moe"])
def test_tensor_split_agrees_with_numpy_on_the_stand_in(models, arch):
    """Two devices, unequal; three with the middle one left out (gemma3: its one KV head on both
    devices; moe: each expert's hidden rows cut, each device routing the tokens itself)."""
    spec = load_spec(str(models[arch]))
    reference = NumpyEngine(spec, n_ctx=N_CTX)
    prompt = list(range(3, 40))  # more than a ubatch: a tier switch, several ubatches
    run = reference_run(reference, prompt, 6)
    for fractions, used in (((0.7, 0.5), [0, 1]), ((0.6, 0, 0.6), [0, 2])):
        plan = split_plan(spec, fractions)
        engine = StandInEngine(spec, plan, seed=3, reference=reference.w)
        assert engine.shares.devices == used
        if arch == "moe":  # both devices run experts
            assert all(hi > lo for lo, hi in (engine.shares.ff_exp[d] for d in used))
        a = agreement_along(engine, prompt, run, engine.tolerance)
        assert engine.path == "fp32" and a.ok, a.summary()


def test_diff_of_a_tensor_split_names_the_device_left_out(small_models):
    """`refengine diff` over three budgets, the middle one too small: one line names it, and the
    other two meet the fp32 path's bounds."""
    from .conftest import refengine

    spec = load_spec(str(small_models["llama"]))
    floor, scaling = share_nbytes_line(spec, Workload(n_ctx=64, prompt_tokens=6, gen_tokens=3), 4)
    mib = lambda nbytes: f"{nbytes / 2**20:.4f}MiB"  # noqa: E731
    budgets = ",".join([mib(floor + scaling), mib(4096), mib(floor + 0.6 * scaling)])
    r = refengine("diff", small_models["llama"], "--tokens", "5,9,2,7,3,1", "-n", "3", "-c", "64",
                  "--tiers", "1,4", "--engine", "standin", "--budget", budgets, "--split-mode",
                  "tensor")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "split by tensors over 3 devices" in out and "meets its path's bounds" in out
    assert "GPU 1 excluded:" in out and "short of its workspace and a share of every layer" in out


@functools.lru_cache(maxsize=None)
def smollm2_split(fractions):
    spec = load_spec(str(resolve_model("smollm2-135m")))
    return spec, split_plan(spec, fractions, tiers=(1, 16))


def test_smollm2_split_over_two_unequal_devices_agrees_with_numpy():
    spec, plan = smollm2_split((0.7, 0.4))
    reference = NumpyEngine(spec, n_ctx=N_CTX)
    engine = StandInEngine(spec, plan, seed=4, reference=reference.w)
    assert engine.shares.fraction(FF, 0) > engine.shares.fraction(FF, 1) > 0
    prompt = Tokenizer.from_gguf(spec.path).encode("The engine splits every matrix over two GPUs.")
    a = agreement_along(engine, prompt, reference_run(reference, prompt, 6), engine.tolerance)
    assert a.ok, a.summary()


# one layer, a query head a whole quantized block, so that the heads, the FFN rows, each expert's
# rows and the vocabulary are all cut, at shapes the CUDA simulator runs in seconds
CUDA_TINY = {
    "gemma3": SyntheticConfig("gemma3", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                              head_dim=32, n_vocab=260, qtype="Q8_0", n_swa=3),
    "moe": SyntheticConfig("qwen3moe", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=2,
                           head_dim=32, n_vocab=260, qtype="Q8_0", n_expert=4, n_expert_used=2,
                           n_ff_exp=64),
}  # fmt: skip


@pytest.mark.parametrize("arch, fractions", [("gemma3", (0.6, 0, 0.6)), ("moe", (0.7, 0.5))])
def test_the_cuda_engine_runs_a_tensor_split_as_numpy_does(tmp_path, arch, fractions):
    """Under the simulator, virtual devices of one GPU (gemma3: three, the middle one left out,
    its one KV head on both others; moe: each device routing the tokens itself): logits within
    the plan's tolerance of the NumPy engine's across tier switches and a prompt longer than a
    ubatch, a layer's output recorded; the host waits only for the partial outputs and the
    logits' rows, and the devices' activations go through it only at the sums."""
    from cudarun.cuda_engine import CudaEngine
    from refengine.agreement import normwise

    spec = load_spec(str(write_synthetic(tmp_path / "m.gguf", CUDA_TINY[arch])))
    engine = CudaEngine(spec, split_plan(spec, fractions, tiers=(1, 4)))
    reference = NumpyEngine(spec, n_ctx=N_CTX)
    used = [d for d, f in enumerate(fractions) if f]
    assert engine.shares.devices == used and len(engine.arenas) == len(fractions)
    ranges = (engine.shares.heads, engine.shares.ff_exp if arch == "moe" else engine.shares.ff,
              engine.shares.vocab)  # fmt: skip
    assert all(r[d][1] > r[d][0] for r in ranges for d in used)  # every dimension is cut
    for call, arg in [("prefill", [5, 9, 2]), ("decode", 7), ("prefill", [3, 1, 4, 1, 5, 9])]:
        (got, acts), (want, ref_acts) = (getattr(e, call)(arg, record={"blk.0.out"})
                                         for e in (engine, reference))  # fmt: skip
        assert normwise(got, want) < engine.tolerance, (call, arg)
        assert normwise(acts["blk.0.out"], ref_acts["blk.0.out"]) < engine.tolerance
    for (t, n, _), (ubatches, counted) in engine.tally.rows.items():
        schedule = engine.tiers[t].schedule
        host_waits = sum(isinstance(op, Wait) and op.queue.on_host for op in schedule)
        # and one to read the recorded layer output
        assert counted.syncs == ubatches * (host_waits + 1), (t, n)
        # each device: the embedding's rows and every sum up
        ups = len(used) * (1 + ALL_REDUCES_PER_LAYER * spec.hparams.n_layer)
        assert counted.uploads == ubatches * ups, (t, n)


@pytest.mark.gpu
def test_smollm2_shaped_tensor_split_on_virtual_devices_of_the_gpu(tmp_path):
    """On a GPU: a SmolLM2-135M-shaped synthetic model (the GPU machine has no package index to
    fetch the real one from) over two unequal virtual devices, a prompt through the fp16 GEMM path
    (tier 64) and the decode through the matvec kernels, as `diff` judges it."""
    from cudarun.cuda_engine import CudaEngine
    from refengine.synthetic import preset

    spec = load_spec(str(write_synthetic(tmp_path / "smollm2.gguf", preset("smollm2-135m"))))
    reference = NumpyEngine(spec, n_ctx=N_CTX)
    engine = CudaEngine(spec, split_plan(spec, (0.7, 0.4), tiers=(1, 64)))
    assert engine.shares.devices == [0, 1]
    prompt = [int(t) for t in np.random.default_rng(0).integers(0, spec.hparams.n_vocab, 40)]
    a = agreement_along(engine, prompt, reference_run(reference, prompt, 6), engine.tolerance)
    assert engine.path == "int8" and a.ok, a.summary()  # the decode in integers


def test_every_cross_queue_wait_of_a_tensor_split_is_needed_on_five_seeds(small_models):
    """Each wait of one queue for another's event (a device for the host's sum, the host for a
    device's partial output), removed in turn: the validator names the read, and the stand-in
    device reports it on 5 seeds."""
    spec = load_spec(str(small_models["gemma3"]))
    engine = StandInEngine(spec, split_plan(spec, (0.4, 0.4, 0.4)))
    tier = engine.tiers[1]
    ops = tier.schedule
    recorded_on = {op.event: op.queue for op in ops if isinstance(op, Record)}
    crossing = [i for i, op in enumerate(ops)
                if isinstance(op, Wait) and recorded_on[op.event] != op.queue]  # fmt: skip
    n_layer = spec.hparams.n_layer
    assert len(crossing) == 3 * (1 + 2 * n_layer) + 3 * (2 * n_layer + 1)
    assert not validate(ops, tier.slots, {})
    for i in crossing:
        cut = ops[:i] + ops[i + 1 :]
        assert validate(cut, tier.slots, {}), ops[i]
        for seed in range(5):
            device = StandInDevice(tier.slots, {}, seed, **FAST_DELAYS)
            try:
                violations = device.execute(cut)
            finally:
                device.close()
            assert violations, f"removing op {i} ({ops[i]}) went unnoticed with seed {seed}"


def test_the_operations_of_a_tensor_split_are_the_cost_models(small_models):
    """Two sums a layer, and a hop per device at each hand-off: what the schedule issues is what
    the cost model prices (its latency is the counted hops at its hop price, the devices hopping
    at once, plus its launches)."""
    from solver.cost import ELEMENTWISE_KERNELS_PER_LAYER, CostModel
    from solver.tensor_split import hops_seconds, share_fractions, ubatch_terms

    spec = load_spec(str(small_models["qwen2"]))
    engine = StandInEngine(spec, split_plan(spec, (0.6, 0.5, 0.5)))
    n_devices, n_layer = len(engine.shares.devices), spec.hparams.n_layer
    assert split_operations(n_layer, n_devices).all_reduces == ALL_REDUCES_PER_LAYER * n_layer
    cm = CostModel(spec, for_devices(load_profile("h100"), 3), W, "refengine")
    for t, tier in engine.tiers.items():
        sums = [op for op in tier.schedule
                if isinstance(op, Compute) and op.name.endswith(SUMS)]  # fmt: skip
        assert len(sums) == tier.operations.all_reduces == ALL_REDUCES_PER_LAYER * n_layer
        priced = ubatch_terms(cm, share_fractions(engine.shares), t, 0, 1)
        launches = sum(cm.launch_seconds(ELEMENTWISE_KERNELS_PER_LAYER + len(cm.by_layer[il]), t)
                       for il in range(n_layer))  # fmt: skip
        hop = cm.hop_seconds(t, spec.hparams.n_embd)
        assert priced.latency == pytest.approx(
            hops_seconds(tier.operations, n_devices, hop) + launches
        ), t


def test_solve_weighs_our_tensor_split_against_the_layer_split(small_models):
    """Over several budgets, unless a split mode is named: the tensor split among the plans
    compared, and the chosen plan never slower than it."""
    spec = load_spec(str(small_models["llama"]))
    floor, scaling = share_nbytes_line(spec, W, 8)
    budgets = [floor + scaling] * 2
    chosen, baselines, _ = solve(spec, for_devices(load_profile("h100"), 2), W, [1, 8], budgets,
                                 time_limit_seconds=3)  # fmt: skip
    split = next(b for b in baselines if b.name == "tensor-split")
    assert split.shares is not None and split.target == "refengine"
    assert chosen.prediction.e2e_seconds <= split.prediction.e2e_seconds
