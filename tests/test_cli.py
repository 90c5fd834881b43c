"""The command line, run as a user runs it (a subprocess), including every way to misuse it."""

import json
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from .conftest import refengine, tiny_gguf


def assert_one_line_error(r, *fragments):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    err = r.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert "Traceback" not in r.stderr
    for f in fragments:
        assert f in err, err


def test_info_table_and_json(small_models):
    r = refengine("info", small_models["qwen3moe"])
    assert r.returncode == 0, r.stderr
    assert "qwen3moe" in r.stdout and "experts" in r.stdout and "router" in r.stdout
    r = refengine("info", small_models["gemma3"], "--json")
    d = json.loads(r.stdout)
    assert d["arch"] == "gemma3" and d["hparams"]["n_swa"] == 5
    assert sum(d["nbytes_by_role"].values()) == d["nbytes"]
    assert [row["layer"] for row in d["layers"]] == [None, 0, 1, 2, 3, 4, 5]
    assert [row["swa"] for row in d["layers"][1:]] == [True] * 5 + [False]


def test_run_tokens_dump_logits(small_models, tmp_path):
    out = tmp_path / "logits.npy"
    r = refengine(
        "run", small_models["llama"], "--tokens", "3,4,5,6,7", "-n", "0", "--dump-logits", out
    )
    assert r.returncode == 0, r.stderr
    logits = np.load(out)
    assert logits.shape == (5, 300) and logits.dtype == np.float32
    from refengine.engine import NumpyEngine

    np.testing.assert_allclose(
        logits,
        NumpyEngine(small_models["llama"]).prefill([3, 4, 5, 6, 7], all_logits=True),
        rtol=1e-6,
    )


def test_run_streams_text_greedy_and_seeded(small_models):
    r = refengine("run", small_models["qwen2"], "-p", "hello there", "-n", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hello there") and "generated" in r.stderr
    again = refengine("run", small_models["qwen2"], "-p", "hello there", "-n", "8")
    assert again.stdout == r.stdout
    sample = lambda seed: (
        refengine(
            "run",
            small_models["qwen2"],
            "--tokens",
            "5,6",
            "-n",
            "24",  # noqa: E731
            "--temp",
            "1.5",
            "--top-k",
            "0",
            "--seed",
            seed,
        ).stdout
    )
    a, b, c = sample(3), sample(3), sample(4)
    assert a == b and a != c


def test_synth_writes_a_loadable_model(tmp_path):
    out = tmp_path / "m.gguf"
    r = refengine(
        "synth",
        out,
        "--arch",
        "qwen3",
        "--layers",
        "1",
        "--embd",
        "64",
        "--ff",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--vocab",
        "260",
        "--qtype",
        "Q8_0",
    )
    assert r.returncode == 0, r.stderr
    from refengine.spec import load_spec

    spec = load_spec(out)
    assert spec.arch.name == "qwen3" and spec.hparams.n_layer == 1


def test_not_a_gguf(tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("this is not a model\n" * 10)
    assert_one_line_error(refengine("info", p), "not a GGUF")


def test_missing_file(tmp_path):
    assert_one_line_error(refengine("info", tmp_path / "nope.gguf"), "no such file")


@pytest.mark.parametrize("keep", [100, 0.6])
def test_truncated_file(small_models, tmp_path, keep):
    data = small_models["llama"].read_bytes()
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[: keep if isinstance(keep, int) else int(len(data) * keep)])
    assert_one_line_error(refengine("info", p), "truncated")


@pytest.mark.parametrize("arch, says", [
    ("bert", "'bert' is not a text generator refengine can plan (encoder-only"),
    ("gpt5", "'gpt5' is not one of the 130 text architectures llama.cpp 0.3.36 knows"),
])  # fmt: skip
def test_unsupported_architecture_says_what_it_is(tmp_path, arch, says):
    p = tiny_gguf(
        tmp_path / f"{arch}.gguf",
        arch,
        {"token_embd.weight": (np.zeros((4, 8), np.float32), None)},
        block_count=1,
    )
    assert_one_line_error(refengine("info", p), f"architecture {says}")


def test_unsupported_tensor_type(tmp_path):
    iq2 = (np.zeros((4, 66), np.uint8), GGMLQuantizationType.IQ2_XXS)
    p = tiny_gguf(tmp_path / "iq2.gguf", "llama", {"token_embd.weight": iq2})
    assert_one_line_error(refengine("info", p), "IQ2_XXS is not supported")


def test_prompt_longer_than_context(small_models):
    toks = ",".join(str(i) for i in range(2, 40))
    assert_one_line_error(
        refengine("run", small_models["llama"], "--tokens", toks, "-c", "16", "-n", "0"),
        "context of 16",
    )


def test_bad_token_ids(small_models):
    assert_one_line_error(refengine("run", small_models["llama"], "--tokens", "1,x"), "--tokens")
    assert_one_line_error(refengine("run", small_models["llama"], "--tokens", "1,999"), "outside")


def test_dump_logits_to_a_missing_folder(small_models, tmp_path):
    assert_one_line_error(
        refengine(
            "run",
            small_models["llama"],
            "--tokens",
            "3,4",
            "-n",
            "0",
            "--dump-logits",
            tmp_path / "no" / "x.npy",
        ),
        "cannot write",
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--arch", "qwen3moe"], "MoE model needs"),
        (["--heads", "0"], "positive"),
        (["--preset", "gemma3-270m", "--arch", "qwen2"], "leave out --arch"),
        (["--arch", "falcon"], "writes synthetic files of granitemoe, olmo2 only"),
    ],
)
def test_synth_refuses_impossible_models(tmp_path, args, message):
    assert_one_line_error(refengine("synth", tmp_path / "m.gguf", *args), message)


