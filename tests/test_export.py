"""Exported llama.cpp flags mean exactly the plan: llama.cpp's own rules (-ngl counting the
output layer, -ot searched in order with the first match winning) applied to the flags recover
every tensor's device."""

import re

import pytest

from refengine.errors import UserError
from refengine.synthetic import SyntheticConfig, spec_from_hparams
from solver.cost import CPU, PINNED, STREAMED, Loc, TierPlacement, Workload, evaluate
from solver.export import (
    apply_llamacpp_args,
    layers_regex,
    llama_bench_args,
    llamacpp_args,
    tensor_devices,
)
from solver.groups import tensor_groups
from solver.optimize import agrees, optimize
from solver.strategies import STRATEGIES, Problem
from solver.usage import device_usage

from .test_strategies import DENSE_CFG, MOE_CFG, PROFILE

GIB = 2**30
MODELS = {
    "dense": DENSE_CFG,
    "tied": SyntheticConfig(
        "llama",
        n_layer=16,
        n_embd=2048,
        n_ff=8192,
        n_head=16,
        n_head_kv=4,
        head_dim=128,
        n_vocab=64000,
        qtype="Q4_K",
        tied_output=True,
    ),
    "moe": MOE_CFG,
}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("budget_gib", [1.5, 3, 5, 10])
def test_fit_plans_export_to_flags_that_recover_them(model, budget_gib):
    spec = spec_from_hparams(MODELS[model])
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    plan = STRATEGIES["fit"](Problem(spec, PROFILE, w, (1, 512), int(budget_gib * GIB), "llamacpp"))
    place = plan[1]  # the static placement (CPU-held weights op-offloaded at >= 32 tokens)
    args = llamacpp_args(spec, place, 8192, "f16", True)
    assert args[:2] == ["-fit", "off"] and "-ngl" in args
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    assert_patterns_disjoint(spec, args)


def assert_patterns_disjoint(spec, args):
    """No tensor is found by two -ot patterns, so their order cannot matter."""
    items = args[args.index("-ot") + 1].split(",") if "-ot" in args else []
    found = [{t.name for t in spec.tensors if re.search(i.split("=")[0], t.name)} for i in items]
    assert all(found) and sum(map(len, found)) == len(set().union(*found))


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("budget_gib", [1.5, 5])
def test_optimized_llamacpp_plans_export_and_never_lose_to_fit(model, budget_gib):
    spec = spec_from_hparams(MODELS[model])
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    p = Problem(spec, PROFILE, w, (1, 512), int(budget_gib * GIB), "llamacpp")
    fit = STRATEGIES["fit"](p)
    sol = optimize(p, hint=fit, time_limit_seconds=2)
    assert sol.tiers[1] == sol.tiers[512]  # one static placement: llama.cpp cannot switch
    place = sol.tiers[1]
    args = llamacpp_args(spec, place, 8192, "f16", True)
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    ours = evaluate(sol.tiers, spec, PROFILE, w, "llamacpp").e2e_seconds
    assert ours <= evaluate(fit, spec, PROFILE, w, "llamacpp").e2e_seconds * (1 + 1e-9)
    usage = device_usage(spec, tensor_groups(spec), place, 512, w, "llamacpp")
    assert usage.total <= budget_gib * GIB
    for program, evaluated in sol.program_check.values():  # one class of layers: exact hops
        assert agrees(program, evaluated)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_two_gpu_llamacpp_plans_export_with_tensor_split_counts(model):
    from dataclasses import replace

    spec = spec_from_hparams(MODELS[model])
    prof = replace(PROFILE, gpus=(PROFILE.gpus[0], replace(PROFILE.gpus[0], name="second")))
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    p = Problem(spec, prof, w, (1, 512), int(1.5 * GIB), "llamacpp", (int(1.0 * GIB),))
    sol = optimize(p, hint=STRATEGIES["fit"](p), time_limit_seconds=2)
    place = sol.tiers[512]
    args = llamacpp_args(spec, place, 8192, "f16", True, n_devices=2)
    assert "-ts" in args and args[args.index("-dev") + 1] == "CUDA0,CUDA1"
    ts = [int(x) for x in args[args.index("-ts") + 1].split(",")]
    assert sum(ts) == int(args[args.index("-ngl") + 1])
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    bench = llama_bench_args(args, spec.hparams.n_layer)  # llama-bench's lists take '/'
    assert bench[bench.index("-ts") + 1] == "/".join(map(str, ts))
    assert bench[bench.index("-dev") + 1] == "CUDA0/CUDA1"
    for d, budget in enumerate(p.budgets):
        assert device_usage(spec, tensor_groups(spec), place, 512, w, "llamacpp", d).total <= budget


