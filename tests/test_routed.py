"""Routed streaming (issue 21): an expert stack copied after its layer's router, only the experts
the router chose, into a ring slot the expert products read — against the NumPy engine on the
stand-in, with the bytes each copy moved counted and every wait it needs proved needed."""

import dataclasses

import numpy as np
import pytest

from cudarun import program
from cudarun.schedule import Signal, Wait, group_unit, pipeline_schedule, validate
from cudarun.standin_engine import StandInEngine
from refengine.agreement import normwise
from refengine.engine import NumpyEngine
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic
from solver.cost import PINNED, ROUTED, STREAMED, Loc, TierPlacement, Workload, evaluate
from solver.groups import EXPERTS, routed_nbytes, tensor_groups
from solver.plan import plan_json
from solver.solve import load_profile

N_CTX = 64
MOE = SyntheticConfig("qwen3moe", n_layer=2, n_embd=64, n_ff=128, n_head=4, n_head_kv=2,
                      head_dim=16, n_vocab=300, qtype="Q4_K", n_expert=64, n_expert_used=8,
                      n_ff_exp=32)  # fmt: skip


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return load_spec(str(write_synthetic(tmp_path_factory.mktemp("routed") / "m.gguf", MOE)))


def routed_plan(spec, tiers=(1, 16), attn=PINNED):
    """Every expert stack routed in every tier, the attention side `attn`, the rest pinned."""
    place = {}
    for g in tensor_groups(spec):
        place[g.name] = Loc(ROUTED if g.kind == EXPERTS else attn if g.kind == "attn" else PINNED)
    kv = {il: Loc(PINNED) for il in range(spec.hparams.n_layer)}
    placements = {t: TierPlacement(dict(place), dict(kv)) for t in tiers}
    w = Workload(n_ctx=N_CTX, prompt_tokens=8, gen_tokens=8, threads=2)
    prof = load_profile("h100")
    return plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], placements,
                     evaluate(placements, spec, prof, w), "test", "refengine")  # fmt: skip


@pytest.mark.parametrize("attn", [PINNED, STREAMED])
def test_routed_streaming_agrees_with_numpy_and_copies_only_the_chosen_experts(moe, attn):
    reference = NumpyEngine(moe, n_ctx=N_CTX)
    # with the reference's weights, every expert product checks it was handed that expert's bytes
    engine = StandInEngine(moe, routed_plan(moe, attn=attn), seed=5, reference=reference.w)
    prompt = np.random.default_rng(2).integers(0, moe.hparams.n_vocab, 12)
    ours, want = engine.prefill(prompt), reference.prefill(prompt)
    assert normwise(ours, want) <= engine.tolerance
    whole = sum(g.nbytes for g in tensor_groups(moe) if g.kind == EXPERTS)
    assert 0 < engine.expert_copied_nbytes < whole  # 12 tokens x 8 of 64 experts leave some out
    groups = [g for g in tensor_groups(moe) if g.kind == EXPERTS]
    slice_nbytes = {g.name: routed_nbytes(moe, g, 1) for g in groups}
    for _ in range(6):  # greedy: the same token every step
        token = int(np.argmax(want))
        before = engine.expert_copied_nbytes
        ours, want = engine.decode(token), reference.decode(token)
        assert int(np.argmax(ours)) == int(np.argmax(want))
        assert normwise(ours, want) <= engine.tolerance
        # one token routes to k distinct experts: k slices of each stack, never the whole stack
        k = moe.hparams.n_expert_used
        assert engine.expert_copied_nbytes - before == k * sum(slice_nbytes.values())


def test_every_wait_of_a_routed_copy_is_needed(moe):
    """The copy of a routed stack waits for its router (it reads the router's choice): removed,
    the validator names the read."""
    plan = routed_plan(moe)
    engine = StandInEngine(moe, plan)
    parts = engine.tiers[1].parts
    steps = [p.step for p in parts]
    assert any(s.routed_by for s in steps)
    ops = pipeline_schedule(steps, engine.n_slots)
    slots, sizes = engine.tiers[1].slots, engine.unit_nbytes(engine.tiers[1])
    assert validate(ops, slots, sizes) == []
    routed_waits = [i for i, op in enumerate(ops)
                    if isinstance(op, Wait) and op.event.signal is Signal.ROUTED]  # fmt: skip
    assert len(routed_waits) == moe.hparams.n_layer
    for i in routed_waits:
        errors = validate(ops[:i] + ops[i + 1 :], slots, sizes)
        assert any("ids@" in e and "before its write" in e for e in errors), errors


