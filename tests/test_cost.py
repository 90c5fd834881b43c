"""The cost model on hand-computed cases. A toy profile with round rates makes each expected time
a line of arithmetic, written beside the assertion."""

import math
from dataclasses import replace

import numpy as np
import pytest

from refengine.synthetic import SyntheticConfig, spec_from_hparams
from solver.cost import (
    CPU,
    GGML_CPU_ATTENTION_EFFICIENCY,
    GPU_ATTENTION_EFFICIENCY,
    PINNED,
    PSHARD_PAGEABLE_H2D_GBPS,
    STREAMED,
    CostModel,
    Loc,
    TierPlacement,
    Workload,
    evaluate,
)
from solver.groups import EXPERTS
from solver.memory import KVShape, expected_distinct_experts, kv_layer_nbytes
from solver.profile import ANY_TYPE, CPUProfile, Figure, GPUProfile, HardwareProfile, RateTable


def toy_profile(h2d_busy=5.0) -> HardwareProfile:
    f = lambda v: Figure(v, "toy")  # noqa: E731
    table = lambda unit, v: RateTable(unit, {ANY_TYPE: {1: f(v)}})  # noqa: E731
    gpu = GPUProfile(
        "toy GPU",
        f(2**30),
        f(1000.0),
        table("GB/s", 100.0),
        table("TFLOP/s", 10.0),
        f(10.0),
        f(10.0),
        f(0.0),
        f(h2d_busy),
        f(0.0),
        f(0.0),
    )
    cpu = CPUProfile("toy CPU", 8, f(20.0), table("GB/s", 10.0), table("GFLOP/s", 100.0), f(0.0))
    return HardwareProfile("toy", (gpu,), cpu)


DENSE_CONFIG = SyntheticConfig(
    "llama",
    n_layer=2,
    n_embd=1024,
    n_ff=4096,
    n_head=8,
    n_head_kv=8,
    n_vocab=32000,
    qtype="F16",
)
DENSE = spec_from_hparams(DENSE_CONFIG)
W = Workload(n_ctx=4096, prompt_tokens=512, gen_tokens=100)


def place(spec, loc_of, kv=Loc(PINNED)):
    cm = CostModel(spec, toy_profile(), W)
    return TierPlacement(
        {g.name: loc_of(g) for g in cm.groups}, {il: kv for il in range(spec.hparams.n_layer)}
    )


def test_group_roofline_on_gpu_and_cpu():
    cm = CostModel(DENSE, toy_profile(), W)
    up = next(g for g in cm.groups if g.name == "blk.0.ffn_up")
    assert up.nbytes == 4096 * 1024 * 2 and up.params == 4096 * 1024
    # decode: 8 MiB / 100 GB/s = 83.9 us; flops 2 * 4.19e6 / 10e12 = 0.84 us -> memory bound
    assert cm.gpu_seconds(up, 1) == pytest.approx(8388608 / 100e9)
    # prefill 512: flops 2 * 4194304 * 512 / 10e12 = 429.5 us -> compute bound
    assert cm.gpu_seconds(up, 512) == pytest.approx(2 * 4194304 * 512 / 10e12)
    # CPU: 8 MiB / 10 GB/s = 839 us at 1 token; 2 * 4194304 * 512 / 100e9 = 42.9 ms at 512
    assert cm.cpu_seconds(up, 1) == pytest.approx(8388608 / 10e9)
    assert cm.cpu_seconds(up, 512) == pytest.approx(2 * 4194304 * 512 / 100e9)
    # a decode token on the CPU is its matvec, whatever the (prefill) matmul rate: the one
    # measured at 64 tokens and held below them made it compute-bound, 3-6x slow on real runs
    slow = replace(toy_profile(), cpu=replace(toy_profile().cpu, matmul_gflops=RateTable(
        "GFLOP/s", {ANY_TYPE: {64: Figure(1.0, "toy")}})))  # fmt: skip
    assert CostModel(DENSE, slow, W).cpu_seconds(up, 1) == pytest.approx(8388608 / 10e9)


def test_our_host_prefill_runs_at_the_fp32_panels_rate():
    """Our runtime multiplies the fp32 panels it keeps (BLAS on fp32, whatever the file's type):
    where the profile measured that row, a prompt's CPU matmul is priced by it; llama.cpp's CPU
    backend keeps the type's own rate, and so does a profile without the row."""
    from solver.profile import PANEL_TYPE

    base = toy_profile()
    rows = dict(base.cpu.matmul_gflops.rows) | {PANEL_TYPE: {64: Figure(400.0, "toy")}}
    panels = replace(base, cpu=replace(base.cpu, matmul_gflops=RateTable("GFLOP/s", rows)))
    up = next(g for g in CostModel(DENSE, base, W).groups if g.name == "blk.0.ffn_up")
    flops = 2 * 4194304 * 512
    assert CostModel(DENSE, panels, W).cpu_seconds(up, 512) == pytest.approx(flops / 400e9)
    assert CostModel(DENSE, panels, W, "llamacpp").cpu_seconds(up, 512) == pytest.approx(
        flops / 100e9)
    assert CostModel(DENSE, base, W).cpu_seconds(up, 512) == pytest.approx(flops / 100e9)