def test_a_hand_made_mixed_placement_round_trips():
    spec = spec_from_hparams(MODELS["dense"])
    groups = tensor_groups(spec)
    locs = {g.name: Loc(PINNED) for g in groups}
    locs["token_embd"] = Loc(CPU)
    for il in range(0, 10):  # front layers on the CPU, with their KV
        for g in groups:
            if g.layer == il:
                locs[g.name] = Loc(CPU)
    locs["blk.15.ffn_down"] = Loc(CPU)  # a fractional layer
    locs["blk.3.attn"] = Loc(PINNED)  # attention of a CPU layer on the GPU
    kv = {il: Loc(CPU) if il < 10 else Loc(PINNED) for il in range(24)}
    place = TierPlacement(locs, kv)
    args = llamacpp_args(spec, place, 4096, "q8_0", True)
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    assert args[args.index("-ngl") + 1] == "15"  # output layer + 14 repeating layers
    assert_patterns_disjoint(spec, args)
    # front layers' FFN and attention each one pattern; blk.3.attn and blk.15.ffn_down moved
    assert args[args.index("-ot") + 1] == (
        "blk\\.3\\.(attn_(norm|q|k|v|output)|ffn_norm)\\.weight=CUDA0,"
        "blk\\.15\\.ffn_down\\.weight=CPU"
    )


def test_what_llamacpp_cannot_express_is_refused():
    spec = spec_from_hparams(MODELS["dense"])
    groups = tensor_groups(spec)
    streamed = TierPlacement(
        {g.name: Loc(STREAMED) for g in groups}, {il: Loc(PINNED) for il in range(24)}
    )
    with pytest.raises(UserError, match="cannot stream"):
        llamacpp_args(spec, streamed, 4096, "f16", True)
    holes = TierPlacement(
        {g.name: Loc(PINNED) for g in groups},
        {il: Loc(PINNED) if il % 2 else Loc(CPU) for il in range(24)},
    )
    with pytest.raises(UserError, match="suffix"):
        llamacpp_args(spec, holes, 4096, "f16", True)


def _placement(spec, on_cpu):
    """Every group on GPU 0 but the embedding and the groups named, every layer's KV on GPU 0."""
    locs = {
        g.name: Loc(CPU) if g.name in on_cpu or g.name == "token_embd" else Loc(PINNED)
        for g in tensor_groups(spec)
    }
    return TierPlacement(locs, {il: Loc(PINNED) for il in range(spec.hparams.n_layer)})


def _experts(spec, layers):
    return {g.name for g in tensor_groups(spec) if g.kind == "experts" and g.layer in layers}


def test_routed_experts_of_the_first_layers_are_n_cpu_moe():
    spec = spec_from_hparams(MODELS["moe"])  # 24 layers
    place = _placement(spec, _experts(spec, range(10)))
    args = llamacpp_args(spec, place, 4096, "f16", True)
    assert args[-2:] == ["--n-cpu-moe", "10"] and "-ot" not in args
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    # every layer's experts: --cpu-moe
    args = llamacpp_args(spec, _placement(spec, _experts(spec, range(24))), 4096, "f16", True)
    assert args[-1] == "--cpu-moe" and "-ot" not in args
    assert llama_bench_args(args, 24)[-2:] == ["-ncmoe", "24"]  # llama-bench has no --cpu-moe