def test_a_routed_slot_holds_the_most_experts_a_ubatch_can_route_to(moe):
    engine = StandInEngine(moe, routed_plan(moe))
    g = next(g for g in tensor_groups(moe) if g.kind == EXPERTS)
    slot = next(iter(engine.tiers[1].slots.values())).nbytes
    assert routed_nbytes(moe, g, 8) <= slot < g.nbytes  # a decode token: k = 8 of 64
    # 16 x 8 can reach all 64
    assert engine.unit_nbytes(engine.tiers[16])[group_unit(g.name)] == g.nbytes
    assert program.routed_experts(np.array([[3, 1], [1, 7]])) == [1, 3, 7]
    assert dataclasses.replace(engine.tiers[1].parts[0]).routed_by == ""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """As small as the simulator needs: one layer, 8 experts of which a token uses 2."""
    config = dataclasses.replace(MOE, n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_vocab=260,
                                 n_expert=8, n_expert_used=2)  # fmt: skip
    return load_spec(str(write_synthetic(tmp_path_factory.mktemp("tiny") / "m.gguf", config)))


@pytest.mark.parametrize("attn", [PINNED, "cpu"], ids=["router-on-device", "router-on-cpu"])
def test_the_cuda_engine_streams_routed_experts_as_numpy_does(tiny, attn):
    """The same plan in the CUDA engine (the simulator in CI): the router's choice read back, the
    runs of chosen experts copied into the slot, the expert kernels reading them at their places
    in it."""
    from cudarun.cuda_engine import CudaEngine

    plan = routed_plan(tiny, tiers=(1, 4), attn=attn)
    engine, reference = CudaEngine(tiny, plan), NumpyEngine(tiny, n_ctx=N_CTX)
    prompt = [5, 9, 2]
    assert normwise(engine.prefill(prompt), reference.prefill(prompt)) <= engine.tolerance
    groups = [g for g in tensor_groups(tiny) if g.kind == EXPERTS]
    k = tiny.hparams.n_expert_used  # a decode token's k experts of each stack
    prefill_nbytes = engine.expert_copied_nbytes
    assert normwise(engine.decode(3), reference.decode(3)) <= engine.tolerance
    decode_nbytes = engine.expert_copied_nbytes - prefill_nbytes
    assert decode_nbytes == k * sum(routed_nbytes(tiny, g, 1) for g in groups)


def test_the_optimizer_routes_expert_stacks_where_that_is_cheapest():
    """Qwen3-30B-A3B on an H100 with 8 GiB and two CPU threads: a decode token's 8 of 128 experts
    copied after the router cost less than the CPU's products or the whole stacks, so tier 1
    routes the stacks it does not pin; a 512-token ubatch touches every expert and streams them
    whole, overlapped."""
    from refengine.models import load_model_or_shape
    from solver.solve import solve_plan

    spec = load_model_or_shape("qwen3moe-30b-a3b")
    w = Workload(n_ctx=4096, prompt_tokens=3896, gen_tokens=200, threads=2)
    plan = solve_plan(spec, load_profile("h100"), w, [1, 512], [8 << 30])
    kinds = {t: {v.split(":")[0] for v in plan["tiers"][t]["tensors"].values()} for t in ("1", "512")}
    assert "routed" in kinds["1"] and "routed" not in kinds["512"], kinds
    routed = [n for n, v in plan["tiers"]["1"]["tensors"].items() if v.startswith("routed")]
    assert routed and all("_exps" in n for n in routed)


def test_bench_prints_expert_bytes_per_token_beside_the_cost_models(moe, tmp_path):
    """A decode token routes to k distinct experts: the bytes the engine counts are the cost
    model's to the byte; a prompt's ubatch is priced at uniform routing (E (1 - (1 - k/E)^M)
    experts), which a real router need not follow."""
    import json

    from .conftest import refengine

    path = tmp_path / "plan.json"
    path.write_text(json.dumps(routed_plan(moe, tiers=(1, 16))))
    r = refengine("bench", moe.path, "--engine", "standin", "--plan", path, "-p", "16", "-n", "4",
                  "-c", str(N_CTX))  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "expert" in r.stdout
    rows = {line.split("│")[1].strip(): line.split("│")[-3:-1] for line in r.stdout.splitlines()
            if line.startswith("│") and "@ d0" in line}  # fmt: skip
    counted, predicted = (float(x) for x in rows["tg4 @ d0"])
    assert counted == predicted > 0
    counted, predicted = (float(x) for x in rows["pp16 @ d0"])
    assert 0 < counted <= predicted * 1.05
