"""The expert cache (issue 21, items 3 and 4): a routed layer's experts kept resident across
ubatches, filled with the misses its router chose or, with prefetch, with what the router is
predicted to choose from the layer's input — greedy identical to the NumPy engine on the
stand-in and (under the simulator) in the CUDA engine, `profile-routing`'s replay copying what the
engine copies, every new wait needed, and the planner sizing the cache from the budget.

Out of sample (issue 33): on a model with planted routing skew, the bytes a decode token copies
predicted by the cost model from one prompt set's profile, held against the bytes the engine
counts on other prompts of the same domain (scripts/expert_cache_oos.py prints the full table)."""

import collections
import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cudarun.expert_cache import ExpertCache
from cudarun.schedule import Signal, Wait, pipeline_schedule, validate
from cudarun.standin_engine import StandInEngine
from refengine.agreement import normwise
from refengine.engine import NumpyEngine
from cudarun.routing_profile import profile_routing
from refengine.spec import load_spec
from refengine.synthetic import domain_experts, domain_tokens, write_synthetic
from solver.cost import PINNED, ROUTED, STREAMED, CostModel, Loc, TierPlacement, Workload, evaluate
from solver.groups import EXPERTS, tensor_groups
from solver.plan import plan_json
from solver.routing import RoutingStats
from solver.solve import load_profile

from .conftest import refengine
from .test_routed import MOE

N_CTX, PROMPT, DECODE = 96, 12, 40


@given(
    slots=st.integers(0, 12),
    ubatches=st.lists(st.sets(st.integers(0, 15), min_size=1, max_size=10), max_size=30),
)
@settings(max_examples=200, deadline=None)
def test_the_cache_places_every_chosen_expert_once_and_evicts_the_least_recently_used(slots,
                                                                                       ubatches):  # fmt: skip
    cache, last_used = ExpertCache(slots), {}
    for clock, chosen in enumerate(ubatches):
        before = dict(cache.where)
        got = cache.admit(sorted(chosen))
        assert set(got.resident) | set(got.overflow) == chosen
        assert not set(got.resident) & set(got.overflow)
        assert all(before.get(e) == s for e, s in got.resident.items() if e not in got.inserted)
        assert not set(got.inserted) & set(before)  # a hit is never copied again
        assert len(set(cache.where.values())) == len(cache.where) <= slots
        if got.overflow:  # only when every slot holds an expert this ubatch chose
            assert len(got.resident) == slots
        evicted = set(before) - set(cache.where)
        kept = set(before) & set(cache.where) - chosen
        # whatever went out was used no later than whatever stayed without being chosen
        assert all(last_used[e] <= last_used[f] for e in evicted for f in kept)
        places = sorted(got.place(e, slots) for e in chosen)
        assert places == sorted(set(places))  # one place each
        last_used.update({e: clock for e in got.resident})


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return load_spec(str(write_synthetic(tmp_path_factory.mktemp("cache") / "m.gguf", MOE)))


@pytest.fixture(scope="module")
def prompt(moe):
    return [int(t) for t in np.random.default_rng(2).integers(0, moe.hparams.n_vocab, PROMPT)]


@pytest.fixture(scope="module")
def routing(moe, prompt):
    """The routing of the prompt and its DECODE greedy tokens, measured and replayed."""
    return profile_routing(moe, [prompt], DECODE)


def cache_plan(spec, slots: int, prefetch: bool = False, routing=None):
    """Tier 16 (the prompt) streams the expert stacks whole, tier 1 routes them with an expert
    cache of `slots` (the runtime's caches start empty at the switch, as the replay's do)."""
    kv = {il: Loc(PINNED) for il in range(spec.hparams.n_layer)}
    placements = {}
    for t in (1, 16):
        routed = Loc(ROUTED, 0, slots, prefetch) if t == 1 else Loc(STREAMED)
        place = {g.name: routed if g.kind == EXPERTS else Loc(PINNED) for g in tensor_groups(spec)}
        placements[t] = TierPlacement(place, dict(kv))
    w = Workload(n_ctx=N_CTX, prompt_tokens=PROMPT, gen_tokens=DECODE, threads=2, routing=routing)
    prof = load_profile("h100")
    plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], placements,
                     evaluate(placements, spec, prof, w), "test", "refengine")  # fmt: skip
    return plan, CostModel(spec, prof, w).expert_copy_nbytes(placements[1], 1)