def test_exceptions_to_n_cpu_moe_come_first():
    """llama.cpp appends -ot items and the --n-cpu-moe patterns to one list in command-line
    order and takes the first match: the exceptions must precede the flag."""
    spec = spec_from_hparams(MODELS["moe"])
    on_cpu = _experts(spec, range(6)) | {"blk.20.ffn_down_exps", "blk.2.attn", "blk.3.attn"}
    place = _placement(spec, on_cpu)
    args = llamacpp_args(spec, place, 4096, "f16", True)
    assert args[-4:] == [
        "-ot",
        "blk\\.[23]\\.(attn_(norm|q|k|v|q_norm|k_norm|output)|ffn_(norm|gate_inp))\\.weight=CPU,"
        "blk\\.20\\.ffn_down_exps\\.weight=CPU",
        "--n-cpu-moe",
        "6",
    ]
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    # an exception inside the first layers: layer 4's up experts stay on the GPU, so N stops at 4
    place = _placement(spec, on_cpu - {"blk.4.ffn_up_exps"})
    args = llamacpp_args(spec, place, 4096, "f16", True)
    assert args[-2:] == ["--n-cpu-moe", "4"]
    assert args[args.index("-ot") + 1].split(",")[1:] == [
        "blk\\.[45]\\.ffn_gate_exps\\.weight=CPU",  # one pattern per set of layers
        "blk\\.([45]|20)\\.ffn_down_exps\\.weight=CPU",
        "blk\\.5\\.ffn_up_exps\\.weight=CPU",
    ]
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
    # llama-bench: no context or fit flags; one -ot test whose patterns ';' separates; its
    # -ncmoe patterns also follow the -ot ones
    bench = llama_bench_args(args, 24)
    assert "-c" not in bench and "-fit" not in bench and bench[-2:] == ["-ncmoe", "4"]
    assert bench[bench.index("-ot") + 1] == args[args.index("-ot") + 1].replace(",", ";")
    # experts on the CPU only where -ngl leaves the whole layer anyway: no flag
    kv = {il: Loc(CPU) if il < 6 else Loc(PINNED) for il in range(24)}
    front = {g.name for g in tensor_groups(spec) if g.layer is not None and g.layer < 6}
    place = TierPlacement(_placement(spec, front).groups, kv)
    args = llamacpp_args(spec, place, 4096, "f16", True)
    assert "--n-cpu-moe" not in args and "-ot" not in args and args[args.index("-ngl") + 1] == "19"


def test_an_8b_plan_exports_in_a_few_short_patterns():
    """llama3-8b (spec only, 32 layers): the optimizer's llama.cpp plans at budgets that split
    layers. Each pattern names a set of layers once (runs as decimal ranges), not once per
    tensor name: 117-175 characters of -ot here, where one pattern per tensor name wrote 427-943."""
    from refengine.models import load_model_or_shape

    spec = load_model_or_shape("llama3-8b")
    w = Workload(n_ctx=8192, prompt_tokens=4000, gen_tokens=200)
    for budget_gib in (2, 3, 4):
        p = Problem(spec, PROFILE, w, (1, 512), int(budget_gib * GIB), "llamacpp")
        place = optimize(p, hint=STRATEGIES["fit"](p), time_limit_seconds=1).tiers[512]
        args = llamacpp_args(spec, place, 8192, "f16", True)
        assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)
        assert_patterns_disjoint(spec, args)
        ot = args[args.index("-ot") + 1] if "-ot" in args else ""
        assert len(ot) <= 200 and ot.count("=") <= 3, ot
    # the worst case for ranges: every other layer's FFN on the CPU
    ffn = {f"blk.{il}.ffn_{m}" for il in range(0, 32, 2) for m in ("gate", "up", "down")}
    place = _placement(spec, ffn)
    args = llamacpp_args(spec, place, 8192, "f16", True)
    assert args[args.index("-ot") + 1] == (
        "blk\\.(0|2|4|6|8|10|12|14|16|18|20|22|24|26|28|30)\\.ffn_(gate|up|down)\\.weight=CPU"
    )
    assert apply_llamacpp_args(spec, args) == tensor_devices(spec, place)


