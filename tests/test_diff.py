"""`refengine diff` judges a plan by the bounds of its named path (docs/contracts.md, Tolerances):
teacher-forced top-1 with near-ties excused and mean KL decide, the normwise error is printed beside.
The judging on logits built to agree or disagree, then the command on a tiny synthetic model: a
hybrid plan on the int8 path meets its bounds, and the same plan with a weight slot holding the
wrong tensor fails, naming the bound."""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from refengine.agreement import PATHS, judge

from .conftest import refengine

N_VOCAB = 300


def rows(n: int, seed: int = 0) -> np.ndarray:
    """Reference logits with a clear winner at every position (gap 3, far from a near-tie)."""
    rng = np.random.default_rng(seed)
    out = rng.standard_normal((n, N_VOCAB)).astype(np.float32)
    out[np.arange(n), rng.integers(0, N_VOCAB, n)] += 8.0
    return out


def test_logits_that_agree_meet_the_fp32_bounds():
    ref = rows(20)
    ours = ref + np.random.default_rng(1).normal(0, 1e-4, ref.shape).astype(np.float32)
    j = judge(ours, ref, PATHS["fp32"])
    assert j.ok and j.failed == [] and j.top1 == 1.0 and j.mean_kl < 1e-6
    assert j.lines()[-1] == "verdict: meets its path's bounds"


def test_the_normwise_error_is_printed_not_judged():
    """A constant added to every logit changes no probability: 1.0 normwise, KL 0, it passes."""
    ref = rows(10)
    ours = ref + np.float32(np.abs(ref).max())
    j = judge(ours, ref, PATHS["int8"])
    assert j.normwise > PATHS["int8"].normwise and j.mean_kl < 1e-9 and j.ok
    assert "above the path's 0.05" in j.lines()[2]


def test_a_different_winner_off_a_near_tie_fails_the_top1_bound():
    ref = rows(50)
    ours = ref.copy()
    ours[7] = -ref[7]  # the winner becomes the loser: far from any tie
    j = judge(ours, ref, PATHS["int8"])
    assert j.top1 == pytest.approx(49 / 50) and j.agreement.excused == []
    assert not any(f.startswith("teacher-forced") for f in j.failed)  # 98% is the bound
    ours[8] = -ref[8]
    j = judge(ours, ref, PATHS["int8"])
    assert j.top1 == pytest.approx(48 / 50)
    assert j.failed[0] == "teacher-forced top-1 96.0% < 98%"
    assert j.lines()[-1].startswith("verdict: FAILS teacher-forced top-1 96.0% < 98%")


def test_the_same_winners_with_a_flattened_distribution_fail_the_kl_bound():
    ref = rows(10)
    ours = ref * 0.5  # argmax kept, probabilities flattened
    j = judge(ours, ref, PATHS["fp32"])
    assert j.top1 == 1.0
    assert len(j.failed) == 1 and j.failed[0].startswith("mean KL") and ">= 0.001" in j.failed[0]


def test_a_near_tie_is_excused_and_nan_logits_fail():
    ref = rows(10)
    ref[3, :] = 0.0
    ref[3, 5], ref[3, 6] = 4.0, 3.995  # top two 0.005 apart: a near-tie at any tolerance
    ours = ref.copy()
    ours[3, 5], ours[3, 6] = 3.995, 4.0
    j = judge(ours, ref, PATHS["fp32"])
    assert j.agreement.excused == [3] and j.top1 == 1.0 and j.ok
    assert "excused: 3" in j.lines()[0]
    ours[4] = np.nan
    assert not judge(ours, ref, PATHS["fp32"]).ok


def test_every_path_has_the_contract_bounds():
    """Against the NumPy reference: 99% / 1e-3 on the fp32 and fp16 paths (logits within 1e-3
    and 5e-2), llama.cpp's own 98% / 5e-3 on the int8 path, whose normwise error is not bounded."""
    bounds = {p: (b.top1, b.kl, b.normwise, b.normwise_bounded) for p, b in PATHS.items()}
    assert bounds == {"fp32": (0.99, 1e-3, 1e-3, True), "fp16": (0.99, 1e-3, 5e-2, True),
                      "int8": (0.98, 5e-3, 5e-2, False)}  # fmt: skip