K = MOE.n_expert_used
CACHES = [(0, False), (K, False), (2 * K, False), (MOE.n_expert // 2, False), (2 * K, True),
          (MOE.n_expert // 2, True)]  # fmt: skip


@pytest.mark.parametrize("slots,prefetch", CACHES, ids=[f"{c}{'p' * p}" for c, p in CACHES])
def test_a_cached_plan_decodes_as_numpy_does_and_copies_what_the_replay_copies(
    moe, prompt, routing, slots, prefetch
):
    """E = 64, k = 8: greedy identical with the NumPy engine's weights checked in every expert
    product. On the profiled prompt itself the bytes the engine counts equal the cost model's
    price of the replay (within 1%: the stand-in computes the prefetch's prediction in fp32
    without the NumPy engine's rounding) — a check that the replay is the runtime's cache, not
    of the prediction, which is equal here by construction: `test_a_profile_prices_the_cache_
    on_other_prompts_of_its_domain` holds the prediction against prompts it never saw."""
    reference = NumpyEngine(moe, n_ctx=N_CTX)
    plan, predicted = cache_plan(moe, slots, prefetch, routing)
    engine = StandInEngine(moe, plan, seed=slots, reference=reference.w)
    ours, want = engine.prefill(prompt), reference.prefill(prompt)
    before = engine.expert_copied_nbytes
    for _ in range(DECODE):
        token = int(np.argmax(want))
        assert int(np.argmax(ours)) == token
        ours, want = engine.decode(token), reference.decode(token)
        assert normwise(ours, want) <= engine.tolerance
    counted = (engine.expert_copied_nbytes - before) / DECODE
    assert abs(counted / predicted - 1) <= 0.01, (counted, predicted)
    hits = engine.expert_lookups
    assert hits["chosen"] == (DECODE * K * moe.hparams.n_layer if slots else 0)
    assert (hits["resident"] > 0) == (slots > 0) and (hits["predicted"] > 0) == prefetch


def test_a_wider_model_decodes_as_numpy_does_with_the_cache_and_prefetch(tmp_path):
    """E = 128, k = 8, with prefetch into a cache of 2k."""
    config = dataclasses.replace(MOE, n_expert=128, n_layer=1)
    spec = load_spec(str(write_synthetic(tmp_path / "m.gguf", config)))
    reference = NumpyEngine(spec, n_ctx=N_CTX)
    plan, _ = cache_plan(spec, 2 * K, True, RoutingStats(128, K, 1, (0, 128), (1.0, 0.0),
                                                         (0.0, 0.0), (1.0, 0.0), 0.5))  # fmt: skip
    engine = StandInEngine(spec, plan, seed=1, reference=reference.w)
    prompt = [3, 141, 59, 26, 5]
    ours, want = engine.prefill(prompt), reference.prefill(prompt)
    for _ in range(12):
        token = int(np.argmax(want))
        assert int(np.argmax(ours)) == token
        ours, want = engine.decode(token), reference.decode(token)
        assert normwise(ours, want) <= engine.tolerance
    assert 0 < engine.expert_lookups["predicted"] < engine.expert_lookups["chosen"]


def test_every_wait_of_a_prefetch_and_of_a_cached_copy_is_needed(moe, routing):
    """A prefetch waits for the prediction (it reads it), a cached copy for its router, the
    expert products for the cache's copies: each removed, the validator names the read."""
    plan, _ = cache_plan(moe, 2 * K, True, routing)
    tier = StandInEngine(moe, plan).tiers[1]
    ops = pipeline_schedule([p.step for p in tier.parts], 2)
    sizes = StandInEngine(moe, plan).unit_nbytes(tier)
    assert validate(ops, tier.slots, sizes) == []
    needed = [i for i, op in enumerate(ops) if isinstance(op, Wait)
              and op.event.signal in (Signal.PREDICTED, Signal.ROUTED, Signal.LOADED)]  # fmt: skip
    kinds = collections.Counter(ops[i].event.signal.value for i in needed)
    assert kinds["predicted"] == kinds["routed"] == moe.hparams.n_layer
    for i in needed:
        errors = validate(ops[:i] + ops[i + 1 :], tier.slots, sizes)
        assert any("before its write" in e for e in errors), (ops[i], errors)


def test_the_cuda_engine_reads_experts_from_the_cache_and_the_copy(tmp_path):
    """The simulator at tiny shapes: 8 experts, 2 a token, a cache of 1 with prefetch, so each
    decode token's expert kernels read one expert from the routed copy and the other from the
    cache when the prediction named it (each at its place)."""
    from cudarun import counts
    from cudarun.cuda_engine import CudaEngine

    config = dataclasses.replace(MOE, n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_vocab=260,
                                 n_expert=8, n_expert_used=2)  # fmt: skip
    spec = load_spec(str(write_synthetic(tmp_path / "m.gguf", config)))
    stats = RoutingStats(8, 2, 1, (0, 8), (1.0, 0.0), (0.0, 0.0), (1.0, 0.0), 0.5)
    plan, _ = cache_plan(spec, 1, True, stats)
    engine, reference = CudaEngine(spec, plan), NumpyEngine(spec, n_ctx=N_CTX)
    # three tokens take the decode kernels: the int8 path
    assert normwise(engine.prefill([5, 9, 2]), reference.prefill([5, 9, 2])) <= engine.tolerance
    for token in (3, 7):
        assert normwise(engine.decode(token), reference.decode(token)) <= engine.tolerance
    hits = engine.expert_lookups
    assert 0 < hits["resident"] <= hits["chosen"] // 2 and hits["predicted"] > 0
    for (t, n, graph), (ubatches, total) in engine.tally.rows.items():
        # the prediction's launches and each readback's sync, as the schedule counts them
        want, _ = counts._expected(engine, engine.tiers[t], n, graph)
        assert (total.launches, total.syncs) == (ubatches * want.launches,
                                                 ubatches * want.syncs), (t, n)  # fmt: skip


def test_the_planner_gives_routed_layers_a_cache_where_routing_repeats_itself():
    """Qwen3-30B-A3B on the H100 profile at 8 GiB: under uniform routing a cache saves a k/E
    share of the copies, so the planner keeps most routed layers without one; with routing that
    repeats itself (a measured curve missing 3x fewer than uniform), every routed layer gets one
    and the predicted decode rate rises."""
    from refengine.models import load_model_or_shape
    from solver.solve import solve_plan

    spec = load_model_or_shape("qwen3moe-30b-a3b")
    slots = (0, 8, 16, 32, 64, 96, 128)
    miss = tuple(max(0.05, 1 - 3 * c / 128) for c in slots)
    skewed = RoutingStats(128, 8, 1000, slots, miss, (0.0,) * 7, miss, 0.5)
    tps, caches = {}, {}
    for name, routing in (("uniform", None), ("skewed", skewed)):
        w = Workload(n_ctx=4096, prompt_tokens=3896, gen_tokens=200, threads=2, routing=routing)
        plan = solve_plan(spec, load_profile("h100"), w, [1, 512], [8 << 30])
        tps[name] = plan["prediction"]["tps"]
        routed = [Loc.parse(v) for v in plan["tiers"]["1"]["tensors"].values()
                  if v.startswith(ROUTED)]  # fmt: skip
        caches[name] = sum(loc.cache > 0 for loc in routed) / len(routed)
    assert caches["uniform"] < 0.5 < caches["skewed"] == 1.0, caches
    assert tps["skewed"] > 1.5 * tps["uniform"], tps


def test_profile_routing_writes_what_solve_reads(moe, tmp_path):
    """The command measures, prints the replay's table and writes the profile; `solve --routing`
    puts it in the plan (and its digest in the fingerprint); mistakes get one line."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("3,14,15,92,65\n35,89,79,32\n")
    out = tmp_path / "routing.json"
    r = refengine("profile-routing", moe.path, "-p", prompts, "--ids", "-n", 8, "-o", out)
    assert r.returncode == 0, r.stderr
    assert "missed" in r.stdout and "predicted from the layer's input" in r.stdout
    saved = json.loads(out.read_text())
    assert saved["model"] == moe.name and saved["tokens"] == 16
    assert saved["miss"][0] == 1.0 and all(a >= b for a, b in zip(saved["miss"], saved["miss"][1:]))
    plan = tmp_path / "plan.json"
    solve = ("solve", moe.path, "--profile", "h100", "--budget", "0.9MiB", "--ctx", 128,
             "--gen-tokens", 8)  # fmt: skip
    r = refengine(*solve, "--tiers", "1,16", "--routing", out, "--expert-cache", 16, "-o", plan)
    assert r.returncode == 0, r.stderr
    doc = json.loads(plan.read_text())
    assert doc["routing"]["miss"] == saved["miss"] and "routing" in doc["fingerprint"]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for args, says in (
        (["--routing", str(bad)], "not a routing profile"),
        (["--expert-cache", "lots"], "--expert-cache lots"),
        (["--expert-cache", "16p"], "needs the routing measured"),
    ):
        r = refengine(*solve, *args)
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


# -- out of sample (issue 33): a profile of one prompt set pricing the cache on another ----------

# E = 64, k = 8, 2 layers, with planted routing skew: 4 domains of 75 token ids, each preferring
# its own 16 experts in every layer (refengine/synthetic.py, routing_domains)
PLANTED = dataclasses.replace(MOE, routing_domains=4)
N_PROMPTS = 3  # prompts a set: A (profiled), A' (same domain, other prompts), B (another domain)
OOS_CACHES = [(0, False), (8, False), (16, False), (32, False), (8, True), (16, True),
              (32, True)]  # 0, E/8, E/4, E/2 slots, with and without prefetch  # fmt: skip


def domain_prompts(cfg, domain: int, n: int, seed: int) -> list[list[int]]:
    """n prompts of PROMPT token ids drawn from planted `domain`'s range (the control tokens
    aside: a BOS or EOS mid-prompt is no text)."""
    ids, rng = domain_tokens(cfg, domain), np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(max(2, ids.start), ids.stop, PROMPT)] for _ in range(n)]


def counted_nbytes(spec, prompts, slots: int, prefetch: bool, routing) -> float:
    """Expert bytes a decode token copies, counted by the stand-in engine over DECODE greedy
    tokens after each prompt (the caches empty at each prompt's first decode token, as at the
    runtime's tier switch and in `profile-routing`'s replay)."""
    engine = StandInEngine(spec, cache_plan(spec, slots, prefetch, routing)[0], seed=slots)
    copied_nbytes = 0
    for prompt in prompts:
        engine.reset()
        logits = engine.prefill(prompt)
        before = engine.expert_copied_nbytes
        for _ in range(DECODE):
            logits = engine.decode(int(np.argmax(logits)))
        copied_nbytes += engine.expert_copied_nbytes - before
    return copied_nbytes / (DECODE * len(prompts))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    return load_spec(str(write_synthetic(tmp_path_factory.mktemp("planted") / "m.gguf", PLANTED)))


@pytest.fixture(scope="module")
def prompt_sets():
    """A and A' (other prompts, same domain 0) and B (domain 1), N_PROMPTS each."""
    a, a2 = domain_prompts(PLANTED, 0, N_PROMPTS, seed=1), domain_prompts(PLANTED, 0, N_PROMPTS, 2)
    assert not {tuple(p) for p in a} & {tuple(p) for p in a2}
    return {"A": a, "A'": a2, "B": domain_prompts(PLANTED, 1, N_PROMPTS, seed=3)}


@pytest.fixture(scope="module")
def profile_a(planted, prompt_sets):
    """What `refengine profile-routing` measures on A (the function it calls)."""
    return profile_routing(planted, prompt_sets["A"], DECODE)


# The worst |predicted / counted - 1| measured over OOS_CACHES on A' was 0.234 (16 slots: A's
# profile 9.0 KiB a token, A' counted 11.8 KiB), with 0.193 at 16 with prefetch, 0.169 at 8; 20%
# margin on it. Other prompt sets of the same size stray as far (seeds 4/5: worst 0.104, 6/7:
# 0.130): three prompts of 40 tokens carry ~20% sampling error. Priced from B's profile instead,
# 16 with prefetch is 0.575 off; under uniform routing 8 slots is 1.4 off, 16 is 5.5 off.
OOS_BOUND = 0.28


@pytest.mark.parametrize("slots,prefetch", OOS_CACHES[1:],
                         ids=[f"{c}{'p' * p}" for c, p in OOS_CACHES[1:]])  # fmt: skip
def test_a_profile_prices_the_cache_on_other_prompts_of_its_domain(planted, prompt_sets, profile_a,
                                                                   slots, prefetch):  # fmt: skip
    """The cost model's bytes a decode token copies, priced from A's routing profile exactly as
    `solve --routing` prices it, within OOS_BOUND of what the stand-in engine counts on A' — the
    same domain's routing, prompts the profile never saw. (0 slots copies k experts whatever
    the routing: left out.)"""
    predicted = cache_plan(planted, slots, prefetch, profile_a)[1]
    counted = counted_nbytes(planted, prompt_sets["A'"], slots, prefetch, profile_a)
    assert abs(predicted / counted - 1) <= OOS_BOUND, (predicted, counted)


def test_the_planted_skew_routes_each_domain_to_its_experts(planted, prompt_sets, profile_a):
    """Each layer's router sends a domain's tokens mostly to that domain's 16 of 64 experts
    (measured: A on domain 0's 93% and 82% in layers 0 and 1, B on domain 1's 84% and 68%;
    without the skew 25%), the generation stays in its domain, and the logits are finite and
    not degenerate (measured: 7-24 distinct greedy tokens in 40 per prompt of A' and B). The planted
    file keeps the other tensors of the file without skew, byte for byte."""
    from gguf import GGUFReader

    profile_b = profile_routing(planted, prompt_sets["B"], DECODE)
    for domain, stats in ((0, profile_a), (1, profile_b)):
        share = np.array(stats.frequency)[:, domain_experts(PLANTED, domain)].sum(axis=1)
        assert (share >= 0.5).all(), (domain, share)
    reference = NumpyEngine(planted, n_ctx=N_CTX)
    for domain in (0, 1):
        ids = domain_tokens(PLANTED, domain)
        for prompt in prompt_sets["A'" if domain == 0 else "B"]:
            reference.reset()
            logits, tokens = reference.prefill(prompt), []
            for _ in range(DECODE):
                assert np.isfinite(logits).all() and np.ptp(logits) > 1.0
                tokens.append(int(np.argmax(logits)))
                logits = reference.decode(tokens[-1])
            assert np.mean([t in ids for t in tokens]) >= 0.9, tokens
            assert len(set(tokens)) >= 5, tokens
    plain = GGUFReader(write_synthetic(planted.path.with_name("plain.gguf"), MOE)).tensors
    skewed = {t.name: t for t in GGUFReader(planted.path).tensors}
    changed = {t.name for t in plain if not np.array_equal(t.data, skewed[t.name].data)}
    touched = ("token_embd.weight", "output.weight", "ffn_gate_inp.weight", "attn_output.weight",
               "ffn_down_exps.weight")  # fmt: skip
    assert changed and all(n.endswith(touched) for n in changed), changed