@pytest.mark.parametrize(
    "layers,regex",
    [([3, 4, 7], "([34]|7)"), (list(range(3, 31)), "([3-9]|[12][0-9]|30)"),
     (list(range(24)), "([0-9]|1[0-9]|2[0-3])"), ([31], "31"), (list(range(95, 126)),
     "(9[5-9]|1[01][0-9]|12[0-5])")],
)  # fmt: skip
def test_layer_numbers_as_ranges(layers, regex):
    assert layers_regex(layers) == regex
    found = [il for il in range(200) if re.search(f"blk\\.{regex}\\.", f"blk.{il}.ffn_up.weight")]
    assert found == layers


def test_several_users_share_one_cache_of_the_plans_cells():
    """The plan's n_ctx is every user's share together in one unified cache: llama.cpp's -c is
    the total under -np, and -kvu makes it one cache."""
    spec = spec_from_hparams(MODELS["dense"])
    place = _placement(spec, set())
    args = llamacpp_args(spec, place, 16384, "f16", True, users=4)
    assert args[2:8] == ["-c", "16384", "-np", "4", "-kvu", "-ngl"]
    assert "-np" not in llamacpp_args(spec, place, 16384, "f16", True)
    with pytest.raises(UserError, match="llama-bench times one sequence"):
        llama_bench_args(args, spec.hparams.n_layer)


def test_a_quantized_v_cache_without_flash_attention_is_refused():
    spec = spec_from_hparams(MODELS["dense"])
    with pytest.raises(UserError, match="use --fa on, or --kv-type f16 with --fa off"):
        llamacpp_args(spec, _placement(spec, set()), 4096, "q8_0", False)
    with pytest.raises(UserError, match="needs flash attention"):
        Workload(n_ctx=4096, prompt_tokens=100, gen_tokens=10, kv_type="q8_0", flash_attn=False)


def test_a_spec_only_plan_exports_with_a_placeholder_model(tmp_path):
    from .conftest import refengine

    plan = tmp_path / "plan.json"
    r = refengine("solve", "llama3-8b", "--target", "llamacpp", "--profile", "rtx4090-epyc-7742",
                  "--budget", "4GiB", "--ctx", "4096", "--time-limit", "1", "-o", plan)  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = refengine("export", plan)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llama-server -m MODEL.gguf -fit off -c 4096 ")
    assert r.stderr.strip() == (
        "llama3-8b is a spec-only shape: replace MODEL.gguf with a GGUF file of it"
    )
    r = refengine("export", plan, "--format", "llama-bench")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("llama-bench -m MODEL.gguf -ngl ")


# Real llama.cpp (built from the PyPI sdist; an RPC server on localhost is its GPU): the exported
# flags are accepted and every tensor lands where the plan says (-v logs each override).

DENSE_24 = SyntheticConfig(
    "llama", n_layer=24, n_embd=64, n_ff=128, n_head=4, n_head_kv=2, n_vocab=300, qtype="Q8_0"
)


def _run_real(llama_bin, endpoint, path, spec, place, *extra):
    """The plan's flags in llama-server's form (run by llama-completion) and in llama-bench's:
    each places every tensor where the plan does."""
    from solver.llamacpp_check import on_rpc, parse_load_log, run_llama_bench, run_llamacpp

    args = llamacpp_args(spec, place, 1024, "f16", True)
    want = {
        name: "RPC0" if dev == "CUDA0" else dev
        for name, dev in tensor_devices(spec, place).items()
        if not name.endswith("@output")
    }
    log = run_llamacpp(llama_bin, str(path), on_rpc(args, [endpoint]))
    assert parse_load_log(log, spec).tensors == want
    bench = llama_bench_args(on_rpc(args, [endpoint]), spec.hparams.n_layer)
    records, log = run_llama_bench(llama_bin, str(path), bench, 8, 2)
    assert parse_load_log(log, spec).tensors == want
    assert [(r["n_prompt"], r["n_gen"]) for r in records] == [(8, 0), (0, 2)]
    return args


