"""CPU segments and the launch and sync counts per token: the segments derived from hand-built
parts (what goes down, what goes up, when the host waits), the counts an 8B plan's schedule gives
without a run (a resident decode token: one graph launch, one wait; a hybrid token: one hand-off
pair per segment), and, under the CUDA simulator on tiny models, the CUDA engine's counted
launches and syncs equal to the schedule's, with its logits still agreeing with NumPy (the fused
layer of a segment that covers a whole layer included)."""

import numpy as np
import pytest
from numba import cuda

from cudarun.counts import Counts, counting, Counter, install, tier_counts
from cudarun.program import Part
from cudarun.schedule import HOST, compute_queue
from cudarun.segments import Segment, cpu_segments, ends_with_sync, whole_layers
from refengine.synthetic import preset, spec_from_hparams
from solver.cost import CPU, PINNED, STREAMED, Loc, TierPlacement
from solver.groups import tensor_groups


def parts(layout: str, moe: bool = False) -> list[Part]:
    """Parts from a string: per layer six letters (qkv, kq, o, gate, up, down; MoE: the _exps
    stacks), 'c' on the CPU, 'd' on the device, between the embedding's and the output's."""
    embed, *layers, output = layout.split()
    ffn = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps") if moe else ("ffn_gate", "ffn_up",
                                                                           "ffn_down")  # fmt: skip
    out = [Part("embed", "embed", None, "token_embd", _q(embed), ())]
    for il, letters in enumerate(layers):
        for kind, q in zip(("qkv", "kq", "o", *ffn), letters):
            group = None if kind == "kq" else f"blk.{il}.{'attn' if kind in ('qkv', 'o') else kind}"
            out.append(Part(f"blk.{il}.{kind}", kind, il, group, _q(q), ()))
    out.append(Part("output", "output", None, "output", _q(output), ()))
    return out


def _q(letter: str):
    return {"c": HOST, "d": compute_queue()}[letter]


def test_the_ffn_on_the_cpu_is_one_segment_per_layer_with_one_hand_off_each_way():
    p = parts("d dddccc dddccc d")
    segs = cpu_segments(p, moe=False)
    assert [(s.first, s.stop) for s in segs] == [(4, 7), (10, 13)]
    assert all(s.reads == ("h", "x") and s.writes == ("x",) and s.sync for s in segs)
    assert ends_with_sync(p, segs)  # the output runs on the device after the last segment


def test_a_segment_spans_layers_and_covers_whole_layers():
    p = parts("c cccccc cccddd d")  # embedding, layer 0 whole and layer 1's attention: one run
    (seg,) = cpu_segments(p, moe=False)
    assert (seg.first, seg.stop, seg.layers) == (0, 10, (0,))
    assert seg.reads == () and not seg.sync  # the host has everything it reads
    assert seg.writes == ("h", "x")  # what the device's FFN reads: its input and the residual
    assert whole_layers(p, moe=False) == {0}
    assert whole_layers(parts("c cccccc cccddd d", moe=True), moe=True) == set()  # no fused MoE


def test_what_the_host_holds_is_not_handed_down_again():
    # layer 0: o and the gate on the CPU, up on the device, down on the CPU
    p = parts("d ddccdc d")
    first, second = cpu_segments(p, moe=False)
    assert first.reads == ("a", "x") and first.writes == ("h",)  # x is next read on the host
    assert second.reads == ("up",) and second.writes == ("x",)  # gate and x are still the host's


def test_the_host_waits_for_an_upload_still_reading_the_staging():
    # o on the CPU hands h up to the device's gate; up on the CPU reads h, which it holds: nothing
    # to hand down, but the upload of h may still be reading the staging it would write
    p = parts("d ddcdcd d")
    first, second = cpu_segments(p, moe=False)
    assert first.writes == ("h", "x") and second.reads == () and second.sync


def test_an_all_cpu_tier_is_one_segment_without_a_wait():
    p = parts("c cccccc cccccc c")
    (seg,) = cpu_segments(p, moe=False)
    assert seg == Segment(0, len(p), (), (), False, (0, 1))
    assert not ends_with_sync(p, [seg])


def test_a_tier_ending_in_a_segment_that_waited_needs_no_final_wait():
    p = parts("c dddddd c")
    segs = cpu_segments(p, moe=False)
    assert [s.sync for s in segs] == [False, True] and not ends_with_sync(p, segs)


def test_moe_segments_hand_the_router_fields():
    p = parts("d dddccc d", moe=True)
    (seg,) = cpu_segments(p, moe=True)
    assert seg.reads == ("h", "ids", "gates", "x") and seg.writes == ("x",)


# -- counts from the schedule, without a run ------------------------------------------------------


@pytest.fixture(scope="module")
def llama8b():
    return spec_from_hparams(preset("llama3-8b", qtype="Q4_K_M"))


def placement(spec, attn, ffn, kv, ends=PINNED) -> TierPlacement:
    groups = {}
    for g in tensor_groups(spec):
        kind = ends if g.layer is None else attn if g.kind == "attn" else ffn
        groups[g.name] = Loc(kind)
    return TierPlacement(groups, {il: Loc(kv) for il in range(spec.hparams.n_layer)})


