"""Tensor split (llama.cpp -sm tensor): each GPU's share, the halved compute and the all-reduces,
and a tensor-split plan exported as flags."""

from dataclasses import replace

import pytest

from refengine.synthetic import preset, spec_from_hparams
from solver.cost import PINNED, CostModel, Loc, TierPlacement, Workload
from solver.export import tensor_split_args
from solver.groups import EMBD, tensor_groups
from solver.memory import compute_nbytes, kv_layer_nbytes
from solver.plan import plan_json
from solver.solve import solve
from solver.tensor_split import (
    evaluate_tensor_split,
    even_fractions,
    short_devices,
    tensor_split_nbytes,
    ubatch_terms,
)
from solver.usage import kv_shape

from .test_cost import DENSE, W, toy_profile

GIB = 2**30


def two_toy_gpus():
    prof = toy_profile()
    return replace(prof, gpus=(prof.gpus[0], replace(prof.gpus[0], name="toy GPU 2")))


def test_each_gpu_holds_half_of_the_weights_and_kv_and_a_whole_workspace():
    weights = sum(g.nbytes for g in tensor_groups(DENSE) if g.kind != EMBD)
    kv = 2 * kv_layer_nbytes(DENSE, 0, kv_shape(W, 512))
    workspace = compute_nbytes(DENSE, 512, W.n_ctx, True, 512)
    assert tensor_split_nbytes(DENSE, W, 512, 2) == -(-(weights + kv) // 2) + workspace
    need = tensor_split_nbytes(DENSE, W, 512, 2)
    assert short_devices(DENSE, W, 512, [need, need - 10]) == {1: 10}


def test_compute_halves_and_each_layer_pays_two_all_reduces():
    prof = two_toy_gpus()
    cm = CostModel(DENSE, prof, W, "llamacpp")
    pinned = TierPlacement(
        {g.name: Loc(PINNED) for g in cm.groups}, {il: Loc(PINNED) for il in range(2)}
    )
    one = cm.layer_terms(0, pinned, 512, 1000, False)
    split = ubatch_terms(cm, even_fractions(2), 512, 1000, 1)
    layers_gpu = 2 * one.gpu / 2  # two layers, each half as long
    head_gpu = cm.gpu_seconds(next(g for g in cm.groups if g.name == "output"), 512) / 2
    assert split.gpu == pytest.approx(layers_gpu + head_gpu)
    hop = cm.hop_seconds(512, DENSE.hparams.n_embd)
    launches = 2 * cm.launch_seconds(8 + 4, 512)
    assert split.latency == pytest.approx(2 * 2 * 2 * hop + launches + 2 * hop)


def test_a_model_that_needs_both_gpus_can_be_tensor_split_and_exported():
    spec = spec_from_hparams(preset("llama3-8b"))
    prof = two_toy_gpus()
    w = Workload(n_ctx=4096, prompt_tokens=1000, gen_tokens=50)
    need = tensor_split_nbytes(spec, w, 512, 2)
    chosen, baselines, _ = solve(spec, prof, w, [1, 512], [need, need], target="llamacpp")
    split = next(b for b in baselines if b.name == "tensor-split")
    assert split.split_mode == "tensor"
    assert split.prediction.e2e_seconds == pytest.approx(
        evaluate_tensor_split(spec, prof, w, [1, 512], 2).e2e_seconds
    )
    doc = plan_json(
        spec, w, prof.name, [need, need], split.tiers, split.prediction, "tensor-split",
        "llamacpp", split_mode="tensor",
    )  # fmt: skip
    assert doc["split_mode"] == "tensor" and doc["tiers"]["512"]["kv"]["0"] == "split"
    args = tensor_split_args(doc, spec)
    assert args[args.index("-sm") + 1] == "tensor" and args[args.index("-fa") + 1] == "on"
    assert args[args.index("-dev") + 1] == "CUDA0,CUDA1" and "-ts" not in args
    # one byte short on a device: no tensor-split plan
    _, baselines, _ = solve(spec, prof, w, [1, 512], [need, need - 1], target="llamacpp")
    assert "tensor-split" not in [b.name for b in baselines]
