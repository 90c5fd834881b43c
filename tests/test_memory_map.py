"""Every region of a memory map starts on an ALIGN boundary, whatever byte count the budget is: the
kernels read KV and activations in 4- and 8-byte words (a budget of 40% of the weights put SmolLM2's
KV on odd addresses: CUDA_ERROR_MISALIGNED_ADDRESS on the first GPU run); the regions still do not
overlap and stay inside the budget, the padding being part of the memory model's workspace."""

from __future__ import annotations

import pytest

from refengine.spec import load_spec
from refengine.synthetic import preset, write_synthetic
from solver.cost import Workload
from solver.profile import for_devices
from solver.solve import load_profile, solve_plan
from solver.tensor_split import share_nbytes_line
from solver.workspace import ALIGN

W = Workload(n_ctx=256, prompt_tokens=32, gen_tokens=8, threads=2)


def check(plan: dict, budgets: list[int]) -> int:
    """The regions checked, of every tier and device."""
    checked = 0
    for tier in plan["tiers"].values():
        for d, regions in tier["memory_map"].items():
            spans = sorted((offset, offset + n) for _, offset, n in regions)
            assert all(offset % ALIGN == 0 for offset, _ in spans), regions
            assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), regions
            assert spans[-1][1] <= budgets[int(d)]
            checked += len(spans)
    return checked


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "smollm2.gguf"
    return load_spec(str(write_synthetic(path, preset("smollm2-135m"))))


@pytest.mark.parametrize("fraction, strategy", [(3.0, None), (0.4, None), (0.4, "ffncpu-attnstream")])
def test_layer_split_regions_are_aligned_under_an_odd_budget(smollm2, fraction, strategy):
    budget = int(fraction * smollm2.weights_nbytes) | 1  # an odd byte count
    plan = solve_plan(smollm2, load_profile("h100"), W, [1, 512], [budget], strategy,
                      time_limit_seconds=2)  # fmt: skip
    assert check(plan, [budget]) > smollm2.hparams.n_layer


def test_tensor_split_regions_are_aligned_under_odd_budgets(smollm2):
    floor, scaling = share_nbytes_line(smollm2, W, 8)
    budgets = [int(floor + 0.7 * scaling) | 1, int(floor + 0.5 * scaling) | 1]
    plan = solve_plan(smollm2, for_devices(load_profile("h100"), 2), W, [1, 8], budgets,
                      split_mode="tensor")  # fmt: skip
    assert check(plan, budgets) > 2 * smollm2.hparams.n_layer


def test_the_runtime_own_memory_comes_out_of_the_budget(smollm2):
    """On a GPU, cuBLAS's handle and the kernels' code live outside the arena and inside the
    budget (docs/contracts.md): the arena, and every region, gets the budget less them."""
    from solver.budget import CUDA_RUNTIME_NBYTES

    budget = int(0.4 * smollm2.weights_nbytes) + CUDA_RUNTIME_NBYTES
    plan = solve_plan(smollm2, load_profile("h100"), W, [1, 512], [budget],
                      time_limit_seconds=2, runtime_nbytes=CUDA_RUNTIME_NBYTES)  # fmt: skip
    arena = budget - CUDA_RUNTIME_NBYTES
    assert plan["fingerprint"]["budget_bytes"] == [arena]
    assert plan["runtime_nbytes"] == CUDA_RUNTIME_NBYTES
    assert check(plan, [arena]) > smollm2.hparams.n_layer
    assert all(tier["memory"]["0"]["total"] <= arena for tier in plan["tiers"].values())