def test_a_resident_decode_token_is_one_graph_launch_and_one_wait(llama8b):
    counts, graph = tier_counts(llama8b, placement(llama8b, PINNED, PINNED, PINNED), 1)
    assert graph and counts == Counts(launches=1, syncs=1)
    eager, graph = tier_counts(llama8b, placement(llama8b, PINNED, PINNED, PINNED), 1, False)
    assert not graph and eager.syncs == 1 and eager.launches > 32 * 10  # every kernel, one wait


def test_a_hybrid_token_has_one_hand_off_pair_per_cpu_segment(llama8b):
    n_layer = llama8b.hparams.n_layer
    counts, graph = tier_counts(llama8b, placement(llama8b, STREAMED, CPU, PINNED), 1)
    assert not graph
    assert counts.segments == counts.downloads == counts.uploads == n_layer
    assert counts.syncs == n_layer + 1  # a wait per segment, and one at the end (output on GPU)
    # the attention on the CPU too: embedding, layers and head are one segment, nothing to hand
    counts, _ = tier_counts(llama8b, placement(llama8b, CPU, CPU, CPU, ends=CPU), 1)
    assert counts == Counts(launches=0, syncs=0, segments=1)


@cuda.jit(device=True)
def twice(x):
    return 2 * x


@cuda.jit
def doubled(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] = twice(a[i])


def test_the_launch_counter_counts_launches_but_not_device_calls():
    install()
    a = np.ones(4, np.float32)
    with counting(Counter()) as c:
        doubled[1, 4](a)
        doubled.forall(4)(a)
        with counting(None):  # e.g. a graph's capture
            doubled[1, 4](a)
    assert c.launches == 2 and (a == 8).all()


# -- the CUDA engine under the simulator counts what the schedule says ---------------------------