def test_our_host_prefill_runs_a_type_that_repacks_at_its_int8_tiles_rate():
    """Our runtime multiplies the int8 tiles it keeps for the types that repack (`tile_gflops`),
    the fp32 panels for the rest; a matrix whose rows are not whole tiles stays on the panels, and
    llama.cpp's CPU backend keeps the type's own rate."""
    from solver.profile import PANEL_TYPE, TILE_ROWS

    q4k = spec_from_hparams(replace(DENSE_CONFIG, qtype="Q4_K"))
    base = toy_profile()
    rows = dict(base.cpu.matmul_gflops.rows) | {PANEL_TYPE: {64: Figure(400.0, "toy")}}
    tiles = RateTable("GFLOP/s", {"Q4_K": {64: Figure(250.0, "toy"), 512: Figure(1000.0, "toy")}})
    prof = replace(base, cpu=replace(base.cpu, matmul_gflops=RateTable("GFLOP/s", rows),
                                     tile_gflops=tiles))  # fmt: skip
    up = next(g for g in CostModel(q4k, prof, W).groups if g.name == "blk.0.ffn_up")
    flops = 2 * 4194304 * 512
    assert CostModel(q4k, prof, W).cpu_seconds(up, 512) == pytest.approx(flops / 1000e9)
    assert CostModel(q4k, prof, W, "llamacpp").cpu_seconds(up, 512) == pytest.approx(
        flops / 100e9)
    # F16 does not repack: the panels' rate
    f16_up = next(g for g in CostModel(DENSE, prof, W).groups if g.name == "blk.0.ffn_up")
    assert CostModel(DENSE, prof, W).cpu_seconds(f16_up, 512) == pytest.approx(flops / 400e9)
    # 4096 + 8 rows: not whole tiles of 16
    odd = spec_from_hparams(replace(DENSE_CONFIG, qtype="Q4_K", n_ff=4096 + TILE_ROWS // 2))
    odd_up = next(g for g in CostModel(odd, prof, W).groups if g.name == "blk.0.ffn_up")
    odd_flops = 2 * 1024 * (4096 + TILE_ROWS // 2) * 512
    assert CostModel(odd, prof, W).cpu_seconds(odd_up, 512) == pytest.approx(odd_flops / 400e9)


def test_our_host_prefill_on_tiles_pays_each_inputs_quantization_once():
    """Before its products on tiles our host quantizes each input once, serially, per value
    (`quantize_value_seconds`): Q, K and V share the normed input, gate and up share theirs (half
    priced to each), down and the output matrix read their own; the panels pay none."""
    from solver.profile import PANEL_TYPE

    q4k = spec_from_hparams(replace(DENSE_CONFIG, qtype="Q4_K"))
    base = toy_profile()
    rows = dict(base.cpu.matmul_gflops.rows) | {PANEL_TYPE: {64: Figure(400.0, "toy")}}
    tiles = RateTable("GFLOP/s", {"Q4_K": {64: Figure(1000.0, "toy")}})
    per_value = 2e-9
    quantized = replace(base, cpu=replace(base.cpu, matmul_gflops=RateTable("GFLOP/s", rows),
                                          tile_gflops=tiles,
                                          quantize_value_seconds=Figure(per_value, "toy")))
    alone = replace(quantized, cpu=replace(quantized.cpu, quantize_value_seconds=None))
    groups = {g.name: g for g in CostModel(q4k, alone, W).groups}
    # n_embd 1024: q, k and v read one input, the output matrix its 8 x 128; gate and up read
    # the normed input (half each), down its 4096
    for name, values in (("blk.0.attn", 1024 + 1024), ("blk.0.ffn_gate", 512),
                         ("blk.0.ffn_up", 512), ("blk.0.ffn_down", 4096)):  # fmt: skip
        extra = (CostModel(q4k, quantized, W).cpu_seconds(groups[name], 512)
                 - CostModel(q4k, alone, W).cpu_seconds(groups[name], 512))
        assert extra == pytest.approx(512 * values * per_value), name
    f16_up = next(g for g in CostModel(DENSE, quantized, W).groups if g.name == "blk.0.ffn_up")
    assert (CostModel(DENSE, quantized, W).cpu_seconds(f16_up, 512)
            == CostModel(DENSE, alone, W).cpu_seconds(f16_up, 512))


def test_the_cost_models_tile_rows_are_the_kernels():
    from cudarun.kernels.q8_gemm import ROWS
    from solver.profile import TILE_ROWS

    assert TILE_ROWS == ROWS


def test_prefill_can_stream_cpu_resident_weights_instead_of_computing_them_on_the_cpu():
    streamed = place(DENSE, lambda g: Loc(STREAMED) if g.layer is not None else Loc(PINNED))
    on_cpu = place(DENSE, lambda g: Loc(CPU) if g.layer is not None else Loc(PINNED))
    cm = CostModel(DENSE, toy_profile(), W)
    s, c = cm.ubatch_terms(streamed, 512, 0), cm.ubatch_terms(on_cpu, 512, 0)
    layer_bytes = sum(g.nbytes for g in cm.by_layer[0])
    assert s.copy == pytest.approx(2 * layer_bytes / 10e9)  # every ubatch copies both layers
    assert s.cpu == 0 and c.copy == 0
    assert s.total < c.total / 10  # 512 tokens: PCIe beats computing on the CPU by far
    # at one token the CPU reads each weight once, at 10 GB/s, as fast as PCIe moves it
    assert cm.ubatch_terms(on_cpu, 1, 0).cpu == pytest.approx(
        2 * sum(cm.cpu_seconds(g, 1) for g in cm.by_layer[0])
        + 2 * (cm.attention_seconds(0, 1, 0, Loc(PINNED)) * 0)
    )


def test_copies_overlap_compute_on_our_runtime_but_not_on_llamacpp():
    streamed = place(DENSE, lambda g: Loc(STREAMED) if g.layer is not None else Loc(PINNED))
    ours = CostModel(DENSE, toy_profile(), W).layer_terms(0, streamed, 512, 0, False)
    theirs = CostModel(DENSE, toy_profile(), W, "llamacpp").layer_terms(0, streamed, 512, 0, False)
    assert ours.total == pytest.approx(max(ours.gpu, ours.copy) + ours.latency)
    assert theirs.total == pytest.approx(theirs.gpu + theirs.copy + theirs.latency)


def test_concurrent_cpu_work_slows_the_copies():
    cm = CostModel(DENSE, toy_profile(h2d_busy=5.0), W)
    assert cm.copy_seconds(1e9, 0, cpu_busy=False) == pytest.approx(0.1)
    assert cm.copy_seconds(1e9, 0, cpu_busy=True) == pytest.approx(0.2)


MOE = spec_from_hparams(
    SyntheticConfig(
        "qwen3moe",
        n_layer=1,
        n_embd=256,
        n_ff=512,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        n_expert=64,
        n_expert_used=4,
        n_ff_exp=256,
        qtype="F16",
    )
)


def test_moe_prices_distinct_experts_per_ubatch():
    # E (1 - (1 - k/E)^M): 28 tokens with k = 8 of 256 touch 150.8 experts, not 8 * 28 = 224;
    # 365 tokens touch all 256
    assert expected_distinct_experts(256, 8, 28) == pytest.approx(256 * (1 - (31 / 32) ** 28))
    assert expected_distinct_experts(256, 8, 28) == pytest.approx(150.76, abs=0.01)
    assert expected_distinct_experts(256, 8, 365) == pytest.approx(256, abs=0.01)
    assert expected_distinct_experts(256, 8, 1) == pytest.approx(8)
    cm = CostModel(MOE, toy_profile(), W)
    up = next(g for g in cm.groups if g.name == "blk.0.ffn_up_exps")
    nbytes, flops = cm.work(up, 16)
    assert nbytes == pytest.approx(up.nbytes * expected_distinct_experts(64, 4, 16) / 64)
    assert flops == pytest.approx(2 * up.params / 64 * 4 * 16)


def test_llamacpp_copies_only_the_routed_experts_of_a_cpu_held_stack():
    # llama.cpp's scheduler (PR 15346) op-offloads a CPU-held expert stack at >= 32 tokens by
    # reading the router's ids back (one sync a layer) and copying the D used experts, one copy per
    # run of consecutive ids, padded by min(expert, 512) bytes but at the last expert
    base = toy_profile()
    gpu = replace(base.gpus[0], copy_latency_seconds=Figure(1e-5, "toy"))
    profile = replace(base, gpus=(gpu,), cpu=replace(base.cpu, sync_seconds=Figure(2e-5, "toy")))
    cpu, pinned = Loc(CPU), Loc(PINNED)
    cm = CostModel(MOE, profile, W, target="llamacpp")
    experts = [g for g in cm.groups if g.kind == "experts"]
    assert len(experts) == 3
    place = TierPlacement(
        {g.name: cpu if g.kind == "experts" else pinned for g in cm.groups}, {0: pinned}
    )
    d = expected_distinct_experts(64, 4, 32)  # 56.3 of 64 experts
    p = d / 64
    runs = p + 63 * p * (1 - p)  # expected runs of used ids: 7.8
    expert = experts[0].nbytes / 64  # 128 KiB, so each run but one ending at expert 63 pads 512 B
    nbytes = expert * d + (runs - p) * 512
    one = nbytes / 10e9 + runs * 1e-5  # at h2d 10 GB/s, a copy latency per run
    assert cm.routed_copy_seconds(experts[0], 32, 0, False) == pytest.approx(one)
    readback = 2e-5 + 1e-5 + 4 * 32 * 4 / 10e9  # sync + latency + 32 x 4 int32 ids down
    whole = cm.layer_terms(0, place, 32, 0, cpu_busy=False)
    assert whole.copy == pytest.approx(3 * one)
    # the same placement with the stacks pinned: no copy, no readback
    resident = cm.layer_terms(0, TierPlacement(dict.fromkeys(place.groups, pinned), {0: pinned}),
                              32, 0, cpu_busy=False)  # fmt: skip
    assert resident.copy == 0
    assert whole.latency - resident.latency == pytest.approx(readback)
    # below 32 tokens the stacks run on the CPU: nothing is copied
    assert cm.layer_terms(0, place, 16, 0, cpu_busy=False).copy == 0
    # our runtime streams a stack whole (until it copies routed experts itself)
    ours = CostModel(MOE, profile, W)
    streamed = TierPlacement(
        {g.name: Loc(STREAMED) if g.kind == "experts" else pinned for g in cm.groups}, {0: pinned}
    )
    full = sum(g.nbytes / 10e9 + 1e-5 for g in experts)
    assert ours.layer_terms(0, streamed, 32, 0, cpu_busy=False).copy == pytest.approx(full)
    assert whole.copy < full  # 56.3 of 64 experts and 7.8 copies a stack: 0.96 of the time


def test_our_host_prefill_prices_its_attention_and_gated_activation_as_measured():
    """Where the profile measured them, our host prefill's attention costs rows x (cells scored x
    per score + per row) at the head size's rate, ffn_up carries act(gate) * up per element and
    the attention side RoPE over q and k and the layer's fixed cost;
    llama.cpp's CPU backend and decode keep the roofline, and so does a profile without them."""
    base = toy_profile()
    hp = DENSE.hparams
    measured = replace(base, cpu=replace(
        base.cpu, attention_score_seconds=RateTable("s", {ANY_TYPE: {
            64: Figure(4e-9, "toy"), 256: Figure(8e-9, "toy")}}),  # head 128: 6e-9, log-midway
        attention_row_seconds=Figure(1e-6, "toy"), glu_element_seconds=Figure(3e-9, "toy"),
        gelu_element_seconds=Figure(9e-9, "toy"), rope_element_seconds=Figure(5e-9, "toy"),
        rope_angle_seconds=Figure(2e-8, "toy"),
        layer_seconds=Figure(3e-5, "toy"), llamacpp_layer_seconds=Figure(2e-5, "toy")))
    cpu = Loc(CPU)
    ours, roofline = CostModel(DENSE, measured, W), CostModel(DENSE, base, W)
    rows, cells = hp.n_head * 512, 1000 + 512
    assert ours.attention_seconds(0, 512, 1000, cpu) == pytest.approx(
        rows * (cells * 6e-9 + 1e-6))
    assert CostModel(DENSE, measured, W, "llamacpp").attention_seconds(0, 512, 1000, cpu) == (
        CostModel(DENSE, base, W, "llamacpp").attention_seconds(0, 512, 1000, cpu))
    assert ours.attention_seconds(0, 1, 1000, cpu) == roofline.attention_seconds(0, 1, 1000, cpu)
    up = next(g for g in ours.groups if g.name == "blk.0.ffn_up")
    gate = next(g for g in ours.groups if g.name == "blk.0.ffn_gate")
    assert ours.cpu_seconds(up, 512) - roofline.cpu_seconds(up, 512) == pytest.approx(
        512 * hp.n_ff * 3e-9)
    assert ours.cpu_seconds(gate, 512) == roofline.cpu_seconds(gate, 512)
    attn = next(g for g in ours.groups if g.name == "blk.0.attn")  # RoPE over q and k: the
    # angles once a call (two calls), the elements of every head
    assert ours.cpu_seconds(attn, 512) - roofline.cpu_seconds(attn, 512) == pytest.approx(
        512 * hp.n_rot * (2e-8 + (hp.n_head + hp.n_head_kv) * 5e-9) + 3e-5)
    # measured serial (a prompt's, beside BLAS); below the BLAS path Numba's threads share them
    threads = ours.threads
    assert threads > 1
    assert ours.cpu_seconds(up, 4) - roofline.cpu_seconds(up, 4) == pytest.approx(
        4 * hp.n_ff * 3e-9 / threads)
    # a routed stack's up carries each slot's act(gate) * up and, from the BLAS tier on, its
    # rows' bookkeeping per element of the token's and the expert's widths
    moe = replace(measured, cpu=replace(measured.cpu, routed_slot_seconds=Figure(4e-9, "toy")))
    routed, plain = CostModel(MOE, moe, W), CostModel(MOE, base, W)
    mp = MOE.hparams
    up_exps = next(g for g in routed.groups if g.name == "blk.0.ffn_up_exps")
    assert routed.cpu_seconds(up_exps, 512) - plain.cpu_seconds(up_exps, 512) == pytest.approx(
        512 * mp.n_expert_used * (mp.n_ff_exp * 3e-9 + (mp.n_embd + mp.n_ff_exp) * 4e-9))
    assert routed.cpu_seconds(up_exps, 4) - plain.cpu_seconds(up_exps, 4) == pytest.approx(
        4 * mp.n_expert_used * mp.n_ff_exp * 3e-9 / threads)
    # a host-run layer's fixed cost, once a ubatch, each system its own
    assert ours.cpu_seconds(attn, 1) - roofline.cpu_seconds(attn, 1) == pytest.approx(3e-5)
    llama = CostModel(DENSE, measured, W, "llamacpp")
    assert llama.cpu_seconds(attn, 1) - CostModel(DENSE, base, W, "llamacpp").cpu_seconds(
        attn, 1) == pytest.approx(2e-5)
    assert ours.cpu_seconds(up, 1) == roofline.cpu_seconds(up, 1)


def test_our_decode_layer_pays_its_types_fixed_costs_by_their_bytes():
    """Where the profile measured our decode layer's cost beyond its bytes per type (twins whose
    every matrix is of the type), a layer pays each type's figure for the share of its bytes that
    type holds, a type not measured the '*' row; llama.cpp's target keeps its own figure."""
    mixed = spec_from_hparams(SyntheticConfig("llama", n_layer=2, n_embd=1024, n_ff=4096,
                                              n_head=8, n_head_kv=8, n_vocab=32000,
                                              qtype="Q4_K_M"))  # fmt: skip
    base = toy_profile()
    plain = replace(base, cpu=replace(base.cpu, layer_seconds=Figure(2e-5, "toy")))
    table = RateTable("s", {"Q4_K": {8: Figure(1e-4, "toy")}, ANY_TYPE: {8: Figure(2e-5, "toy")}})
    measured = replace(plain, cpu=replace(plain.cpu, layer_type_seconds=table))
    cm, before = CostModel(mixed, measured, W), CostModel(mixed, plain, W)
    groups = cm.by_layer[1]
    q4k, total = sum(g.nbytes for g in groups if g.qtype == "Q4_K"), sum(g.nbytes for g in groups)
    assert 0 < q4k < total  # the mix's layer 1 holds Q6_K matrices too
    attn = groups[0]
    assert cm.cpu_seconds(attn, 1) - before.cpu_seconds(attn, 1) == pytest.approx(
        (q4k * 1e-4 + (total - q4k) * 2e-5) / total - 2e-5)
    assert cm.cpu_seconds(groups[1], 1) == before.cpu_seconds(groups[1], 1)  # once a layer
    llama = CostModel(mixed, measured, W, "llamacpp")
    assert llama.cpu_seconds(attn, 1) == CostModel(mixed, plain, W, "llamacpp").cpu_seconds(attn, 1)


def test_our_decode_prices_each_layers_own_gated_activation_in_place_of_the_twins():
    """Where the profile says what gated activation its layer twins ran inside their fixed cost,
    our dense decode layer's fixed cost goes without it and its ffn_up carries the layer's own:
    n_ff elements, serial, at GELU's rate for a GELU model; llama.cpp's target, a routed layer
    and a profile that does not say keep their prices."""
    base = toy_profile()
    plain = replace(base, cpu=replace(base.cpu, layer_seconds=Figure(3e-5, "toy"),
                                      glu_element_seconds=Figure(3e-9, "toy"),
                                      gelu_element_seconds=Figure(9e-9, "toy")))  # fmt: skip
    measured = replace(plain, cpu=replace(plain.cpu, layer_activation_seconds=Figure(
        1536 * 3e-9, "toy")))  # fmt: skip
    gelu = spec_from_hparams(SyntheticConfig("gemma3", n_layer=2, n_embd=256, n_ff=2048,
                                             n_head=4, n_head_kv=1, n_vocab=512))  # fmt: skip
    for spec, act in ((DENSE, 3e-9), (gelu, 9e-9)):
        cm, before = CostModel(spec, measured, W), CostModel(spec, plain, W)
        attn, up = (next(g for g in cm.by_layer[1] if g.name.endswith(n))
                    for n in (".attn", ".ffn_up"))  # fmt: skip
        assert cm.cpu_seconds(attn, 1) - before.cpu_seconds(attn, 1) == pytest.approx(-1536 * 3e-9)
        assert cm.cpu_seconds(up, 1) - before.cpu_seconds(up, 1) == pytest.approx(
            spec.hparams.n_ff * act)
        llama = CostModel(spec, measured, W, "llamacpp")
        assert [llama.cpu_seconds(g, 1) for g in (attn, up)] == [
            CostModel(spec, plain, W, "llamacpp").cpu_seconds(g, 1) for g in (attn, up)]
    routed, before = CostModel(MOE, measured, W), CostModel(MOE, plain, W)
    assert [routed.cpu_seconds(g, 1) for g in routed.groups] == [
        before.cpu_seconds(g, 1) for g in before.groups]


def test_our_decode_pays_the_tokens_own_cost_once_with_its_head():
    """Where the profile measured our decoded token's cost beyond its layers and head, our head
    carries it once a call, whatever the tokens; llama.cpp's target and the layers do not. The
    figure is the layer twins' intercept at no layers."""
    from cudarun.measure_cpu import decode_intercept

    base = toy_profile()
    measured = replace(base, cpu=replace(base.cpu, token_seconds=Figure(2e-4, "toy")))
    for target, extra in (("refengine", 2e-4), ("llamacpp", 0.0)):
        cm, before = CostModel(DENSE, measured, W, target), CostModel(DENSE, base, W, target)
        for tokens in (1, 512):
            assert [cm.cpu_seconds(g, tokens) - before.cpu_seconds(g, tokens)
                    for g in cm.groups] == pytest.approx(
                [extra if g.kind == "output" else 0.0 for g in cm.groups])  # fmt: skip
    # twins of 12 and 36 layers at 2 ms and 5 ms: 0.125 ms a layer, 0.5 ms at none; a noisy pair
    # whose line crosses below zero reads no cost, not a negative one
    assert decode_intercept([2e-3, 5e-3], (12, 36)) == pytest.approx(5e-4)
    assert decode_intercept([1e-3, 5e-3], (12, 36)) == 0.0


def test_our_prompt_layer_pays_its_measured_cost_beyond_its_price():
    """Where the profile measured our prompt layer's time beyond its price, each layer's
    attention side carries it per token and element of n_embd on a prompt's ubatch (the BLAS
    tier, where the twins measured it); a decode, a ubatch below that tier and llama.cpp's
    target do not. The figure is the twins' slope less their prices' slope, per element."""
    from cudarun.measure_cpu import beyond_price

    base = toy_profile()
    measured = replace(base, cpu=replace(base.cpu, prompt_layer_element_seconds=Figure(
        2e-9, "toy")))  # fmt: skip
    width = DENSE.hparams.n_embd
    for target, tokens, per_token in (("refengine", 512, width * 2e-9), ("refengine", 1, 0.0),
                                      ("refengine", 4, 0.0), ("llamacpp", 512, 0.0)):
        cm, before = CostModel(DENSE, measured, W, target), CostModel(DENSE, base, W, target)
        assert [cm.cpu_seconds(g, tokens) - before.cpu_seconds(g, tokens)
                for g in cm.groups] == pytest.approx(
            [tokens * per_token if g.kind == "attn" else 0.0 for g in cm.groups])  # fmt: skip
    # twins of 4 and 16 layers at 100 and 400 ms priced at 70 and 280: 25 ms a layer against 17.5,
    # 7.5 ms over 512 x 512 elements; a pair under its price reads none
    assert beyond_price([0.1, 0.4], [0.07, 0.28], (4, 16), 512 * 512) == pytest.approx(
        7.5e-3 / (512 * 512))
    assert beyond_price([0.1, 0.3], [0.07, 0.28], (4, 16), 512 * 512) == 0.0


def test_llamacpp_decode_runs_faster_from_the_cache_by_the_bytes_it_touches():
    """Where the profile measured how much faster llama.cpp decodes from the cache, by the bytes
    a token reads, a llama.cpp decode's host time runs that much faster at the bytes its host
    part touches: the tensors it holds (not the embedding's row) and its KV cells at the depth,
    interpolated in log(bytes). Past the table's last point, a prompt and ours: the price as
    before."""
    from solver.cpu_tests import all_on_cpu

    hp = DENSE.hparams
    held = {t.name: t.nbytes for t in DENSE.tensors if t.name != "token_embd.weight"}
    ffn = lambda name: any(f".{m}" in name for m in ("ffn_gate", "ffn_up", "ffn_down"))  # noqa: E731
    cell = hp.n_layer * 2 * hp.n_head_kv * hp.head_dim * 2  # f16 K and V of every layer
    lo, hi = sum(held.values()) // 4, sum(held.values()) + 500 * cell
    table = RateTable("x", {ANY_TYPE: {lo: Figure(3.0, "toy"), hi: Figure(1.0, "toy")}})
    base = toy_profile()
    measured = replace(base, cpu=replace(base.cpu, llamacpp_decode_cache_speedup=table))
    every = all_on_cpu(DENSE)
    ffn_up = dict(every.groups, **{g: Loc(PINNED) for g in every.groups if ffn(g)})
    for groups, depth, host in (
        (every.groups, 0, sum(held.values()) + cell),
        (every.groups, 1000, None),  # past the table
        (ffn_up, 0, sum(n for t, n in held.items() if not ffn(t)) + cell),
    ):
        faster = 1.0 if host is None else 3.0 - 2.0 * math.log(host / lo) / math.log(hi / lo)
        tier = TierPlacement(groups, every.kv)
        t, s = (CostModel(DENSE, p, W, "llamacpp").ubatch_terms(tier, 1, depth)
                for p in (measured, base))  # fmt: skip
        assert s.cpu > 0 and t.cpu == pytest.approx(s.cpu / faster)
        assert t.total == pytest.approx(s.total - s.cpu + s.cpu / faster)
    for target, tokens in (("llamacpp", 512), ("refengine", 1)):
        assert CostModel(DENSE, measured, W, target).ubatch_terms(every, tokens, 0).total == (
            CostModel(DENSE, base, W, target).ubatch_terms(every, tokens, 0).total)


# a small Qwen3-MoE of the Q4_K_M mix: Q4_K stacks and attention, a Q6_K down stack in some layers
ROUTED_MIX = spec_from_hparams(SyntheticConfig("qwen3moe", n_layer=2, n_embd=1024, n_ff=3072,
                                               n_head=16, n_head_kv=4, head_dim=64, n_vocab=32000,
                                               qtype="Q4_K_M", n_expert=32, n_expert_used=4,
                                               n_ff_exp=512))  # fmt: skip


def test_our_routed_layer_pays_its_expert_stacks_types_per_expert_chosen():
    """Where the profile measured our cost of each chosen expert per type (routed twins whose
    every matrix is of the type), a decode's routed layer pays, for each expert chosen, its
    stacks' types' figures weighted by their bytes; llama.cpp's target keeps its own figure."""
    base = toy_profile()
    plain = replace(base, cpu=replace(base.cpu, routed_layer_seconds=Figure(9e-5, "toy"),
                                      expert_seconds=Figure(3e-6, "toy")))  # fmt: skip
    table = RateTable("s", {"Q4_K": {8: Figure(15e-6, "toy")}, ANY_TYPE: {8: Figure(3e-6, "toy")}})
    measured = replace(plain, cpu=replace(plain.cpu, expert_type_seconds=table))
    cm, before = CostModel(ROUTED_MIX, measured, W), CostModel(ROUTED_MIX, plain, W)
    for il in range(2):
        stacks = [g for g in cm.by_layer[il] if g.kind == EXPERTS]
        q4k = sum(g.nbytes for g in stacks if g.qtype == "Q4_K")
        total = sum(g.nbytes for g in stacks)
        attn = cm.by_layer[il][0]
        each = (q4k * 15e-6 + (total - q4k) * 3e-6) / total
        assert cm.cpu_seconds(attn, 1) - before.cpu_seconds(attn, 1) == pytest.approx(
            4 * (each - 3e-6))  # a decode token chose 4 experts
    assert 0 < q4k < total  # the mix's last layer holds a Q6_K stack
    llama, llama_before = (CostModel(ROUTED_MIX, p, W, "llamacpp") for p in (measured, plain))
    assert llama.cpu_seconds(attn, 1) == llama_before.cpu_seconds(attn, 1)


def test_a_prompts_layer_after_a_routed_one_pays_the_hand_off_from_numbas_threads_to_blas():
    """Our host's prompt: each layer after a routed layer pays the profile's hand-off once (its
    first BLAS product starts while the experts' Numba threads still spin); the first layer, a
    decode (no BLAS), a dense model and llama.cpp's target do not."""
    plain = toy_profile()
    measured = replace(plain, cpu=replace(plain.cpu, routed_handoff_seconds=Figure(3e-3, "toy")))
    for spec, target, tokens, paid in ((ROUTED_MIX, "refengine", 512, [0.0, 3e-3]),
                                       (ROUTED_MIX, "refengine", 1, [0.0, 0.0]),
                                       (ROUTED_MIX, "llamacpp", 512, [0.0, 0.0]),
                                       (DENSE, "refengine", 512, [0.0, 0.0])):  # fmt: skip
        cm, before = CostModel(spec, measured, W, target), CostModel(spec, plain, W, target)
        for il in (0, 1):
            extra = [cm.cpu_seconds(g, tokens) - before.cpu_seconds(g, tokens)
                     for g in cm.by_layer[il]]
            assert extra[0] == pytest.approx(paid[il]) and not any(extra[1:])


def test_attention_at_real_depth_and_token_count():
    cm = CostModel(DENSE, toy_profile(), W)
    hp = DENSE.hparams
    # decode at depth 4000: 4001 cells x 2 x 1024 x 2 B = 16.4 MB at 100 GB/s
    cell = 2 * 1024 * 2
    assert cm.attention_seconds(0, 1, 4000, Loc(PINNED)) == pytest.approx(4001 * cell / 100e9)
    # prefill 512 tokens at depth 0: 4 * 8 * 128 * 512 * 256.5 flops at 10 TFLOP/s, of which
    # flash attention reaches GPU_ATTENTION_EFFICIENCY
    flops = 4 * hp.n_head * hp.head_dim * 512 * (0 + 513 / 2)
    assert cm.attention_seconds(0, 512, 0, Loc(PINNED)) == pytest.approx(
        flops / (GPU_ATTENTION_EFFICIENCY * 10e12)
    )
    # deeper is slower, prefill-shaped differs from 512 decode-shaped tokens
    assert cm.attention_seconds(0, 1, 8000, Loc(PINNED)) > cm.attention_seconds(
        0, 1, 4000, Loc(PINNED)
    )


def test_several_users_attend_over_their_own_stream_or_the_whole_unified_cache():
    """A decode step of 32 users at depth 2000 on the CPU (20 GB/s, 100 GFLOP/s). With a KV
    stream per user each token scores its own 2000 + 1 keys; with one unified cache (and always
    under llama.cpp, whose plans export -kvu) each scores all 32 x 2000 + 32 cells, the other
    users' masked: 32x the flops, the waste llama.cpp #14363 removes. Both read the same cells."""
    hp, users, depth = DENSE.hparams, 32, 2000
    w = Workload(n_ctx=32 * 4096, prompt_tokens=2000, gen_tokens=100, users=users)
    streams, unified, llama = (
        CostModel(DENSE, toy_profile(), wl, target).attention_seconds(0, users, depth, Loc(CPU),
                                                                      users)  # fmt: skip
        for wl, target in ((w, "refengine"), (replace(w, unified=True), "refengine"),
                           (w, "llamacpp"))  # fmt: skip
    )
    per_key = 4 * hp.n_head * hp.head_dim * users / 100e9
    cells = users * depth + users
    read = cells * 2 * 1024 * 2 / 20e9  # 0.0131 s: the streams are bound by it
    assert streams == pytest.approx(max(read, per_key * (depth + 1)))
    assert unified == pytest.approx(max(read, per_key * cells))  # 0.0839 s of flops
    assert unified > 6 * streams
    # llama.cpp's CPU kernel also reads the cells once per query head, at its own efficiency
    assert llama >= unified
    one = Workload(n_ctx=4096, prompt_tokens=2000, gen_tokens=100)
    assert CostModel(DENSE, toy_profile(), replace(one, unified=True)).attention_seconds(
        0, 1, depth, Loc(CPU)
    ) == CostModel(DENSE, toy_profile(), one).attention_seconds(0, 1, depth, Loc(CPU))


def test_decode_tiers_of_several_users_reach_the_first_that_holds_them():
    from solver.budget import default_tiers

    assert default_tiers(4096) == [1, 16, 512, 1024, 2048, 4096]
    assert default_tiers(4096, users=8) == [1, 4, 16, 512, 1024, 2048, 4096]
    assert default_tiers(4096, users=4)[:3] == [1, 4, 512]
    assert default_tiers(4096, users=100)[:6] == [1, 4, 16, 32, 64, 512]


def test_llamacpp_runs_cpu_kv_attention_on_the_gpu_for_prefill_and_rereads_it_per_head():
    gqa = spec_from_hparams(
        SyntheticConfig("llama", n_layer=2, n_embd=1024, n_ff=4096, n_head=8, n_head_kv=2)
    )
    ours, theirs = CostModel(gqa, toy_profile(), W), CostModel(gqa, toy_profile(), W, "llamacpp")
    cpu_kv = place(gqa, lambda g: Loc(CPU), kv=Loc(CPU))
    # prefill: the scheduler puts attention between the op-offloaded matmuls, on the GPU, after
    # copying the 4000 + 512 cells it reads up at 10 GB/s (the CPU is idle: standalone rate)
    cell = 2 * 256 * 2
    assert theirs.attention_loc(Loc(CPU), 512) == Loc(STREAMED)
    assert theirs.attention_loc(Loc(CPU), 16) == Loc(CPU)
    assert ours.attention_loc(Loc(CPU), 512) == Loc(CPU)
    t = theirs.layer_terms(0, cpu_kv, 512, 4000, False)
    att_gpu = theirs.attention_seconds(0, 512, 4000, Loc(STREAMED))
    assert t.cpu == 0.0 and t.gpu == pytest.approx(
        att_gpu + sum(theirs.gpu_seconds(g, 512) for g in theirs.by_layer[0])
    )
    assert t.copy == pytest.approx(
        4512 * cell / 10e9 + sum(g.nbytes for g in theirs.by_layer[0]) / 10e9
    )
    # decode on the CPU: ggml reads the KV head once per query head (8 / 2 = 4 times), at the
    # calibrated fraction of the 20 GB/s host bandwidth
    assert theirs.attention_seconds(0, 1, 4000, Loc(CPU)) == pytest.approx(
        4 * 4001 * cell / (GGML_CPU_ATTENTION_EFFICIENCY * 20e9)
    )
    assert ours.attention_seconds(0, 1, 4000, Loc(CPU)) == pytest.approx(4001 * cell / 20e9)


def test_pshard_runtime_streams_from_pageable_memory():
    streamed = place(DENSE, lambda g: Loc(STREAMED))
    ours, pshard = CostModel(DENSE, toy_profile(), W), CostModel(DENSE, toy_profile(), W, "pshard")
    up = next(g for g in ours.groups if g.name == "blk.0.ffn_up")
    # pinned: the toy's 10 GB/s; pshard's pageable copies: at most PSHARD_PAGEABLE_H2D_GBPS
    assert ours.copy_seconds(up.nbytes, 0, False) == pytest.approx(up.nbytes / 10e9)
    assert pshard.copy_seconds(up.nbytes, 0, False) == pytest.approx(
        up.nbytes / (min(10.0, PSHARD_PAGEABLE_H2D_GBPS) * 1e9)
    )
    plan = dict.fromkeys((1, 512), streamed)
    assert (
        evaluate(plan, DENSE, toy_profile(), W, "pshard").e2e_seconds
        > evaluate(plan, DENSE, toy_profile(), W).e2e_seconds
    )


def test_sliding_window_layers_hold_and_read_less_kv():
    g = spec_from_hparams(
        SyntheticConfig(
            "gemma3",
            n_layer=6,
            n_embd=256,
            n_ff=512,
            n_head=4,
            n_head_kv=1,
            head_dim=64,
            n_swa=512,
            qtype="F16",
        )
    )
    kv = KVShape(n_ctx=32768, kv_type="f16", n_ubatch=512)
    cell = 2 * 64 * 2
    assert kv_layer_nbytes(g, 5, kv) == 32768 * cell  # global layer
    assert kv_layer_nbytes(g, 0, kv) == 1024 * cell  # pad256(512 + 512)
    assert kv_layer_nbytes(g, 0, KVShape(32768, kv_type="q8_0")) == 1024 * 2 * 64 // 32 * 34
    cm = CostModel(g, toy_profile(), W)
    assert cm.attention_seconds(0, 1, 20000, Loc(PINNED)) < cm.attention_seconds(
        5, 1, 20000, Loc(PINNED)
    )


def test_cpu_output_head_reads_the_whole_vocabulary_per_token():
    cm = CostModel(DENSE, toy_profile(), W)
    head = next(g for g in cm.groups if g.name == "output")
    assert cm.cpu_seconds(head, 1) == pytest.approx(head.nbytes / 10e9)
    assert head.nbytes >= 32000 * 1024 * 2


def test_launch_overhead_per_kernel_or_per_graph():
    prof = toy_profile()
    gpu = prof.gpus[0]
    object.__setattr__(gpu, "launch_seconds", Figure(10e-6, "toy"))
    object.__setattr__(gpu, "graph_kernel_seconds", Figure(1e-6, "toy"))
    cm = CostModel(DENSE, prof, W)
    assert cm.launch_seconds(12, 1) == pytest.approx(12e-6)  # decode replays a graph
    assert cm.launch_seconds(12, 512) == pytest.approx(120e-6)


def test_hops_are_charged_when_a_layer_changes_device():
    prof = toy_profile()
    object.__setattr__(prof.cpu, "sync_seconds", Figure(50e-6, "toy"))
    cm = CostModel(DENSE, prof, W)
    all_gpu = place(DENSE, lambda g: Loc(PINNED))
    ffn_cpu = place(DENSE, lambda g: Loc(CPU) if "ffn" in g.name else Loc(PINNED))
    a = cm.layer_terms(0, all_gpu, 1, 100, False)
    b = cm.layer_terms(0, ffn_cpu, 1, 100, True)
    assert a.latency == pytest.approx(cm.launch_seconds(8 + 4, 1))
    # one hop GPU -> CPU (attention side to FFN): sync + 4 B x 4096 activations at 10 GB/s
    assert b.latency - cm.launch_seconds(8 + 1, 1) == pytest.approx(50e-6 + 4 * 4096 / 10e9)


def test_evaluate_a_request_end_to_end():
    all_gpu = place(DENSE, lambda g: Loc(PINNED))
    tiers = {1: all_gpu, 512: all_gpu}
    p = evaluate(tiers, DENSE, toy_profile(), W)
    cm = CostModel(DENSE, toy_profile(), W)
    assert p.ttft_seconds == pytest.approx(cm.ubatch_terms(all_gpu, 512, 0).total)
    step0, step1 = cm.ubatch_terms(all_gpu, 1, 512).total, cm.ubatch_terms(all_gpu, 1, 612).total
    assert p.decode_seconds == pytest.approx(100 * (step0 + step1) / 2)
    assert p.tps == pytest.approx(100 / p.decode_seconds)
    assert p.switch_seconds == 0 and p.e2e_seconds == pytest.approx(
        p.ttft_seconds + p.decode_seconds
    )


def test_llamacpp_on_the_cpu_alone_offloads_nothing():
    """llama-bench without a GPU computes a 512-token prompt on the CPU; with one, llama.cpp
    copies CPU-held weights up for ubatches of 32 tokens and more (op-offload)."""
    from refengine.models import load_model
    from solver.cpu_tests import all_on_cpu, cpu_cost_model
    from solver.solve import load_profile

    spec = load_model("smollm2-135m")
    alone = cpu_cost_model(spec, load_profile("h100"), "llamacpp", 2, 1024)
    t = alone.ubatch_terms(all_on_cpu(spec), 512, 0)
    assert t.copy == 0 and t.gpu == 0 and t.cpu > 0 and t.total == pytest.approx(t.cpu)
    with_gpu = CostModel(spec, load_profile("h100"), alone.w, "llamacpp")
    t = with_gpu.ubatch_terms(all_on_cpu(spec), 512, 0)
    assert t.copy > 0 and t.gpu > 0


def test_routed_layers_are_priced_as_measured():
    """Each system's routed layer's own fixed cost where measured (not a dense layer's); ours: a
    routed stack's experts at prefill at the q8 rows' rate on the tokens each expert drew (not the fp32
    panels' BLAS rate); llama.cpp's decode attention, unmeasured: the cache bytes its query heads
    read at the host's bandwidth times a calibrated efficiency."""
    f = lambda v: Figure(v, "toy")  # noqa: E731
    base = toy_profile()
    hp = MOE.hparams
    experts = next(g for g in CostModel(MOE, base, W).groups if g.kind == "experts")
    q8 = RateTable("GFLOP/s", {experts.qtype: {8: f(40.0), 64: f(80.0)}})
    measured = replace(base, cpu=replace(
        base.cpu, layer_seconds=f(3e-5), routed_layer_seconds=f(9e-5), q8_matmul_gflops=q8,
        llamacpp_layer_seconds=f(2e-5), llamacpp_routed_layer_seconds=f(5e-5)))  # fmt: skip
    dense_fixed = replace(measured, cpu=replace(measured.cpu, routed_layer_seconds=None,
                                                llamacpp_routed_layer_seconds=None))  # fmt: skip
    ours, cpu = CostModel(MOE, measured, W), Loc(CPU)
    attn = next(g for g in ours.groups if g.name == "blk.0.attn")
    for target, more in (("refengine", 9e-5 - 3e-5), ("llamacpp", 5e-5 - 2e-5)):
        assert CostModel(MOE, measured, W, target).cpu_seconds(attn, 1) - CostModel(
            MOE, dense_fixed, W, target).cpu_seconds(attn, 1) == pytest.approx(more)
    per_expert = 512 * hp.n_expert_used / expected_distinct_experts(hp.n_expert,
                                                                    hp.n_expert_used, 512)
    nbytes, flops = ours.work(experts, 512)
    assert ours.cpu_seconds(experts, 512) == pytest.approx(
        max(nbytes / 10e9, flops / (q8.at(experts.qtype, round(per_expert)) * 1e9)))
    llama = CostModel(MOE, measured, W, "llamacpp")
    kv_read = 1001 * llama.cell_nbytes * hp.n_head / hp.n_head_kv
    assert llama.attention_seconds(0, 1, 1000, cpu) == (
        pytest.approx(kv_read / (20e9 * GGML_CPU_ATTENTION_EFFICIENCY)))


def test_routed_experts_are_priced_at_their_own_measured_rates_and_starts():
    """Where measured: each expert a decode chose adds its start to the routed layer's fixed cost
    (ours and llama.cpp's); llama.cpp's experts read at its mul_mat_id's decode rate and, on a
    prompt, multiply at its rate for the tokens each expert drew, not its dense products'."""
    f = lambda v: Figure(v, "toy")  # noqa: E731
    base = toy_profile()
    hp = MOE.hparams
    rates = RateTable("GFLOP/s", {ANY_TYPE: {16: f(20.0), 128: f(40.0)}})
    measured = replace(base, cpu=replace(
        base.cpu, layer_seconds=f(3e-5), routed_layer_seconds=f(9e-5), expert_seconds=f(1e-5),
        llamacpp_layer_seconds=f(2e-5), llamacpp_routed_layer_seconds=f(5e-5),
        llamacpp_expert_seconds=f(2e-5), llamacpp_expert_gflops=rates,
        llamacpp_expert_gbps=f(5.0)))  # fmt: skip
    unmeasured = replace(measured, cpu=replace(measured.cpu, expert_seconds=None,
                                               llamacpp_expert_seconds=None))  # fmt: skip
    attn = next(g for g in CostModel(MOE, base, W).groups if g.name == "blk.0.attn")
    for target, each in (("refengine", 1e-5), ("llamacpp", 2e-5)):
        more = CostModel(MOE, measured, W, target).cpu_seconds(attn, 1) - CostModel(
            MOE, unmeasured, W, target).cpu_seconds(attn, 1)
        assert more == pytest.approx(hp.n_expert_used * each)
    llama = CostModel(MOE, measured, W, "llamacpp")
    experts = next(g for g in llama.groups if g.kind == "experts")
    nbytes, _ = llama.work(experts, 1)
    assert llama.cpu_seconds(experts, 1) == pytest.approx(nbytes / 5e9)
    drawn = round(512 * hp.n_expert_used / expected_distinct_experts(hp.n_expert,
                                                                     hp.n_expert_used, 512))
    nbytes, flops = llama.work(experts, 512)
    assert llama.cpu_seconds(experts, 512) == pytest.approx(
        max(nbytes / 5e9, flops / (rates.at(experts.qtype, drawn) * 1e9)))


def test_the_head_of_a_decode_is_priced_by_its_rows_and_bytes_where_measured():
    """Where the profile measured the output head apart (its rows' own cost, its bytes' rate on
    Q8_0), a decode token's head costs its rows at that cost and its bytes at that rate (scaled
    by its type's matvec ratio to Q8_0), each system by its own figures; a layer's matrices and a
    prompt's head are not priced by them."""
    f = lambda v: Figure(v, "toy")  # noqa: E731
    base = toy_profile()
    measured = replace(base, cpu=replace(base.cpu, head_row_seconds=f(1e-9), head_gbps=f(40.0),
                                         llamacpp_head_row_seconds=f(2e-8),
                                         llamacpp_head_gbps=f(50.0)))  # fmt: skip
    hp = DENSE.hparams
    for target, each, gbps in (("refengine", 1e-9, 40.0), ("llamacpp", 2e-8, 50.0)):
        with_head, without = (CostModel(DENSE, p, W, target) for p in (measured, base))
        head = next(g for g in with_head.groups if g.name == "output")
        assert with_head.cpu_seconds(head, 1) == pytest.approx(
            head.nbytes / (gbps * 1e9) + hp.n_vocab * each), target  # Q8_0: ratio 1
        assert with_head.cpu_seconds(head, 64) == without.cpu_seconds(head, 64)
        up = next(g for g in with_head.groups if g.name == "blk.0.ffn_up")
        assert with_head.cpu_seconds(up, 1) == without.cpu_seconds(up, 1)


def test_twins_of_equal_bytes_and_unequal_rows_give_the_cost_per_byte_and_per_row(tmp_path):
    """The row twins' decode times, made from a known rate and cost per row, give both back."""
    from cudarun.measure_cpu import decode_rows, row_seconds_and_gbps, row_twin_config
    from cudarun.measure_cpu import token_nbytes
    from refengine.spec import load_spec
    from refengine.synthetic import write_synthetic

    specs = [load_spec(str(write_synthetic(tmp_path / f"{w}.gguf", row_twin_config(w, v))))
             for w, v in ((128, 16384), (512, 4096))]  # fmt: skip
    gbps, per_row = 40.0, 2e-8
    seconds = tuple(token_nbytes(s) / (gbps * 1e9) + decode_rows(s) * per_row for s in specs)
    assert row_seconds_and_gbps(seconds, specs) == pytest.approx((per_row, gbps))
    # with a decoded token's own cost in both times, given apart
    assert row_seconds_and_gbps(tuple(t + 3e-4 for t in seconds), specs, 3e-4) == pytest.approx(
        (per_row, gbps))
    # times that no positive rate and row cost give (a negative cost per byte, then per row):
    # the bytes take both times, the rows go free
    nbytes = [token_nbytes(s) for s in specs]
    for noisy in ((seconds[0] * 3, seconds[1]), (seconds[0], seconds[1] * 3)):
        fitted = sum(b * t for b, t in zip(nbytes, noisy)) / sum(b * b for b in nbytes)
        assert row_seconds_and_gbps(noisy, specs) == pytest.approx((0.0, 1 / fitted / 1e9))
    # the head's rows and the layer's: 16384 + 128 x 4 + 256 x 2 + 128 for the narrow twin
    assert decode_rows(specs[0]) == 16384 + 4 * 128 + 2 * 256 + 128


def test_llamacpp_attention_is_priced_per_query_head_and_key_as_measured():
    """Where the profile measured llama.cpp's CPU attention, a prompt's costs query heads x tokens x
    keys (causal: depth + (tokens + 1) / 2 on average) x the per-score time of its head size at its
    span of keys, interpolated in log(span) between the depths measured and held beyond them, then
    in log(KV heads) between the twins' KV heads; a decode's the same from its own table; a table
    of one '*' row holds at every depth; our prompts are not priced by them."""
    f = lambda v: Figure(v, "toy")  # noqa: E731
    base = toy_profile()
    prompt = RateTable("s", {"1000": {64: f(2e-7), 256: f(4e-7)},  # head 128: 3e-7, log-midway
                             "4000": {64: f(4e-7), 256: f(8e-7)},  # 6e-7
                             "1000@8": {64: f(8e-7), 256: f(1.6e-6)}})  # 1.2e-6, at every depth
    decode = RateTable("s", {"2000": {64: f(1e-6), 256: f(3e-6)}})  # 2e-6
    measured = replace(base, cpu=replace(base.cpu, llamacpp_prompt_score_seconds=prompt,
                                         llamacpp_decode_score_seconds=decode))  # fmt: skip
    gqa = spec_from_hparams(SyntheticConfig("llama", n_layer=2, n_embd=1024, n_ff=4096, n_head=8,
                                           n_head_kv=2, n_vocab=32000, qtype="F16"))
    cpu, hp = Loc(CPU), gqa.hparams
    assert hp.head_dim == 128
    llama = CostModel(gqa, measured, W, "llamacpp")
    keys = 1000 + (512 + 1) / 2
    score = 3e-7 + 3e-7 * math.log(keys / 1000) / math.log(4)
    assert llama.attention_seconds(0, 512, 1000, cpu) == pytest.approx(
        hp.n_head * 512 * keys * score)
    assert llama.attention_seconds(0, 512, 8000, cpu) == pytest.approx(
        hp.n_head * 512 * (8000 + 256.5) * 6e-7)
    assert llama.attention_seconds(0, 1, 1000, cpu) == pytest.approx(hp.n_head * 1001 * 2e-6)
    depths = np.array([1000.0, 8000.0])
    assert llama.attention_seconds(0, 512, depths, cpu) == pytest.approx(
        [llama.attention_seconds(0, 512, d, cpu) for d in (1000, 8000)])
    old = replace(base, cpu=replace(base.cpu, llamacpp_prompt_score_seconds=RateTable(
        "s", {ANY_TYPE: {64: f(2e-7), 256: f(4e-7)}})))
    assert CostModel(gqa, old, W, "llamacpp").attention_seconds(0, 512, 8000, cpu) == (
        pytest.approx(hp.n_head * 512 * (8000 + 256.5) * 3e-7))
    assert CostModel(gqa, measured, W).attention_seconds(0, 512, 1000, cpu) == (
        CostModel(gqa, base, W).attention_seconds(0, 512, 1000, cpu))
    # more KV heads: the wider twins' row, and log-midway between them at 4
    for kv, at in ((8, 1.2e-6), (16, 1.2e-6), (4, (6e-7 + 1.2e-6) / 2)):
        wider = spec_from_hparams(replace(SyntheticConfig(
            "llama", n_layer=2, n_embd=1024, n_ff=4096, n_head=8, n_head_kv=2, n_vocab=32000,
            qtype="F16"), n_head=16, n_head_kv=kv, head_dim=128))
        assert CostModel(wider, measured, W, "llamacpp").attention_seconds(
            0, 512, 8000, cpu) == pytest.approx(16 * 512 * (8000 + 256.5) * at)


def test_our_decode_attention_is_priced_per_query_head_and_key_as_measured():
    """Where the profile measured our fused decode's attention, a decode token's costs query heads
    x keys x the head size's per-score time (here above the cache's read time); llama.cpp's and a
    prompt's are not priced by it."""
    f = lambda v: Figure(v, "toy")  # noqa: E731
    base = toy_profile()
    measured = replace(base, cpu=replace(base.cpu, decode_score_seconds=RateTable(
        "s", {ANY_TYPE: {64: f(2e-7), 256: f(4e-7)}})))  # head 128: 3e-7, log-midway
    cpu, hp = Loc(CPU), DENSE.hparams
    ours = CostModel(DENSE, measured, W)
    assert ours.attention_seconds(0, 1, 1000, cpu) == pytest.approx(hp.n_head * 1001 * 3e-7)
    for target, tokens in (("llamacpp", 1), ("refengine", 512)):
        assert CostModel(DENSE, measured, W, target).attention_seconds(0, tokens, 1000, cpu) == (
            CostModel(DENSE, base, W, target).attention_seconds(0, tokens, 1000, cpu))


def test_our_decode_attention_below_the_parallel_pairs_runs_on_one_thread():
    """Under HOST_ATTENTION_PARALLEL_PAIRS (cell, query head) pairs our host scores a decode's
    cells on one thread: each score costs the profile's threads times the measured (parallel)
    figure; at the pairs and above, the figure itself."""
    from solver.cost import HOST_ATTENTION_PARALLEL_PAIRS

    base = toy_profile()
    measured = replace(base, cpu=replace(base.cpu, threads=4, decode_score_seconds=RateTable(
        "s", {ANY_TYPE: {128: Figure(3e-7, "toy")}})))  # fmt: skip
    hp = DENSE.hparams
    assert hp.head_dim == 128
    ours = CostModel(DENSE, measured, W)
    edge = HOST_ATTENTION_PARALLEL_PAIRS // hp.n_head  # keys at which the pairs are reached
    for keys, threads in ((edge - 8, 4), (edge + 8, 1)):
        assert ours.attention_seconds(0, 1, keys - 1, Loc(CPU)) == pytest.approx(
            hp.n_head * keys * 3e-7 * threads)


def test_a_prompt_pays_a_dequantize_and_a_product_launch_per_fp16_panel(monkeypatch):
    """Past the matvec tokens each product on our runtime dequantizes fp16 panels and calls cuBLAS
    per panel, each a launch from Python (an 8B prompt on 256-row panels ran 10x slower than on
    4096-row ones on an H200): smaller panels, two more launches for each panel more."""
    import math

    from solver import workspace

    pinned = place(DENSE, lambda g: Loc(PINNED))
    base = toy_profile()
    prof = replace(base, gpus=(replace(base.gpus[0], launch_seconds=Figure(2e-5, "toy")),))
    rows = [t.shape[0] for t in DENSE.tensors if t.layer == 0 and len(t.shape) == 2]
    sized = workspace.panel_rows(DENSE)
    latency = {}
    for panel in (sized, 256):
        monkeypatch.setattr(workspace, "panel_rows", lambda spec, r=panel: r)
        latency[panel] = CostModel(DENSE, prof, W).layer_terms(0, pinned, 512, 0, False).latency
    extra = sum(math.ceil(r / 256) - math.ceil(r / sized) for r in rows)
    assert sized > 256 and extra > 0
    launch_seconds = prof.gpus[0].launch_seconds.value
    assert latency[256] - latency[sized] == pytest.approx(2 * extra * launch_seconds)


def test_llamacpp_prompt_products_pay_their_measured_cost_beyond_their_flops():
    """Where measured, a prompt token costs llama.cpp's CPU products a layer's figure beyond their
    FLOPs (a llama layer's seven products share it: the attention side 4, each FFN matrix 1) and
    each routed stack its share of each chosen expert's and of the routed layer's own, by the
    group's type and prompt tokens; a decode pays none, nor does our engine."""
    f = lambda v: Figure(v, "toy")  # noqa: E731
    base = toy_profile()
    layer = RateTable("s", {ANY_TYPE: {64: f(1e-6), 512: f(2e-6)}})
    slot = RateTable("s", {"Q6_K": {512: f(9e-7)}, ANY_TYPE: {64: f(3e-7), 512: f(5e-7)}})
    own = RateTable("s", {"Q6_K": {512: f(7e-6)}, ANY_TYPE: {64: f(2e-6), 512: f(4e-6)}})
    rates = RateTable("GFLOP/s", {ANY_TYPE: {64: f(100.0)}})
    plain = replace(base, cpu=replace(base.cpu, llamacpp_matmul_gflops=rates,
                                      llamacpp_expert_gflops=rates))  # fmt: skip
    measured = replace(plain, cpu=replace(plain.cpu, llamacpp_prompt_layer_seconds=layer,
                                          llamacpp_expert_slot_seconds=slot,
                                          llamacpp_routed_token_seconds=own))  # fmt: skip

    def beyond(spec, target, tokens, il):
        cms = [CostModel(spec, p, W, target) for p in (measured, plain)]
        return sum(cms[0].cpu_seconds(g, tokens) - cms[1].cpu_seconds(g, tokens)
                   for g in cms[0].groups if g.layer == il)  # fmt: skip

    for tokens, per_layer in ((512, 2e-6), (64, 1e-6)):
        assert beyond(DENSE, "llamacpp", tokens, 0) == pytest.approx(tokens * per_layer)
    hp = ROUTED_MIX.hparams
    downs = {il: ROUTED_MIX.by_name[f"blk.{il}.ffn_down_exps.weight"].qtype.name for il in (0, 1)}
    assert sorted(downs.values()) == ["Q4_K", "Q6_K"]  # one layer of each
    for il, down in downs.items():
        slots = 2 * 5e-7 + (9e-7 if down == "Q6_K" else 5e-7)  # its three stacks' shares, x 3
        owns = 2 * 4e-6 + (7e-6 if down == "Q6_K" else 4e-6)
        assert beyond(ROUTED_MIX, "llamacpp", 512, il) == pytest.approx(
            512 * (2e-6 * 4 / 7 + (hp.n_expert_used * slots + owns) / 3))
    assert beyond(ROUTED_MIX, "llamacpp", 64, 0) == pytest.approx(
        64 * (1e-6 * 4 / 7 + hp.n_expert_used * 3e-7 + 2e-6))
    for spec in (DENSE, ROUTED_MIX):
        assert beyond(spec, "llamacpp", 1, 0) == 0.0
        assert beyond(spec, "refengine", 512, 0) == 0.0


def test_layer_twins_of_unequal_bytes_give_a_decode_layers_rate_and_fixed_cost(tmp_path,
                                                                               monkeypatch):
    """The small layer twins' and the big twin's decode times, made from a known token cost,
    layer cost and rate, give the rate and the layer cost back; times that no positive rate
    gives are refused (the profile then keeps the lone matvec's rate)."""
    from cudarun import measure_cpu
    from refengine.spec import load_spec
    from refengine.synthetic import write_synthetic

    configs = [measure_cpu.layer_config(n, quick=True) for n in measure_cpu.TINY_LAYERS]
    configs.append(measure_cpu.big_layer_config(True))
    specs = [load_spec(str(write_synthetic(tmp_path / f"{i}.gguf", c)))
             for i, c in enumerate(configs)]  # fmt: skip
    token, per_layer, gbps = 3e-4, 5e-5, 22.0
    seconds = [token + s.hparams.n_layer * per_layer
               + measure_cpu.token_nbytes(s) / (gbps * 1e9) for s in specs]  # fmt: skip
    monkeypatch.setattr(measure_cpu, "twin_decode_seconds",
                        lambda *a, **k: (list(seconds), specs))  # fmt: skip
    assert measure_cpu.layer_rate_and_fixed(2, True, "Q8_0") == pytest.approx((gbps, per_layer))
    seconds[2] = seconds[0]  # the big twin no slower than the small one: no rate
    assert measure_cpu.layer_rate_and_fixed(2, True, "Q8_0") is None


def test_llamacpp_layer_twins_read_past_the_cache(tmp_path):
    """llama.cpp's layer twins each read more a token than its decode ran from the cache here
    (up to 77 MB at 20-25 GB/s, from 116 MB at ~12): a line through twins on both sides of that
    cliff gave a layer cost of 81-152 us by the hour."""
    from cudarun import measure_cpu
    from cudarun.measure_llamacpp import llamacpp_layer_counts
    from refengine.spec import load_spec
    from refengine.synthetic import write_synthetic

    one = load_spec(str(write_synthetic(tmp_path / "one.gguf", measure_cpu.layer_config(1))))
    per_layer = measure_cpu.layer_read_nbytes(one)
    assert min(llamacpp_layer_counts(False)) * per_layer > 100e6
