"""Hand-offs inside the validated schedule: for random placements of a model's parts over the host
and 1-3 devices (a layer split), every activation field a step reads is brought to its place by a
copy of the schedule, and `schedule.validate` alone catches any hand-off copy or any wait removed;
the same of a tensor split's waits over 2-3 devices."""

from dataclasses import replace
from types import SimpleNamespace

from hypothesis import given, settings, strategies as st

from cudarun import split_parts
from cudarun.handoffs import handoffs
from cudarun.schedule import (
    ACT, HOST, Compute, Copy, Step, Wait, compute_queue, handed, pipeline_schedule, validate,
)

DENSE = ("ffn_gate", "ffn_up", "ffn_down")
ROUTED = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@st.composite
def placements(draw):
    """(steps, their kinds, moe): embed, each layer's qkv, kq, o and FFN parts, the output, on
    random places; qkv and o share the attention group's."""
    n_devices, moe = draw(st.integers(1, 3)), draw(st.booleans())
    places = [HOST] + [compute_queue(d) for d in range(n_devices)]
    where = st.sampled_from(places)
    steps, kinds = [Step("embed", draw(where))], {"embed": "embed"}
    for il in range(draw(st.integers(1, 4))):
        attn = draw(where)
        for kind, queue in (("qkv", attn), ("kq", draw(where)), ("o", attn),
                            *((k, draw(where)) for k in (ROUTED if moe else DENSE))):
            steps.append(Step(f"blk.{il}.{kind}", queue))
            kinds[steps[-1].name] = kind
    steps.append(Step("output", draw(where)))
    kinds["output"] = "output"
    return steps, kinds, moe


def layer_split(steps, kinds, moe):
    return handoffs(pipeline_schedule(steps, 1), kinds, moe)


def fields_only(ops):
    """The schedule without the coarse chain of whole activations: what the fields prove."""
    def drop(pairs):
        return tuple(p for p in pairs if p[1] != ACT)

    return [replace(op, reads=drop(op.reads), writes=drop(op.writes))
            if isinstance(op, Compute) else op for op in ops]  # fmt: skip


def hand_off_waits(ops) -> list[int]:
    """The waits that gate a hand-off copy, or a step reading what one brought: those on its
    queue since that queue's previous operation."""
    brought = {(op.tensor, op.slot) for op in ops if isinstance(op, Copy) and handed(op)}
    out = set()
    for i, op in enumerate(ops):
        if (isinstance(op, Copy) and handed(op)) or (
                isinstance(op, Compute) and any(r in brought for r in op.reads)):
            j = i - 1
            while j >= 0 and (ops[j].queue != op.queue or isinstance(ops[j], Wait)):
                if ops[j].queue == op.queue:
                    out.add(j)
                j -= 1
    return sorted(out)


@settings(max_examples=80, deadline=None)
@given(placements())
def test_every_hand_off_copy_and_wait_of_a_layer_split_is_proven_needed(placement):
    ops = layer_split(*placement)
    assert validate(ops, {}, {}) == []
    ops = fields_only(ops)  # the hand-offs alone carry the activations
    assert validate(ops, {}, {}) == []
    copies = [i for i, op in enumerate(ops) if isinstance(op, Copy) and handed(op)]
    for i in copies + hand_off_waits(ops):
        assert validate(ops[:i] + ops[i + 1 :], {}, {}), f"removing op {i} ({ops[i]}) passed"


def test_a_field_crosses_devices_through_the_host():
    steps = [Step("embed", HOST), Step("blk.0.qkv", compute_queue(0)),
             Step("blk.0.kq", compute_queue(1)), Step("blk.0.o", compute_queue(0))]  # fmt: skip
    kinds = {"embed": "embed", "blk.0.qkv": "qkv", "blk.0.kq": "kq", "blk.0.o": "o"}
    ops = layer_split(steps, kinds, False)
    moves = [(str(op.queue), str(op.tensor), str(op.reads[0][1]), str(op.slot))
             for op in ops if isinstance(op, Copy)]  # fmt: skip
    # x up to device 0; q, k, v down from device 0 and up to device 1; a back the same way
    assert moves == [
        ("compute", "x@embed", "x@host", "x@0"),
        ("compute", "q@blk.0.qkv", "q@0", "q@host"),
        ("compute", "k@blk.0.qkv", "k@0", "k@host"),
        ("compute", "v@blk.0.qkv", "v@0", "v@host"),
        ("compute@1", "q@blk.0.qkv", "q@host", "q@1"),
        ("compute@1", "k@blk.0.qkv", "k@host", "k@1"),
        ("compute@1", "v@blk.0.qkv", "v@host", "v@1"),
        ("compute@1", "a@blk.0.kq", "a@1", "a@host"),
        ("compute", "a@blk.0.kq", "a@host", "a@0"),
    ]


@settings(max_examples=20, deadline=None)
@given(st.integers(2, 3), st.integers(1, 3))
def test_every_wait_of_a_tensor_split_is_proven_needed(n_devices, n_layer):
    ops = split_parts.schedule(
        split_parts.parts(n_layer, SimpleNamespace(devices=list(range(n_devices)))))
    assert validate(ops, {}, {}) == []
    for i, op in enumerate(ops):
        if isinstance(op, Wait):
            assert validate(ops[:i] + ops[i + 1 :], {}, {}), f"removing op {i} ({op}) passed"