@pytest.fixture
def recorded(monkeypatch):
    """Kernels recorded, not run (the counts do not depend on the values; a simulated kernel
    takes seconds), and the cuBLAS product a stub that counts like it."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel, _kernel_context

    from cudarun.kernels import prefill

    run_kernel = FakeCUDAKernel.__call__

    def skip(self, *args):
        if self._device or _kernel_context:
            return run_kernel(self, *args)

    monkeypatch.setattr(FakeCUDAKernel, "__call__", skip)
    monkeypatch.setattr(prefill, "gemm_fp16", lambda *a, **k: None)


def engine_runs(spec, tiers, n_ctx=16, agree=True):
    """The CUDA engine through a 3-token prompt and a decode token, against NumPy when `agree`
    (else with the arena zeroed, so that values the skipped kernels never wrote are sane)."""
    from cudarun.cuda_engine import CudaEngine
    from refengine.agreement import normwise
    from refengine.engine import NumpyEngine
    from solver.cost import Workload, evaluate
    from solver.plan import plan_json
    from solver.solve import load_profile

    w = Workload(n_ctx=n_ctx, prompt_tokens=4, gen_tokens=4, threads=2)
    prof = load_profile("h100")
    plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], tiers,
                     evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip
    engine, reference = CudaEngine(spec, plan), NumpyEngine(spec, n_ctx=n_ctx)
    if not agree:
        engine.arena.copy_to_device(np.zeros(engine.arena.size, np.uint8))
    for call in (lambda e: e.prefill([5, 9, 2]), lambda e: e.decode(7)):  # tier 4, then tier 1
        ours, want = call(engine), call(reference)
        assert not agree or normwise(ours, want) <= engine.tolerance
    return engine


def assert_counted_as_scheduled(engine):
    assert engine.tally.rows
    for (t, n, graph), (ubatches, total) in engine.tally.rows.items():
        want, want_graph = tier_counts(engine.spec, engine.placements[t], n, graphs=False)
        assert not graph and not want_graph
        assert total == Counts(*(ubatches * v for v in want.__dict__.values())), (t, n)


def test_the_cuda_engine_counts_what_the_schedule_says(tiny_spec, recorded):
    """The placements of test_cuda_engine (streamed and pinned weights and KV, the embedding and
    head on the CPU at tier 1, an FFN matrix on the CPU at tier 4; its agreement with NumPy is
    that test's)."""
    from tests.test_cuda_engine import placements

    engine = engine_runs(tiny_spec, placements(tiny_spec), agree=False)
    assert_counted_as_scheduled(engine)
    assert {n for _, n, _ in engine.tally.rows} == {1, 3}


def test_a_segment_covering_a_whole_layer_runs_it_fused_and_counts_as_scheduled(tiny_spec):
    """Tier 1: the embedding, the layer and its KV on the CPU, the head on the device (a decode
    token's layer is the cpu engine's fused call where the model is dense); tier 4: the layer's
    attention on the CPU between a device embedding and FFN."""
    groups = tensor_groups(tiny_spec)
    one = {g.name: Loc(CPU) for g in groups}
    one["output"] = Loc(PINNED)
    four = {g.name: Loc(PINNED if g.kind != "attn" else CPU) for g in groups}
    tiers = {1: TierPlacement(one, {0: Loc(CPU)}), 4: TierPlacement(four, {0: Loc(CPU)})}
    engine = engine_runs(tiny_spec, tiers)
    assert_counted_as_scheduled(engine)
    (seg,) = engine.tiers[1].segments
    assert seg.layers == ((0,) if not tiny_spec.arch.moe else ())
    fused = engine.runner._fused
    assert (fused is not None and fused.layers is not None) == (not tiny_spec.arch.moe)


def test_a_segment_waits_while_an_upload_may_still_read_staging(tiny_spec):
    """The attention and KV on the CPU, the up product on the CPU between the gate and down products
    on the device: the up product's segment reads nothing from the device (the host wrote h), but
    the previous segment's uploads (h, x) may still be reading staging, so it waits; counted as
    scheduled."""
    groups = tensor_groups(tiny_spec)
    on_cpu = {g.name for g in groups if g.kind == "attn" or "ffn_up" in g.name}
    place = {g.name: Loc(CPU if g.name in on_cpu else PINNED) for g in groups}
    tiers = {t: TierPlacement(place, {0: Loc(CPU)}) for t in (1, 4)}
    engine = engine_runs(tiny_spec, tiers)
    assert any(s.sync and not s.reads for s in engine.tiers[1].segments)
    assert_counted_as_scheduled(engine)


@pytest.fixture(scope="module", params=["gemma3", "qwen3moe"])
def tiny_spec(request, tmp_path_factory):
    from refengine.spec import load_spec
    from refengine.synthetic import write_synthetic
    from tests.test_cuda_engine import TINY

    path = write_synthetic(tmp_path_factory.mktemp("tiny") / "m.gguf", TINY[request.param])
    return load_spec(str(path))


def test_the_stand_in_runs_a_segment_at_a_time_and_bench_prints_the_counts(small_models):
    from cudarun.counts import report_lines
    from cudarun.standin_engine import StandInEngine
    from refengine.spec import load_spec
    from solver.cost import Workload
    from solver.solve import load_profile, solve_plan

    spec = load_spec(str(small_models["llama"]))
    w = Workload(n_ctx=64, prompt_tokens=8, gen_tokens=4, threads=2)
    plan = solve_plan(spec, load_profile("h100"), w, [1, 4], [int(0.3 * spec.weights_nbytes)],
                      "ffncpu-attnstream", 5)  # fmt: skip
    engine = StandInEngine(spec, plan, seed=1)
    engine.prefill([3, 4, 5, 6])
    engine.decode(7)
    for (t, n, _), (ubatches, total) in engine.tally.rows.items():
        assert total.segments == ubatches * len(engine.tiers[t].segments) > 0
    lines = report_lines(engine)
    assert [line.split(",")[0] for line in lines] == ["tier 1", "tier 4"]
    assert all("counted per token" in line and "scheduled" in line for line in lines)


def test_prefill_counts_per_panel_as_scheduled(tmp_path, recorded):
    """A 20-token prompt at tier 32 takes the fp16 GEMM path: the activations to fp16, then a
    dequantize and a cuBLAS product per panel of 256 rows (the FFN's 320 rows: two). Resident and
    with the FFN on the CPU."""
    from cudarun.cuda_engine import CudaEngine
    from refengine.spec import load_spec
    from refengine.synthetic import SyntheticConfig, write_synthetic
    from solver.cost import Workload, evaluate
    from solver.plan import plan_json
    from solver.solve import load_profile

    config = SyntheticConfig("gemma3", n_layer=2, n_embd=32, n_ff=320, n_head=2, n_head_kv=1,
                             head_dim=16, n_vocab=260, qtype="Q8_0", n_swa=6)  # fmt: skip
    spec = load_spec(str(write_synthetic(tmp_path / "m.gguf", config)))
    w = Workload(n_ctx=64, prompt_tokens=20, gen_tokens=1, threads=2)
    prof = load_profile("h100")
    launches = {}
    for ffn in (PINNED, CPU):
        place = placement(spec, PINNED, ffn, PINNED)
        tiers = {1: place, 32: place}
        plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (16 << 20)], tiers,
                         evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip
        engine = CudaEngine(spec, plan)
        # values the skipped kernels never wrote must be sane for the CPU parts that read them
        engine.arena.copy_to_device(np.zeros(engine.arena.size, np.uint8))
        engine.prefill(list(range(3, 23)))
        ((key, (ubatches, counted)),) = engine.tally.rows.items()
        want, _ = tier_counts(spec, place, 20, graphs=False)
        assert key == (32, 20, False) and ubatches == 1 and counted == want
        assert want.segments == (2 if ffn == CPU else 0)
        launches[ffn] = counted.launches
    # a layer's FFN on the device, worked by hand: gate and up, 320 rows, are two panels each
    # (1 + 2 * 2 launches); gating, down (32 rows: 1 + 2), post-norm, residual add: 6
    assert launches[PINNED] - launches[CPU] == 2 * (5 + 5 + 6)