def test_the_plan_engines_from_the_command_line(small_models, tmp_path):
    """run, diff and bench on the stand-in device: a plan solved for --budget and cached next to
    the model, reused the second time, a trace with its Gantt chart."""
    model = small_models["llama"]
    args = ("--engine", "standin", "--budget", "1MiB", "--tiers", "1,4", "-c", "64")
    r = refengine("run", model, "--tokens", "3,4,5", "-n", "3", "--temp", "0", *args,
                  "--trace", tmp_path / "t.json")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "plan cached at" in r.stderr and "TTFT" in r.stderr and "TPS" in r.stderr
    assert (tmp_path / "t.png").stat().st_size > 1000
    trace = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert {e["args"]["name"] for e in trace if e["ph"] == "M"} == {"copy", "compute", "cpu"}
    want = refengine("run", model, "--tokens", "3,4,5", "-n", "3", "--temp", "0")
    again = refengine("run", model, "--tokens", "3,4,5", "-n", "3", "--temp", "0", *args)
    assert "reusing the plan" in again.stderr
    assert again.stdout == r.stdout == want.stdout  # greedy: the same tokens as the NumPy engine
    r = refengine("diff", model, "--tokens", "3,4,5", *args)
    assert r.returncode == 0, r.stderr
    assert "blk.1.out" in r.stdout and "verdict: meets its path's bounds" in r.stdout
    r = refengine("bench", model, "-p", "8", "-n", "4", "--depth", "0,8", "--baseline", "fit",
                  *args)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for text in ("pp8 @ d0", "tg4 @ d8", "pred t/s", "bound t/s", "fit t/s", "speedup"):
        assert text in r.stdout, r.stdout


def test_plan_engine_mistakes_are_one_line(small_models, tmp_path):
    import os

    model = small_models["llama"]
    r = refengine("run", model, "--tokens", "3", "--engine", "standin", "--budget", "0.001MiB")
    assert_one_line_error(r, "raise --budget")
    r = refengine("run", model, "--tokens", "3", "--engine", "standin", "--budget", "1GiB",
                  "--reserve", "1GiB")  # fmt: skip
    assert_one_line_error(r, "raise --budget")
    r = refengine("run", model, "--tokens", "3", "--budget", "1GiB")
    assert_one_line_error(r, "--engine cuda")
    plan = tmp_path / "p.json"
    assert refengine("solve", small_models["qwen2"], "--budget", "1GiB", "--profile", "h100",
                     "--ctx", "64", "--gen-tokens", "8", "-o", plan).returncode == 0  # fmt: skip
    r = refengine("run", model, "--tokens", "3", "--engine", "standin", "--plan", plan)
    assert_one_line_error(r, "solve again")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    from cudarun.driver import gpu_present

    if not gpu_present():
        r = refengine(
            "run", model, "--tokens", "3", "--engine", "cuda", "--budget", "1GiB", env=env
        )
        assert_one_line_error(r, "no NVIDIA GPU", "--engine standin")


