"""The CUDA engine — streams, events, the arena, the Numba kernels of every part — against the
NumPy engine: under the CUDA simulator at tiny shapes in CI (every part on the device in one tier
or the other, pinned and streamed weights and KV, CPU parts between device parts, a tier switch
each way), on the GPU with the same code."""

import numpy as np
import pytest

from cudarun.cuda_engine import CudaEngine
from refengine.agreement import normwise
from refengine.engine import NumpyEngine
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic
from solver.cost import CPU, PINNED, STREAMED, Loc, TierPlacement, Workload, evaluate
from solver.groups import tensor_groups
from solver.plan import plan_json
from solver.solve import load_profile

N_CTX = 16
TINY = {  # one layer each, the smallest vocabulary the synthetic writer makes
    "gemma3": SyntheticConfig("gemma3", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                              head_dim=16, n_vocab=260, qtype="Q8_0", n_swa=3),
    "qwen3moe": SyntheticConfig("qwen3moe", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                                head_dim=16, n_vocab=260, qtype="Q4_K", n_expert=4,
                                n_expert_used=2, n_ff_exp=32),
}  # fmt: skip


def placements(spec):
    """Tier 1: the attention side pinned, the FFN streamed, the KV pinned, embedding and head on
    the CPU. Tier 4: the attention side streamed with its KV, the first FFN matrix on the CPU,
    the others pinned, embedding and head on the device."""
    groups = tensor_groups(spec)
    ffn = [g.name for g in groups if g.layer == 0 and g.kind != "attn"]
    one = {g.name: Loc(STREAMED) for g in groups}
    one.update({"blk.0.attn": Loc(PINNED), "token_embd": Loc(CPU), "output": Loc(CPU)})
    four = {g.name: Loc(PINNED) for g in groups}
    four.update({"blk.0.attn": Loc(STREAMED), ffn[0]: Loc(CPU)})
    return {1: TierPlacement(one, {0: Loc(PINNED)}), 4: TierPlacement(four, {0: Loc(STREAMED)})}


@pytest.fixture(scope="module", params=sorted(TINY))
def tiny(request, tmp_path_factory):
    path = write_synthetic(tmp_path_factory.mktemp("tiny") / "m.gguf", TINY[request.param])
    spec = load_spec(str(path))
    w = Workload(n_ctx=N_CTX, prompt_tokens=4, gen_tokens=4, threads=2)
    tiers = placements(spec)
    prof = load_profile("h100")
    budget = 3 * spec.weights_nbytes + (8 << 20)
    plan = plan_json(spec, w, prof.name, [budget], tiers, evaluate(tiers, spec, prof, w),
                     "test", "refengine")  # fmt: skip
    return spec, plan


def test_the_cuda_engine_agrees_with_numpy_across_tier_switches(tiny):
    spec, plan = tiny
    engine = CudaEngine(spec, plan)
    engine.trace_events = []
    reference = NumpyEngine(spec, n_ctx=N_CTX)
    # tiers 4 -> 1 -> 4 -> 1: a prompt longer than the largest tier, whose first ubatch (the head
    # on the device) wants no logits
    steps = [("prefill", [5, 9, 2]), ("decode", 7), ("prefill", [3, 1, 4, 1, 5])]
    for call, arg in steps:
        record = {"blk.0.out"}
        if call == "prefill":
            (ours, acts), (want, ref_acts) = (
                e.prefill(arg, record=record) for e in (engine, reference)
            )
        else:
            (ours, acts), (want, ref_acts) = (
                e.decode(arg, record=record) for e in (engine, reference)
            )
        err = normwise(ours, want)
        assert err <= engine.tolerance, f"{call} {arg}: {err:.2e}"
        assert (
            np.abs(acts["blk.0.out"] - ref_acts["blk.0.out"]).max()
            <= 5e-2 * np.abs(ref_acts["blk.0.out"]).max()
        )
    assert engine.n_past == reference.n_past == 9
    lanes = {lane for lane, *_ in engine.trace_events}  # `--trace` on the CUDA engine
    assert lanes == {"copy", "compute", "cpu"}
    assert all(end >= start for *_, start, end in engine.trace_events)
    engine.close()  # a benchmark's next engine, or llama.cpp, runs on what it held
    assert engine.devices is None and not engine.pinned


def test_a_prompt_of_one_token_ubatches_returns_its_last_tokens_logits(tiny):
    """A plan whose largest tier is 1 token with the head on the CPU: a prompt runs as a ubatch a
    token, and only the last wants logits (the GPU's SmolLM2-shaped cpu-placed plan returned its
    first token's logits: the CPU segments computed a row for every ubatch)."""
    spec, _ = tiny
    w = Workload(n_ctx=N_CTX, prompt_tokens=4, gen_tokens=4, threads=2)
    tiers, prof = {1: placements(spec)[1]}, load_profile("h100")
    plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], tiers,
                     evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip
    engine, reference = CudaEngine(spec, plan), NumpyEngine(spec, n_ctx=N_CTX)
    prompt = [5, 9, 2, 7]
    err = normwise(engine.prefill(prompt), reference.prefill(prompt))
    assert err <= engine.tolerance, f"{err:.2e}"
    engine.close()