def test_an_agreement_is_held_to_its_engines_path():
    """The same logits, 0.08 normwise off at the end with every top-1 kept and a small KL: the
    int8 path meets its bounds (normwise printed), the fp16 path does not (bounded at 5e-2); a KL
    of 2e-3 meets the int8 path's 5e-3 and misses the fp16 path's 1e-3."""
    from refengine.agreement import agreement_along

    ref = rows(6, seed=5)

    class Engine:
        def __init__(self, path, rows):
            self.path, self.rows = path, iter(rows)

        def reset(self):
            pass

        def prefill(self, prompt):
            return next(self.rows)

        decode = prefill

    shifted = ref.copy()
    shifted[-1] += 0.08 * np.abs(ref[-1]).max() * (np.arange(N_VOCAB) == np.argmin(ref[-1]))
    for path, ok in (("int8", True), ("fp16", False)):
        a = agreement_along(Engine(path, shifted), [1], list(ref), PATHS[path].normwise)
        assert a.errors[-1] > 5e-2 and a.forced_top1 == 1.0 and a.ok == ok, path
    flat = ref * 0.965  # the same winners, a flatter distribution: KL between the two bounds
    for path, ok in (("int8", True), ("fp16", False)):
        a = agreement_along(Engine(path, flat), [1], list(ref), PATHS[path].normwise)
        assert 1e-3 < a.mean_kl < 5e-3, a.mean_kl
        assert a.ok == ok, (path, a.summary())


def test_a_plans_path_is_named_from_its_parts(tmp_path):
    """All pinned: exact on the stand-in at any tier; the CUDA engine's decode of a quantized
    model in integers (int8), of a float one in fp32, and its fp16 GEMM past the matvec tokens;
    one FFN matrix on the CPU: int8 on both; the cpu engine: int8."""
    import dataclasses

    from cudarun.cpu_engine import CpuEngine
    from cudarun.cuda_engine import CudaEngine
    from cudarun.standin_engine import StandInEngine
    from refengine.spec import load_spec
    from refengine.synthetic import SyntheticConfig, write_synthetic
    from solver.cost import CPU, PINNED, Loc, TierPlacement, Workload, evaluate
    from solver.groups import tensor_groups
    from solver.plan import plan_json
    from solver.solve import load_profile

    cfg = SyntheticConfig("llama", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                          n_vocab=260, qtype="Q8_0")  # fmt: skip
    spec = load_spec(str(write_synthetic(tmp_path / "m.gguf", cfg)))
    floats = load_spec(str(write_synthetic(tmp_path / "f.gguf",
                                           dataclasses.replace(cfg, qtype="F32"))))  # fmt: skip
    prof = load_profile("h100")

    def engines(spec, tiers: tuple[int, ...], on_cpu: str | None = None):
        where = {g.name: Loc(CPU if g.name == on_cpu else PINNED) for g in tensor_groups(spec)}
        place = {t: TierPlacement(where, {0: Loc(PINNED)}) for t in tiers}
        w = Workload(n_ctx=64, prompt_tokens=32, gen_tokens=4, threads=1)
        plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (8 << 20)], place,
                         evaluate(place, spec, prof, w), "test", "refengine")  # fmt: skip
        return StandInEngine(spec, plan), CudaEngine(spec, plan)

    standin, cuda = engines(floats, (1, 16))
    assert (standin.path, cuda.path, cuda.tolerance) == ("fp32", "fp32", 1e-3)
    standin, cuda = engines(floats, (1, 32))
    assert (standin.path, cuda.path, cuda.tolerance) == ("fp32", "fp16", 5e-2)
    standin, cuda = engines(spec, (1, 16))
    assert (standin.path, cuda.path, standin.tolerance) == ("fp32", "int8", 1e-3)
    standin, cuda = engines(spec, (1, 16), on_cpu="blk.0.ffn_down")
    assert (standin.path, cuda.path, standin.tolerance) == ("int8", "int8", 5e-2)
    assert CpuEngine.path == "int8"


# a budget under the tiny llama's weights (124 KiB): a hybrid plan with its matmuls on the CPU
HYBRID = ("--engine", "standin", "--budget", "0.15MiB", "--tiers", "1,4", "-c", "64")


def test_diff_of_a_plan_that_meets_its_path(small_models):
    r = refengine("diff", small_models["llama"], "--tokens", "3,4,5", "-n", "8", *HYBRID)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on the int8 path" in r.stdout and "blk.1.out" in r.stdout
    assert "top-1 >= 98%, mean KL < 0.005" in r.stdout
    assert "verdict: meets its path's bounds" in r.stdout


def test_diff_of_an_engine_with_a_wrong_weight_slot_exits_1_naming_the_bound(
    small_models, monkeypatch
):
    """The stand-in's host copy of blk.1.ffn_up holds blk.1.ffn_gate's bytes (same shape): a
    slot loaded with the wrong tensor."""
    import cudarun.session as session

    from refengine.commands import cli

    made = session.make_engine

    def wrong_slot(*args, **kw):
        engine = made(*args, **kw)
        engine.host.group("blk.1.ffn_up")[:] = engine.host.group("blk.1.ffn_gate")
        return engine

    monkeypatch.setattr(session, "make_engine", wrong_slot)
    args = ["diff", str(small_models["llama"]), "--tokens", "3,4,5", "-n", "8", *HYBRID]
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 1, r.output
    verdict = r.output.strip().splitlines()[-1]
    assert verdict.startswith("verdict: FAILS teacher-forced top-1"), verdict
    assert "mean KL" in verdict