def test_zero_users_is_one_line():
    r = refengine("solve", "llama3-8b", "--profile", "h100", "--users", "0")
    assert_one_line_error(r, "--users takes 1 or more users, not 0")


@pytest.mark.parametrize(
    "command",
    [
        ("solve", "llama3-8b", "--profile", "h100"),
        ("run", "MODEL", "--tokens", "3"),
        ("diff", "MODEL", "--tokens", "3", "--engine", "standin"),
        ("bench", "MODEL", "--engine", "standin"),
        ("profile", "-o", "OUT", "--quick", "--gpu-from", "h100"),
        ("bench-kernels", "--quick", "--no-gpu"),
    ],
    ids=lambda c: c[0],
)
def test_negative_threads_are_one_line(small_models, tmp_path, command):
    args = [{"MODEL": small_models["llama"], "OUT": tmp_path / "p.json"}.get(a, a) for a in command]
    r = refengine(*args, "--threads", "-3")
    assert_one_line_error(r, "--threads takes a thread count of 1 or more", "not -3")
    assert not (tmp_path / "p.json").exists()


def test_a_budget_above_the_profiles_memory_names_both(small_models):
    r = refengine("solve", "llama3-8b", "--profile", "rtx4090-epyc-7742", "--budget", "48GiB")
    assert_one_line_error(r, "--budget 48.00 GiB is above the 24.00 GiB of GPU 0", "rtx4090")
    r = refengine("solve", "llama3-8b", "--profile", "rtx4090-rtx3060-epyc-7742",
                  "--budget", "20GiB,16GiB")  # fmt: skip
    assert_one_line_error(r, "--budget 16.00 GiB is above the 12.00 GiB of GPU 1")
    r = refengine("run", small_models["llama"], "--tokens", "3", "--engine", "standin",
                  "--budget", "100GiB")  # fmt: skip
    assert_one_line_error(r, "--budget 100.00 GiB is above the 80.00 GiB of GPU 0", "h100")


def test_an_unknown_model_lists_the_known_names_and_the_shapes():
    for command in (("info", "llama3-7b"), ("solve", "llama3-7b", "--profile", "h100")):
        r = refengine(*command)
        assert_one_line_error(r, "llama3-7b: no such file", "smollm2-135m", "gemma3-270m",
                              "llama3-8b", "llama3-70b")  # fmt: skip


def test_gpu_from_refuses_a_profile_that_is_not_there(tmp_path):
    """(A shipped profile's name taken: test_profile's quick profile, the suite's one.)"""
    r = refengine("profile", "-o", tmp_path / "me.json", "--quick", "--gpu-from", "h1000")
    assert_one_line_error(r, "h1000: cannot read the profile")


def test_threads_reach_the_plan_of_run(small_models, tmp_path):
    """--threads is a fingerprint input (docs/contracts.md): the plan run solves names it."""
    import shutil

    model = shutil.copy(small_models["llama"], tmp_path / "m.gguf")
    args = ("--engine", "standin", "--budget", "1MiB", "--tiers", "1,4", "-c", "64")
    for threads in (1, 2):
        r = refengine("run", model, "--tokens", "3,4", "-n", "1", *args, "--threads", threads)
        assert r.returncode == 0, r.stderr
    plans = [json.loads(p.read_text()) for p in tmp_path.glob("m.gguf.*.plan.json")]
    assert sorted(p["fingerprint"]["threads"] for p in plans) == [1, 2]


@pytest.mark.parametrize("command", ["solve", "sweep"])
def test_a_quantized_kv_cache_without_flash_attention_is_one_line(command):
    """llama.cpp refuses a quantized V cache without flash attention; so do we, before solving."""
    extra = ("--budget", "2GiB..4GiB:1GiB") if command == "sweep" else ()
    r = refengine(command, "llama3-8b", "--profile", "h100", "--kv-type", "q8_0", "--fa", "off",
                  *extra)
    assert_one_line_error(r, "q8_0 KV cache needs flash attention", "use --fa on")