def test_real_llamacpp_places_n_cpu_moe_and_its_exceptions(small_models, llama_bin, rpc_servers):
    from refengine.models import load_model

    path = small_models["qwen3moe"]  # 2 layers, 4 experts
    spec = load_model(str(path))
    place = _placement(spec, _experts(spec, [0]) | {"blk.1.ffn_down_exps", "blk.1.attn"})
    args = _run_real(llama_bin, rpc_servers[0], path, spec, place)
    assert args[-4:] == [
        "-ot",
        "blk\\.1\\.(attn_(norm|q|k|v|q_norm|k_norm|output)|ffn_(norm|gate_inp|down_exps))"
        "\\.weight=CPU",
        "--n-cpu-moe",
        "1",
    ]
    every_expert = _placement(spec, _experts(spec, [0, 1]))
    args = _run_real(llama_bin, rpc_servers[0], path, spec, every_expert)
    assert args[-1] == "--cpu-moe"


def test_real_llamacpp_places_layer_ranges(tmp_path, llama_bin, rpc_servers):
    from refengine.models import load_model
    from refengine.synthetic import write_synthetic

    path = write_synthetic(tmp_path / "dense24.gguf", DENSE_24)
    spec = load_model(str(path))
    on_cpu = {g.name for g in tensor_groups(spec) if g.layer is not None and (
        g.layer in (0, 1) or 3 <= g.layer <= 20 and g.kind != "attn"
        or 9 <= g.layer <= 19 and g.kind == "attn")}  # fmt: skip
    args = _run_real(llama_bin, rpc_servers[0], path, spec, _placement(spec, on_cpu))
    assert args[args.index("-ot") + 1] == (
        "blk\\.([01]|[3-9]|1[0-9]|20)\\.ffn_(gate|up|down)\\.weight=CPU,"
        "blk\\.([01]|9|1[0-9])\\.(attn_(norm|q|k|v|output)|ffn_norm)\\.weight=CPU"
    )


def test_real_llamacpp_reads_np_and_kvu_as_one_cache_of_the_plans_cells(small_models, llama_bin):
    import subprocess

    from refengine.models import load_model

    path = small_models["llama"]
    spec = load_model(str(path))
    args = llamacpp_args(spec, _placement(spec, set()), 2048, "f16", True, users=2)
    args = args[: args.index("-dev")]  # on the CPU alone: the context is what is read here
    # on a loaded CI its asynchronous logger once lost every line after the tensors' (exit 0):
    # a run whose log never reached the context is run again
    for _ in range(3):
        p = subprocess.run([str(llama_bin / "llama-batched-bench"), "-m", str(path), *args,
                            "-npp", "8", "-ntg", "2", "-npl", "2", "-v"],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 0, p.stderr[-2000:]
        log = re.sub(r"\s+", " ", p.stdout + p.stderr)
        if "llama_context: constructing" in log:
            break
    for fact in ("n_seq_max = 2", "n_ctx = 2048", "n_ctx_seq = 2048", "kv_unified = true"):
        assert f"llama_context: {fact} " in log, fact


def test_real_llamacpp_refuses_a_quantized_v_cache_without_flash_attention(small_models, llama_bin):
    import subprocess

    def completes(fa: str, ctv: str) -> bool:
        # qwen3's heads of 32 hold whole q8_0 blocks of 32 (llama's 16 do not)
        p = subprocess.run([str(llama_bin / "llama-completion"), "-m", str(small_models["qwen3"]),
                            "-fit", "off", "-c", "256", "-fa", fa, "-ctk", "q8_0", "-ctv", ctv,
                            "-n", "1", "-p", "hi", "-no-cnv", "--no-warmup"],
                           capture_output=True, timeout=300)  # fmt: skip
        return p.returncode == 0

    # llama.cpp logs from a worker thread that an early exit does not drain, so its reason
    # ("quantized V cache requires flash_attn") is printed only some of the time: the exit codes say it.
    assert not completes("off", "q8_0")
    assert completes("on", "q8_0")
    assert completes("off", "f16")
