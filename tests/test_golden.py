"""The reference engine against llama.cpp's recorded runs (scripts/record_golden.py).

Fed llama.cpp's tokens, the engine's logits must agree with llama.cpp's (docs/contracts.md):
wherever the top-1 differs, llama.cpp's own top two were a near-tie (so its greedy continuation is
ours up to a near-tie, and teacher-forced after); over the long prompt, top-1 agreement >= 98% and
mean KL(llama.cpp || ours) < 5e-3. The `-f32` fixtures are llama.cpp on an F32 copy of the same
weights, without its 8-bit activations, and must agree far more tightly.
"""

import hashlib

import pytest

from refengine.engine import NumpyEngine
from refengine.models import resolve_model
from refengine.synthetic import write_synthetic
from refengine.tokenizer import Tokenizer

from .golden import FIXTURE_DIR, N_CONTINUE, SYNTHETIC_CASES, compare, load_fixture, synthetic_path

CASES = sorted(p.stem for p in FIXTURE_DIR.glob("*.npz"))
REAL = {"smollm2-135m", "gemma3-270m"}


def model_file(name: str, meta: dict):
    if "synthetic_sha256" in meta:
        path = synthetic_path(name)
        if (
            not path.is_file()
            or hashlib.sha256(path.read_bytes()).hexdigest() != meta["synthetic_sha256"]
        ):
            write_synthetic(path, SYNTHETIC_CASES[name])
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        assert sha == meta["synthetic_sha256"], (
            "the synthetic writer no longer writes the recorded file"
        )
        return path
    return resolve_model(meta.get("f32_copy_of", name))


@pytest.fixture(scope="module", params=CASES)
def case(request):
    name = request.param
    meta, arrays = load_fixture(name)
    path = model_file(name, meta)
    return name, meta, arrays, path, NumpyEngine(str(path), n_ctx=2048)


def _limits(name):
    """(min top-1 agreement, max mean KL) for the long prompt."""
    return (0.999, 1e-4) if name.endswith("-f32") else (0.98, 5e-3)


def test_cases_cover_every_architecture_and_both_real_models():
    assert REAL <= set(CASES)
    assert {f"synthetic-{a}" for a in ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3",
                                       "llama-moe")} <= set(CASES)  # fmt: skip


def test_greedy_continuations_match_llamacpp(case):
    name, meta, arrays, _, engine = case
    _, max_kl = _limits(name)
    for i, g in enumerate(meta["greedy"]):
        assert len(g["continuation"]) == N_CONTINUE
        engine.reset()
        logits = engine.prefill(g["prompt_ids"] + g["continuation"], all_logits=True)
        a = compare(arrays, f"greedy{i}", logits)
        assert a.all_mismatches_near_ties, f"{name} prompt {i}: top-1 differs off a near-tie: {a}"
        assert a.mean_kl < max_kl, f"{name} prompt {i}: {a}"


def llamacpp_self_agreement(name: str):
    """Where llama.cpp's run of a real model agrees with its own run on the F32 copy (top-1)."""
    if f"{name}-f32" not in CASES:
        return None
    _, quantized = load_fixture(name)
    _, f32 = load_fixture(f"{name}-f32")
    return quantized["long_top_ids"][:, 0] == f32["long_top_ids"][:, 0]


def test_long_prompt_agreement(case):
    name, meta, arrays, _, engine = case
    min_top1, max_kl = _limits(name)
    assert len(meta["long_ids"]) >= 64
    engine.reset()
    logits = engine.prefill(meta["long_ids"], all_logits=True)
    a = compare(arrays, "long", logits)
    print(
        f"{name}: {a.n} positions, top-1 {a.top1:.4f}, mean KL {a.mean_kl:.2e}, "
        f"rest mass {a.rest_mass:.3f}, mismatches {a.mismatches}"
    )
    assert a.mean_kl < max_kl, a
    self_agree = llamacpp_self_agreement(name)
    if self_agree is None:
        assert a.top1 >= min_top1, a
        assert a.all_mismatches_near_ties, a
        return
    # llama.cpp's 8-bit activations flip near-tied argmaxes: on Gemma-3 its quantized run agrees
    # with its own F32 run at only ~94% of positions. Our engine cannot agree with the quantized
    # run more than llama.cpp agrees with itself, and must not agree less; every other difference
    # must be a near-tie.
    print(f"{name}: llama.cpp quantized vs llama.cpp F32 top-1 {self_agree.mean():.4f}")
    assert a.top1 >= min(min_top1, self_agree.mean() - 0.005), a
    assert all(near or not self_agree[p] for p, _, near in a.mismatches), a


@pytest.mark.parametrize("name", [c for c in CASES if "gemma3" in c])
def test_gemma3_long_prompts_run_past_the_sliding_window(name):
    from refengine.spec import load_spec

    meta, _ = load_fixture(name)
    hp = load_spec(model_file(name, meta)).hparams
    assert hp.n_swa > 0 and any(hp.swa_layers) and not all(hp.swa_layers)
    assert len(meta["long_ids"]) > hp.n_swa


def test_tokenizer_ids_match_llamacpp(case):
    name, meta, _, path, _ = case
    tok = Tokenizer.from_gguf(path)
    for item in meta["tokenizer"]:
        assert tok.encode(item["text"]) == item["ids"], item["text"]
    for g in meta["greedy"]:
        assert tok.encode(g["prompt"]) == g["prompt_ids"]
