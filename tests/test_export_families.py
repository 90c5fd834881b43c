"""Each planned family's experts exported as llama.cpp moves them: a plan that keeps every routed
stack on the CPU exports `--cpu-moe`, whose pattern takes exactly the routed stacks (gpt-oss's
expert biases with them) and leaves the shared experts, the routers and their biases, dense
layers and NextN blocks where the layers are (the real loads: each family's verify test)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from refengine.synthetic import spec_from_hparams
from solver.cost import CPU, PINNED, Loc, TierPlacement
from solver.export import apply_llamacpp_args, llamacpp_args
from solver.groups import EXPERTS, tensor_groups

from .test_deepseek2 import DS
from .test_generic import GRANITEMOE
from .test_glm4moe import GLM
from .test_gpt_oss import GPT_OSS
from .test_llama4 import L4
from .test_qwen35moe import Q35
from .test_routed_llama import ROUTED_LLAMA

FAMILIES = {"gpt-oss": GPT_OSS, "glm4moe": GLM, "deepseek2": DS, "llama4": L4,
            "qwen35moe": Q35, "qwen3next": replace(Q35, arch="qwen3next"),
            "mixtral-style llama": ROUTED_LLAMA,
            "granitemoe (the generic rule)": GRANITEMOE}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_cpu_moe_moves_exactly_the_routed_stacks(family):
    spec = spec_from_hparams(FAMILIES[family])
    groups = tensor_groups(spec)
    place = TierPlacement({g.name: Loc(CPU) if g.kind == EXPERTS or g.name == "token_embd"
                           else Loc(PINNED) for g in groups},
                          {il: Loc(PINNED) for il in range(spec.hparams.n_layer)})  # fmt: skip
    args = llamacpp_args(spec, place, 4096, "f16", True)
    assert "--cpu-moe" in args and "-ot" not in args, args
    on_cpu = {n for n, dev in apply_llamacpp_args(spec, args).items() if dev == "CPU"}
    routed = {t for g in groups if g.kind == EXPERTS for t in g.tensors}
    assert on_cpu == routed | {"token_embd.weight"}
    assert not any("shexp" in n or "gate_inp" in n or "exp_probs_b" in n for n in on_cpu)
    if family == "gpt-oss":
        assert "blk.0.ffn_down_exps.bias" in on_cpu
