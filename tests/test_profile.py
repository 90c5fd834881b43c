import json
import re
from pathlib import Path

import pytest

from refengine.errors import UserError
from solver.profile import ANY_TYPE, Figure, HardwareProfile, RateTable

from .conftest import GPU, refengine

PROFILES = Path(__file__).resolve().parents[1] / "examples" / "profiles"
SHIPPED = sorted(PROFILES.glob("*.json"))


def test_rate_table_interpolates_in_log_tokens_and_falls_back_to_any_type():
    t = RateTable(
        "TFLOP/s",
        {"Q4_K": {16: Figure(10.0, "x"), 256: Figure(50.0, "x")}, ANY_TYPE: {1: Figure(7.0, "x")}},
    )
    assert t.at("Q4_K", 1) == 10.0 and t.at("Q4_K", 4096) == 50.0
    assert t.at("Q4_K", 64) == pytest.approx(30.0)  # halfway between 16 and 256 in log
    assert t.at("Q8_0", 512) == 7.0
    with pytest.raises(UserError, match="no TFLOP/s rate"):
        RateTable("TFLOP/s", {"Q4_K": {1: Figure(1.0, "x")}}).at("Q8_0", 1)


def test_a_rate_over_a_difference_of_twins_needs_the_difference_above_its_noise():
    from cudarun.measure_llamacpp import difference_seconds, measured_differences

    assert difference_seconds([2.0, 2.1, 1.9], [1.0, 1.1, 0.9]) == pytest.approx(1.0)
    # a loaded machine: the slow twin's runs spread over the fast one's
    assert difference_seconds([1.3, 0.9, 1.2], [1.0, 1.4, 0.8]) is None
    assert difference_seconds([1.0, 1.1, 0.9], [1.0, 1.1, 0.9]) is None

    def record(*seconds):
        return {"samples_ts": [1.0 / s for s in seconds]}

    calls = []

    def twins(runs):  # tg's difference is clear; pp's is lost in the first runs, not the second
        calls.append(runs)
        spread = (1.0, 1.3, 0.7) if len(calls) == 1 else (1.0, 1.05, 0.95)
        pp = [1.5 * s for s in spread] * (runs // 3)
        return ({"tg": record(*[2.0] * runs), "pp": record(*pp)},
                {"tg": record(*[1.0] * runs), "pp": record(*[1.0] * runs)})

    differences = measured_differences(twins, 1)
    assert calls == [3, 6]  # at least three runs a side, then twice as many, pooled
    assert differences["tg"] == pytest.approx(1.0)
    assert differences["pp"] == pytest.approx(0.5)
    calls.clear()

    def noisy(runs):
        calls.append(runs)
        return {"tg": record(*[1.0, 1.6, 0.4] * (runs // 3))}, {"tg": record(*[1.0] * runs)}

    assert measured_differences(noisy, 3) == {"tg": None} and calls == [3, 6]


def test_a_table_of_differences_all_lost_in_the_noise_is_no_table_and_prices_nothing_beyond():
    """CI's busy cores once lost every type's difference of llama.cpp's layer twins: the empty
    table had no row to price a type by, and a llamacpp-target prompt raised. Now no table: the
    products' FLOPs alone, as for a profile that never measured it."""
    from dataclasses import replace

    from cudarun.measure_llamacpp import table_or_none
    from refengine.synthetic import SyntheticConfig, spec_from_hparams
    from solver.cpu_tests import cpu_cost_model, prompt_seconds
    from solver.solve import load_profile

    assert table_or_none("s", {"Q8_0": {}, "Q4_K": {}}, "Q8_0") is None
    table = table_or_none("s", {"Q8_0": {}, "Q4_K": {512: Figure(1e-5, "test")}}, "Q8_0")
    assert set(table.rows) == {"Q4_K", ANY_TYPE} and table.at("Q8_0", 512) == 1e-5
    # a profile that measured llama.cpp's CPU (sitting u's, on the EPYC)
    prof = load_profile(str(Path(__file__).parents[1] / "docs" / "measured"
                            / "2026-11-29-epyc-2core-profile-u.json"))  # fmt: skip
    spec = spec_from_hparams(SyntheticConfig("llama", n_layer=2, n_embd=256, n_ff=512, n_head=4,
                                             n_head_kv=4, n_vocab=512, qtype="Q8_0"))  # fmt: skip
    none = replace(prof, cpu=replace(prof.cpu, llamacpp_prompt_layer_seconds=None))
    some = replace(prof, cpu=replace(prof.cpu, llamacpp_prompt_layer_seconds=table))
    seconds = [prompt_seconds(cpu_cost_model(spec, p, "llamacpp", 2, 2048), 512, 0)
               for p in (none, some)]  # fmt: skip
    assert 0 < seconds[0] < seconds[1]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_profiles_load_round_trip_and_cite_every_figure(path):
    prof = HardwareProfile.load(path)
    assert HardwareProfile.from_json(prof.to_json()) == prof
    text = json.loads(path.read_text())

    def sources(node):
        if isinstance(node, dict):
            if "source" in node:
                yield node["source"]
            for v in node.values():
                yield from sources(v)
        elif isinstance(node, list):
            for v in node:
                yield from sources(v)

    cited = list(sources(text))
    assert len(cited) >= 14  # 10 GPU figures, at least 4 CPU figures
    assert all(
        s.split(":")[0] in ("measured", "derived", "derived (not measured)", "datasheet", "public")
        for s in cited
    ), cited


def test_shipped_json_is_what_the_script_writes():
    from examples.profiles.shipped import SHIPPED as MAKERS

    for name, make in MAKERS.items():
        assert HardwareProfile.load(PROFILES / f"{name}.json") == make()


@pytest.mark.parametrize(
    "content,message",
    [
        ("{", "not JSON"),
        ('{"schema": "other"}', "not a refengine hardware profile"),
        ('{"schema": "refengine.hardware-profile", "version": 99}', "version 99"),
        (
            '{"schema": "refengine.hardware-profile", "version": 1, "gpus": [], "cpu": {}}',
            "missing",
        ),
    ],
)
def test_bad_profiles_are_user_errors(tmp_path, content, message):
    p = tmp_path / "p.json"
    p.write_text(content)
    with pytest.raises(UserError, match=message):
        HardwareProfile.load(p)


@pytest.mark.skipif(GPU, reason="this machine has a GPU to measure")
def test_profile_without_a_gpu_asks_for_a_gpu_side_in_one_line(tmp_path):
    r = refengine("profile", "-o", tmp_path / "me.json", "--quick")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "--gpu-from" in r.stderr
    assert not (tmp_path / "me.json").exists()


def test_an_rpc_server_is_a_device_with_its_hosts_rates_and_the_links_copies():
    from dataclasses import replace

    from solver.profile import rpc_device
    from solver.solve import load_profile

    base = load_profile("rtx4090-epyc-7742")  # the EPYC's rates measured at 64 threads
    link = Figure(1.25, "measured: 256 MiB set_tensor"), Figure(1.5, "measured"), Figure(2e-4, "m")
    dev = rpc_device(base.cpu, "10.0.0.2:50052", 16 << 30, 8, *link)
    assert dev.is_rpc and dev.endpoint == "10.0.0.2:50052" and not base.gpus[0].is_rpc
    assert dev.memory_bytes.value == 16 << 30 and dev.h2d_gbps.value == 1.25
    assert dev.copy_latency_seconds.value == 2e-4 and dev.launch_seconds.value == 0
    # 8 of the 64 threads the rates were taken at: an eighth of them
    cpu_q4k = base.cpu.matvec_gbps.at("Q4_K", 64)
    assert dev.matvec_gbps.at("Q4_K", 1) == pytest.approx(cpu_q4k / 8)
    gflops = base.cpu.matmul_gflops.at("Q4_K", 512)
    assert dev.matmul_tflops.at("Q4_K", 512) == pytest.approx(gflops / 8 / 1000)
    both = replace(base, gpus=base.gpus + (dev,))
    again = HardwareProfile.from_json(json.loads(json.dumps(both.to_json())))
    assert again == both and again.gpus[1].backend == "rpc"
    # profiles written before the backend existed load as CUDA devices
    old = base.to_json()
    for g in old["gpus"]:
        del g["backend"], g["endpoint"]
    assert HardwareProfile.from_json(old) == base


def test_profile_measures_the_cpu_and_llama_cpps_rates_which_price_the_llamacpp_target_only(
        tmp_path, llama_bin):  # fmt: skip
    """`profile --quick --llama-bin`: this CPU measured (the GPU side kept from another profile),
    and llama.cpp's own CPU matmul and decode rates by type (llama-bench on a synthetic model per
    type), which `--target llamacpp` prices CPU-held matrices at while our runtime keeps its own
    kernels' rates."""
    from dataclasses import replace

    from cudarun.kernels import q8_panel
    from cudarun.measure_cpu import TINY
    from cudarun.measure_llamacpp import CACHE_LADDER
    from refengine.synthetic import SyntheticConfig, spec_from_hparams
    from solver.cpu_tests import cpu_cost_model, generation_seconds, prompt_seconds

    out = tmp_path / "me.json"
    # the GPU side kept from a profile that was itself measured beside another CPU (test_cli: a
    # name that is none, one line), on one thread: CI's other worker holds one of its two cores,
    # and at llama.cpp's two threads the one sharing that core kept the other waiting a time
    # slice at each barrier (a quick profile there put llama.cpp's attention at more than 1 us a
    # query head, token and key, ~700x a quiet host's)
    h100 = json.loads((PROFILES / "h100.json").read_text())
    h100["name"] = f"{h100['cpu']['name']} + h100"
    (tmp_path / "base.json").write_text(json.dumps(h100))
    r = refengine("profile", "-o", out, "--quick", "--threads", "1", "--gpu-from",
                  tmp_path / "base.json", "--llama-bin", llama_bin)  # fmt: skip
    assert r.returncode == 0, r.stderr
    prof = HardwareProfile.load(out)
    cpu = prof.cpu
    assert prof.name == f"{cpu.name} + h100"  # the kept side's CPU not named again
    # not on a terminal (a log): a line a phase, stamped with the time it began
    stamped = [line[9:] for line in r.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d ", line)]
    assert {"host memory bandwidth", "llama.cpp's decode from the cache"} <= set(stamped)
    # the CPU measured, the GPU side kept (one quick profile in the suite: two at once on CI's
    # two cores measured each other's load)
    assert prof.gpus == HardwareProfile.load(PROFILES / "h100.json").gpus
    assert cpu.memory_gbps.value > 0.5
    # a rate fitted beside a per-row cost on the quick profile's in-cache twins, which CI's two
    # busy cores read anywhere from 0.48 to 1030 GB/s beside 8.4 GB/s of memory: a bound no two
    # threads' cache reach: a slip of units (x1e3) crosses it, the host's load does not
    cache_bound = 1e4
    # a fixed cost per layer or expert: tens of microseconds on a quiet host, but a difference of
    # two quick runs, which CI's busy cores put at 1.97 ms for llama.cpp's layer: 10 ms still
    # catches a slip of units (s for ms is x1e3)
    fixed_bound = 1e-2
    assert "q8 path" in cpu.matvec_gbps.rows["Q4_K"][cpu.threads].source
    assert cpu.matmul_gflops.at("Q8_0", 512) > 1.0
    # a prompt's products on int8 tiles, for exactly the types that repack
    assert set(cpu.tile_gflops.rows) == {t for t in cpu.matmul_gflops.rows
                                         if t in {q.name for q in q8_panel.INTS}}  # fmt: skip
    assert {"Q4_K", "Q6_K", "Q8_0"} <= set(cpu.tile_gflops.rows)
    assert "q8gemm path" in cpu.tile_gflops.rows["Q4_K"][512].source
    assert 0 < cpu.quantize_value_seconds.value < 1e-6  # ~2 ns a value on one thread
    # our host prefill's attention and gated activation, beyond the matrices; our decode's
    # attention, a layer's and a routed layer's fixed cost, the q8 rows on several tokens
    assert 0 < cpu.attention_score_seconds.at(ANY_TYPE, 64) < 1e-6
    assert 0 < cpu.glu_element_seconds.value < 1e-6 and "serial" in cpu.glu_element_seconds.source
    assert 0 < cpu.rope_angle_seconds.value < 1e-6 and 0 < cpu.rope_element_seconds.value < 1e-6
    assert 0 <= cpu.layer_seconds.value < fixed_bound
    assert "per layer" in cpu.layer_seconds.source
    assert cpu.layer_type_seconds.at("Q8_0", cpu.threads) == cpu.layer_seconds.value  # its twins
    # the twins' own gated activation inside those figures: their FFN's SiLU
    assert cpu.layer_activation_seconds.value == pytest.approx(
        TINY["n_ff"] * cpu.glu_element_seconds.value)
    assert 0 < cpu.decode_score_seconds.at(ANY_TYPE, 128) < 1e-6
    assert cpu.routed_layer_seconds.value >= 0 and "qwen3moe" in cpu.routed_layer_seconds.source
    slot = cpu.routed_slot_seconds
    assert 0 <= slot.value < 1e-6 and "per slot" in slot.source
    assert 0 <= cpu.expert_seconds.value < fixed_bound and "per expert" in cpu.expert_seconds.source
    assert cpu.expert_type_seconds.at("Q8_0", cpu.threads) == cpu.expert_seconds.value  # twins
    assert 0 <= cpu.routed_handoff_seconds.value < 0.05  # a product's toll after Numba's kernel
    assert 0 <= cpu.head_row_seconds.value < 1e-6 and 0.1 < cpu.head_gbps.value < cache_bound
    assert 0 <= cpu.token_seconds.value < 0.01 and "intercept" in cpu.token_seconds.source
    beyond = cpu.prompt_layer_element_seconds  # ns an element where measured beside its price
    assert 0 <= beyond.value < 1e-6 and "per token and element of n_embd" in beyond.source
    assert cpu.q8_matmul_gflops.at("Q4_K", 8) > 1 and "q8 path" in (
        cpu.q8_matmul_gflops.rows["Q4_K"][64].source)
    # llama.cpp's own rows
    assert set(cpu.llamacpp_matmul_gflops.rows) >= {"Q4_K", "Q6_K", "Q8_0", "F16"}
    assert "llama-bench" in cpu.llamacpp_matmul_gflops.rows["Q4_K"][512].source
    # its decode read on the quick profile's small wide twin, which CI's busy cores put at 0.39
    # GB/s beside 15.2 of memory: bound by this host's own memory rate, which a slip of units
    # (x1e-3) falls under and the host's load does not
    matvec = cpu.llamacpp_matvec_gbps.at("Q4_K", cpu.threads)
    assert cpu.memory_gbps.value / 100 < matvec < cache_bound
    assert 0 <= cpu.llamacpp_layer_seconds.value < fixed_bound
    # its decode from the cache, by bytes a token reads: the ladder's deepest twin is the reference
    cached = cpu.llamacpp_decode_cache_speedup.rows[ANY_TYPE]
    assert len(cached) == len(CACHE_LADDER[True]) and cached[max(cached)].value == 1.0
    assert all(0 < x.value < 100 for x in cached.values()) and "deepest" in cached[max(cached)].source
    # (a difference of two quick runs: on CI's two busy cores it can clamp at 0)
    for scores in (cpu.llamacpp_prompt_score_seconds, cpu.llamacpp_decode_score_seconds):
        assert set(scores.rows) == {"256", "512", "256@8", "512@8"}
        assert all(0 <= scores.at_depth(d, 300) < 1e-6 for d in (64, 256))
        assert "per layer, query head, token and key" in scores.rows["512"][64].source
    assert "qwen3moe" in cpu.llamacpp_routed_layer_seconds.source
    assert 0 <= cpu.llamacpp_expert_seconds.value < fixed_bound
    assert 0 <= cpu.llamacpp_head_row_seconds.value < 1e-6
    assert 0.1 < cpu.llamacpp_head_gbps.value < cache_bound
    # its routed experts on a prompt, by the tokens an expert drew (8 experts, 2 used: 16 of 64)
    experts = cpu.llamacpp_expert_gflops.rows[ANY_TYPE] if cpu.llamacpp_expert_gflops else {}
    assert set(experts) <= {16, 128} and all(x.value > 0.5 for x in experts.values())
    decode = cpu.llamacpp_expert_gbps
    assert decode is None or 0.1 < decode.value < 10 * cpu.memory_gbps.value
    # by type: a layer's cost beyond its products' FLOPs, each expert chosen's beyond theirs (a
    # difference of two quick runs lost in the noise leaves that type's row out), a routed layer's
    # own beyond a dense FFN's
    for table in (cpu.llamacpp_prompt_layer_seconds, cpu.llamacpp_expert_slot_seconds,
                  cpu.llamacpp_routed_token_seconds):
        rows = table.rows if table else {}
        assert set(rows) <= {*cpu.llamacpp_matmul_gflops.rows, ANY_TYPE}
        assert all(0 <= x.value < fixed_bound for row in rows.values() for x in row.values())
    # Q8_0 matrices wide enough that they, not the prompt's attention, take a prompt's time
    spec = spec_from_hparams(SyntheticConfig("llama", n_layer=2, n_embd=1024, n_ff=4096,
                                             n_head=8, n_head_kv=8, n_vocab=512, qtype="Q8_0"))
    mine = replace(cpu, llamacpp_matmul_gflops=RateTable("GFLOP/s", {"Q8_0": {512: Figure(
        cpu.llamacpp_matmul_gflops.at("Q8_0", 512) / 10, "test")}}))  # fmt: skip
    slower = replace(prof, cpu=mine)
    for target, changes in (("llamacpp", True), ("refengine", False)):
        seconds = [prompt_seconds(cpu_cost_model(spec, p, target, cpu.threads, 2048), 512, 0)
                   for p in (prof, slower)]  # fmt: skip
        assert (seconds[1] > 1.5 * seconds[0]) == changes, (target, seconds)
    # a profile written before these rows loads, and prices llama.cpp at our kernels' rates
    d = json.loads(out.read_text())
    del d["cpu"]["llamacpp_matmul_gflops"], d["cpu"]["llamacpp_matvec_gbps"]
    old = HardwareProfile.from_json(d)
    assert old.cpu.llamacpp_matmul_gflops is None
    assert generation_seconds(cpu_cost_model(spec, old, "llamacpp", cpu.threads, 2048), 4, 0) > 0