def tiers_1_and_64(spec, prompt_tokens: int) -> dict:
    """A plan of `placements`' two tiers as 1 and 64 tokens, over 64 cells."""
    w = Workload(n_ctx=64, prompt_tokens=prompt_tokens, gen_tokens=4, threads=2)
    tiers = {t: p for t, p in zip((1, 64), placements(spec).values())}
    prof = load_profile("h100")
    return plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], tiers,
                     evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip


def test_a_short_prompt_on_a_prefill_tier_takes_the_decode_kernels(tiny):
    """Tiers 1 and 64: a prompt of 8 tokens runs at tier 64 but through the matvec and split-KV
    decode kernels, whose partials that tier's workspace must hold (on the H200 an 8-token
    prompt at tiers 1 and 512 raised KeyError 'partial')."""
    spec, _ = tiny
    engine, reference = CudaEngine(spec, tiers_1_and_64(spec, 8)), NumpyEngine(spec, n_ctx=64)
    ids = [5, 9, 2, 7, 1, 3, 8, 4]
    err = normwise(engine.prefill(ids), reference.prefill(ids))
    assert err <= engine.tolerance, f"{err:.2e}"
    engine.close()


def test_a_plan_whose_workspace_is_too_small_says_solve_again(tiny):
    """A plan saved by an earlier runtime whose layout needed less workspace: one line, not an
    assertion deep in the engine."""
    from cudarun.plan_check import PlanError

    spec, _ = tiny
    plan = tiers_1_and_64(spec, 8)
    regions = plan["tiers"]["64"]["memory_map"]["0"]
    workspace = next(r for r in regions if r[0] == "workspace")
    workspace[2] //= 2
    engine = CudaEngine(spec, plan)
    with pytest.raises(PlanError, match="workspace on device 0 where this runtime needs .* solve"):
        engine.prefill([5, 9, 2, 7, 1, 3, 8, 4])
    engine.close()


@pytest.mark.gpu
def test_prefill_beyond_the_matvec_tokens_runs_the_fp16_gemm_path(tiny):
    """A 40-token prompt at tier 64: the products go through fp16 panels and cuBLAS, attention
    through the prefill kernel (GPU only: the GEMM is CuPy's cuBLAS); the warm-up compiled every
    kernel the prompt and the decode run."""
    spec, _ = tiny
    engine, reference = CudaEngine(spec, tiers_1_and_64(spec, 40)), NumpyEngine(spec, n_ctx=64)
    engine.warm_up()
    compiled = compiled_kernels()
    ids = list(np.random.default_rng(2).integers(0, spec.hparams.n_vocab, 40))
    for call in (lambda e: e.prefill(ids), lambda e: e.decode(5)):
        ours, want = call(engine), call(reference)
        assert np.abs(ours - want).max() <= 5e-2 * np.abs(want).max()
    assert compiled_kernels() == compiled
    # close gives every arena back at once (what stays is cuBLAS's and the kernels' code)
    from cudarun import driver

    used = engine.free_at_start - driver.mem_info()[0]
    outside = used - sum(a.nbytes for a in engine.arenas)
    engine.close()
    assert engine.free_at_start - driver.mem_info()[0] <= outside + (1 << 20)


def compiled_kernels() -> int:
    """Specializations compiled so far by every kernel of cudarun.kernels."""
    import importlib
    import pkgutil

    import cudarun.kernels

    n = 0
    for m in pkgutil.iter_modules(cudarun.kernels.__path__):
        module = importlib.import_module(f"cudarun.kernels.{m.name}")
        n += sum(len(getattr(k, "overloads", None) or {}) for k in vars(module).values())
    return n


def test_the_cuda_engine_runs_several_sequences_as_numpy_does(tiny):
    """Two sequences through the same tier switches: prompts of different lengths in one call,
    a decode step of both, the second removed and its cells taken by a third (tier 4: both
    sequences' keys in one kernel, each masked to its own; tier 1: the head's rows of each).
    gemma3 keeps one cache for both (unified: its sliding-window layers too), qwen3moe a stream
    each (its experts routed per sequence's tokens)."""
    spec, _ = tiny
    unified = spec.arch.name == "gemma3"
    w = Workload(n_ctx=N_CTX, prompt_tokens=4, gen_tokens=4, threads=2, users=2, unified=unified)
    tiers, prof = placements(spec), load_profile("h100")
    plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], tiers,
                     evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip
    engine = CudaEngine(spec, plan, n_seq=2, unified=unified)
    reference = NumpyEngine(spec, n_ctx=N_CTX, n_seq=2, unified=unified)
    for e in (engine, reference):
        e.add_sequence()
    calls = [
        lambda e: e.process([(0, [5, 9, 2]), (1, [4])]),  # tier 4, two logit rows
        lambda e: list(e.decode_batch([(1, 8), (0, 7)])),  # tier 4, head on the device
        lambda e: (e.remove_sequence(1), e.add_sequence(), e.process([(1, [3])]))[2],  # tier 1
        lambda e: list(e.decode_batch([(0, 6), (1, 2)])),
    ]
    for i, call in enumerate(calls):
        for ours, want in zip(call(engine), call(reference)):
            assert normwise(ours, want) <= engine.tolerance, (i, normwise(ours, want))
    assert engine.n_past_of(0) == 5 and engine.n_past_of(1) == 2
