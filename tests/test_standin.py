"""The stand-in device runs the pipeline of streamed weights and CPU steps correctly, and catches
every event wait removed from it (validator bypassed), over 5 seeds, whatever the timing."""

import numpy as np
import pytest

from cudarun.schedule import (
    HOST, SlotKind, Step, Wait, compute_queue, group_unit, pipeline_schedule,
)
from cudarun.standin import StandInDevice

from .test_schedule import slots

SEEDS = range(5)


def run(ops, seed, n_slots, tensors):
    checksums = {}

    def kernel_for(name, tensor):
        def kernel(views):
            (view,) = views.values()
            checksums[name] = float(view[: tensors[tensor].nbytes].view(np.float32).sum())

        return kernel

    kernels = {
        op.name: kernel_for(op.name, op.reads[0][0])
        for op in ops
        if getattr(op, "reads", ()) and op.reads[0][1].kind is SlotKind.RING
    }
    device = StandInDevice(slots(n_slots), tensors, seed)
    try:
        return device.execute(ops, kernels), checksums
    finally:
        device.close()


def pipeline(n_layers=6, n_slots=2):
    """Layer 3 runs on the CPU, layer 4 on the device from pinned weights, the others stream."""
    steps = [
        Step(f"layer{i}", HOST if i == 3 else compute_queue(),
             (group_unit(f"w{i}"),) if i not in (3, 4) else ())  # fmt: skip
        for i in range(n_layers)
    ]
    rng = np.random.default_rng(0)
    tensors = {u: rng.standard_normal(25).astype(np.float32) for s in steps for u in s.units}
    return pipeline_schedule(steps, n_slots), tensors


@pytest.mark.parametrize("seed", SEEDS)
def test_the_pipeline_runs_clean_and_every_layer_reads_its_own_weights(seed):
    ops, tensors = pipeline()
    violations, checksums = run(ops, seed, 2, tensors)
    assert violations == []
    for name, value in checksums.items():
        want = float(tensors[group_unit("w" + name.removeprefix("layer"))].sum())
        assert value == pytest.approx(want, rel=1e-6)


def test_every_removed_wait_is_detected_on_every_seed():
    ops, tensors = pipeline()
    waits = [i for i, op in enumerate(ops) if isinstance(op, Wait)]
    assert len(waits) >= 8
    for w in waits:
        for seed in SEEDS:
            violations, _ = run(ops[:w] + ops[w + 1 :], seed, 2, tensors)
            assert violations, f"removing op {w} ({ops[w]}) went unnoticed with seed {seed}"
