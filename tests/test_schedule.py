"""The schedule validator: it accepts the pipeline of streamed units and CPU steps, and catches
every missing wait, wrong slot, overlap and oversize, on hand-built and generated schedules."""

import pytest
from hypothesis import given, settings, strategies as st

from cudarun.schedule import (
    HOST, Compute, Copy, EventId, Record, Signal, Slot, Step, Wait, compute_queue, copy_queue,
    group_unit, pipeline_schedule, ring_slot, validate,
)

COMPUTE, COPY, S0 = compute_queue(), copy_queue(), ring_slot(0, 0)


def slots(n, nbytes=100):
    return {ring_slot(0, i): Slot(ring_slot(0, i), i * nbytes, nbytes) for i in range(n)}


def pipeline(n_layers, streamed_every, n_slots, cpu_every=0):
    """Layer i streams w{i} when i % streamed_every == 0, else runs on the CPU when cpu_every
    divides it; a streamed layer's weights are read by two consecutive steps."""
    steps = []
    for i in range(n_layers):
        if i % streamed_every == 0:
            w = (group_unit(f"w{i}"),)
            steps += [Step(f"layer{i}.a", COMPUTE, w), Step(f"layer{i}.b", COMPUTE, w)]
        else:
            steps.append(
                Step(f"layer{i}", HOST if cpu_every and i % cpu_every == 0 else COMPUTE)
            )
    sizes = {u: 100 for s in steps for u in s.units}
    return pipeline_schedule(steps, n_slots), slots(n_slots), sizes


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 3), st.integers(1, 4), st.integers(0, 3))
def test_the_pipeline_is_valid_and_every_wait_is_needed(n_layers, every, n_slots, cpu_every):
    ops, sl, sizes = pipeline(n_layers, every, n_slots, cpu_every)
    assert validate(ops, sl, sizes) == []
    waits = [i for i, op in enumerate(ops) if isinstance(op, Wait)]
    for w in waits:  # each wait removed in turn: the validator must object
        assert validate(ops[:w] + ops[w + 1 :], sl, sizes), f"removing op {w} went unnoticed"


def test_copies_run_ahead_of_the_compute_up_to_the_ring_size():
    ops, _, _ = pipeline(6, 1, 2)
    copies = [i for i, op in enumerate(ops) if isinstance(op, Copy)]
    first_compute = next(i for i, op in enumerate(ops) if isinstance(op, Compute))
    assert sum(c < first_compute for c in copies) == 2  # both slots filled before layer 0 runs
    # the third copy goes right after its slot's last reader (layer0.b), before layer1 runs
    third = copies[2]
    assert ops[third - 1] == Wait(COPY, EventId(Signal.READ, group_unit("w0")))
    assert [op.name for op in ops[:third] if isinstance(op, Compute)] == ["layer0.a", "layer0.b"]


def test_a_cpu_step_waits_for_its_predecessor_and_is_waited_for():
    ops, sl, sizes = pipeline(3, 2, 2, cpu_every=1)  # layer0 streamed, layer1 on the CPU, layer2
    i = next(i for i, op in enumerate(ops) if isinstance(op, Compute) and op.name == "layer1")
    assert ops[i - 1] == Wait(HOST, EventId(Signal.DONE, "layer0.b")) and ops[i].queue == HOST
    assert ops[i + 1] == Record(HOST, EventId(Signal.DONE, "layer1"))
    assert validate(ops, sl, sizes) == []


def test_reading_a_slot_that_holds_another_tensor():
    ops = [
        Copy(COPY, "a", S0),
        Record(COPY, "e"),
        Wait(COMPUTE, "e"),
        Compute(COMPUTE, "k", (("b", S0),)),
    ]
    (err,) = validate(ops, slots(1), {"a": 10, "b": 10})
    assert "does not hold it" in err


def test_layout_errors():
    overlapping = {"s0": Slot("s0", 0, 100), "s1": Slot("s1", 50, 100)}
    ops = [Copy(COPY, "big", "s0")]
    errors = validate(ops, overlapping, {"big": 150})
    assert any("overlap" in e for e in errors) and any("does not fit" in e for e in errors)


def test_waiting_on_an_event_never_recorded():
    errors = validate([Wait(COMPUTE, "nope")], {}, {})
    assert errors == ["op 0: compute waits on 'nope', never recorded before"]


@pytest.mark.parametrize("late", [True, False])
def test_a_record_issued_after_the_wait_does_not_order(late):
    """CUDA waits on the most recent record at issue time: a later record does not count."""
    ops = [Copy(COPY, "a", S0), Record(COPY, "e")]
    use = [Wait(COMPUTE, "e"), Compute(COMPUTE, "k", (("a", S0),))]
    ops = [ops[0]] + use + [ops[1]] if late else ops + use
    assert bool(validate(ops, slots(1), {"a": 10})) == late
