"""Kernel launches and host synchronizations per ubatch: counted by the CUDA engine where they
happen, and derived from a plan's tier without running it.

Counted: the engine holds a `Counter` active on its thread while it issues a ubatch. Every kernel
launch goes through one place in Numba (`_Kernel.launch` on a GPU, `FakeCUDAKernel.__call__`
under the simulator), which `install` wraps once to add one to the thread's active counter; the
cuBLAS products of the prefill path (`kernels.prefill.gemm_fp16`, outside Numba) count one each;
a CUDA graph's replay counts as one launch, its capture as none. The engine counts its own host
synchronizations (`CudaEngine.sync`) and hand-offs.

Derived (`tier_counts`): from the tier's parts (`program.parts`), their queues,
the CPU segments (`segments.cpu_segments`) and whether the tier is captured as a CUDA graph —
the launches of each device part as `devicemath` issues them (`part_launches`; when a part's
kernels change, this table changes with it, and tests/test_segments.py holds the two equal under
the simulator). So the counts of an 8B plan print without the model file or a GPU.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields

from refengine.spec import ModelSpec
from solver.cost import STREAMED, Operations, TierPlacement, hops_between
from solver.workspace import INT8_TYPES, MAX_DECODE_TOKENS, matrix_launches

from . import program
from .schedule import HOST, Compute, Copy, Record, Signal, Wait, compute_queue, handed
from .segments import Segment, cpu_segments, ends_with_sync


@dataclass(frozen=True)
class Counts:
    """What one ubatch issues."""

    launches: int = 0  # kernel launches (a graph replay: one)
    syncs: int = 0  # host waits for the device
    segments: int = 0  # CPU segments run
    downloads: int = 0  # device -> host hand-offs (a batch of copies, then one wait)
    uploads: int = 0  # host -> device hand-offs (a batch of copies, no wait)

    def __add__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


def schedule_operations(ops, sums: frozenset[str] = frozenset()) -> Operations:
    """What a schedule moves, as the cost model counts it (`CostModel.ubatch_operations`): its
    weights' and KV's copies (not the hand-offs'), its sums over the devices (the computes named
    in `sums`: a tensor split's `*_sum` parts) and its hops: each wait of a queue for another's
    hand-off (`done` event), one between the CPU and a device, two between devices (through the
    host)."""
    where = {op.event: op.queue for op in ops if isinstance(op, Record)}
    return Operations(
        copies=sum(isinstance(op, Copy) and not handed(op) for op in ops),
        all_reduces=sum(isinstance(op, Compute) and op.name in sums for op in ops),
        hops=sum(hops_between(where[op.event].device, op.queue.device) for op in ops
                 if isinstance(op, Wait) and op.event.signal is Signal.DONE),
    )  # fmt: skip


# -- counted -------------------------------------------------------------------------------------

_active = threading.local()


class Counter:
    """A ubatch's launches (counted at Numba's launch while `counting` is active on the thread)
    and the engine's syncs, segments and hand-offs."""

    def __init__(self):
        self.launches = self.syncs = self.segments = self.downloads = self.uploads = 0

    def counts(self) -> Counts:
        return Counts(self.launches, self.syncs, self.segments, self.downloads, self.uploads)


@contextmanager
def counting(counter: Counter | None):
    """Launches issued on this thread inside go to `counter` (None: to nobody, as while a CUDA
    graph is captured: its kernels are launched by its replays)."""
    install()
    before = getattr(_active, "counter", None)
    _active.counter = counter
    try:
        yield counter
    finally:
        _active.counter = before


def note_launch(n: int = 1) -> None:
    counter = getattr(_active, "counter", None)
    if counter is not None:
        counter.launches += n


def install() -> None:
    """Wrap Numba's one launch entry, and the prefill's cuBLAS product, to count (idempotent; done
    again if a test put the originals back)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        from numba.cuda.simulator import kernel as sim

        def launched(self, *args):  # a device function, or a call inside a kernel, is no launch
            return not self._device and sim._kernel_context is None

        _wrap(sim.FakeCUDAKernel, "__call__", launched)
    else:
        from numba.cuda import dispatcher

        _wrap(dispatcher._Kernel, "launch", lambda self, *a, **k: True)
    from .kernels import prefill

    if hasattr(prefill, "gemm_fp16"):
        _wrap(prefill, "gemm_fp16", lambda *a, **k: True)


def _wrap(owner, name: str, is_launch) -> None:
    original = getattr(owner, name)
    if getattr(original, "counts_launches", False):
        return

    def counted(*args, **kwargs):
        if is_launch(*args, **kwargs):
            note_launch()
        return original(*args, **kwargs)

    counted.counts_launches = True
    counted.__wrapped__ = original
    setattr(owner, name, counted)


class Tally:
    """Per (tier, tokens, graph): the ubatches run and the sum of their counts."""

    def __init__(self):
        self.rows: dict[tuple[int, int, bool], tuple[int, Counts]] = {}

    def add(self, tier: int, tokens: int, graph: bool, counts: Counts) -> None:
        n, total = self.rows.get((tier, tokens, graph), (0, Counts()))
        self.rows[tier, tokens, graph] = (n + 1, total + counts)

    def clear(self) -> None:
        self.rows.clear()


# -- derived -------------------------------------------------------------------------------------


def glu_layers(parts, device: int = 0) -> frozenset[int]:
    """The layers whose gate and up products both run on the device (gate first, in program
    order), and whose down product runs there or on the host: there the up product's epilogue
    gates (`DeviceMath.ffn_up`) and `ffn_down` does not."""
    where = {(p.layer, p.kind): p.queue for p in parts}
    on = compute_queue(device)
    return frozenset(
        il for (il, kind), q in where.items()
        if kind == "ffn_gate" and q == on and where.get((il, "ffn_up")) == on
        and where.get((il, "ffn_down"), on) in (on, HOST)
    )  # fmt: skip


def part_launches(spec: ModelSpec, part, tokens: int, glu: frozenset[int] = frozenset()) -> int:
    """The kernels `devicemath` launches for one device part of a ubatch of `tokens` tokens (the
    output part: the final norm and the head of the last row); `glu`: `glu_layers`."""
    tr, il = spec.arch, part.layer
    p = f"blk.{il}."
    post = 1 if tr.post_norms else 0
    if part.kind == "embed":
        return 1 + bool(tr.embed_scale)
    if part.kind == "qkv":  # norm, Q, K, V (one launch up to the matvec tokens), Q/K norm + RoPE
        if tokens <= MAX_DECODE_TOKENS:  # the input quantized once where all three are int8
            return 3 + all(_int8(spec, f"{p}attn_{m}.weight") for m in "qkv")
        return 1 + sum(matrix_launches(spec, f"{p}attn_{m}.weight", tokens) for m in "qkv") + 1
    if part.kind == "kq":  # the KV store, then split-KV decode (partial + merge) or prefill
        return 1 + (2 if tokens <= MAX_DECODE_TOKENS else 1)
    if part.kind == "o":  # output product, post-norm, residual add, FFN norm (+ router, route)
        router = matrix_launches(spec, p + "ffn_gate_inp.weight", tokens) + 1 if tr.moe else 0
        return matrix_launches(spec, p + "attn_output.weight", tokens) + post + 2 + router
    if part.kind == "ffn_gate":
        return matrix_launches(spec, p + "ffn_gate.weight", tokens)
    if part.kind == "ffn_up":  # the gating: in the matvec's epilogue, after the panels' products
        gating = il in glu and tokens > MAX_DECODE_TOKENS
        # at decode after the gate product, the input it quantized (`DeviceMath.ffn_up`)
        ready = il in glu and tokens <= MAX_DECODE_TOKENS and _int8(spec, p + "ffn_gate.weight")
        return matrix_launches(spec, p + "ffn_up.weight", tokens) + gating - (
            ready and _int8(spec, p + "ffn_up.weight"))

    if part.kind == "ffn_down":  # gating (unless the up product did), product, post-norm, add
        return (il not in glu) + matrix_launches(spec, p + "ffn_down.weight", tokens) + post + 1
    if part.kind in ("ffn_gate_exps", "ffn_up_exps"):  # (the input quantized), the experts
        return 1 + _int8(spec, f"{p}{part.kind}.weight")
    if part.kind == "ffn_down_exps":  # gating, (quantized), experts, combine, post-norm, add
        return 3 + _int8(spec, f"{p}ffn_down_exps.weight") + post + 1
    if part.kind == "output":
        head = "token_embd.weight" if spec.tied_output else "output.weight"
        return 1 + matrix_launches(spec, head, 1)
    raise ValueError(f"unknown part kind {part.kind!r}")


def _int8(spec: ModelSpec, name: str) -> bool:
    """A product that runs in integers at decode: its input quantized first (`kernels.int8`)."""
    return spec.by_name[name].qtype.name in INT8_TYPES


def graphable(parts, place: TierPlacement, tokens: int) -> bool:

    """The plan's half of `CudaEngine`'s capture condition: a decode ubatch whose parts are all on
    the device and whose KV is resident (the engine adds: on a GPU, not traced, no activations
    requested, the last row's logits only)."""
    return (
        tokens <= MAX_DECODE_TOKENS
        and all(p.queue == compute_queue() for p in parts)
        and all(loc.kind != STREAMED for loc in place.kv.values())
        and not any(p.routed_by for p in parts)  # a routed copy's rows are read at run time
    )


def ubatch_counts(spec: ModelSpec, parts, segments: list[Segment], final_sync: bool,
                  tokens: int, graph: bool) -> Counts:  # fmt: skip
    """What the CUDA engine issues for one ubatch of `tokens` tokens of one sequence of a tier (the
    last row's logits; no activations requested, untraced); several sequences add an attention
    launch a sequence on full-context layers and head launches a chunk of rows."""
    if graph:  # one replay, one wait for it
        return Counts(1, 1)
    glu = glu_layers(parts)
    launches = sum(part_launches(spec, p, tokens, glu) for p in parts
                   if p.queue == compute_queue())  # fmt: skip
    queue = {p.name: p.queue for p in parts}
    # a router's choice (or its prediction) read back on the device before the routed copies
    readbacks = {b for p in parts for b in (p.routed_by, p.predicted_by) if b}
    predicting = {p.layer for p in parts if p.predicted_by}
    launches += sum(2 + matrix_launches(spec, f"blk.{il}.ffn_gate_inp.weight", tokens)
                    for il in predicting)  # norm, router, top-k  # fmt: skip
    return Counts(
        launches,
        sum(s.sync for s in segments) + final_sync
        + sum(queue[b] == compute_queue() for b in readbacks),
        len(segments),
        sum(bool(s.reads) for s in segments),
        sum(bool(s.writes) for s in segments),
    )


def tier_counts(spec: ModelSpec, place: TierPlacement, tokens: int,
                graphs: bool = True) -> tuple[Counts, bool]:  # fmt: skip
    """(counts of one ubatch of `tokens` tokens under this placement, whether it is a CUDA graph
    replay); `graphs`: whether the engine captures graphs (on a GPU; not under the simulator)."""
    parts = program.parts(spec, place)
    segments = cpu_segments(parts, spec.arch.moe)
    graph = graphs and graphable(parts, place, tokens)
    return ubatch_counts(spec, parts, segments, ends_with_sync(parts, segments), tokens,
                         graph), graph  # fmt: skip


def report_lines(engine) -> list[str]:
    """Per tier of the engine's plan: the launches, host syncs and CPU segments per token it
    counted on its runs (what it counts: the stand-in counts only segments), beside what the
    tier's schedule says the CUDA engine issues (on a GPU for an engine without one)."""
    tally, counted = getattr(engine, "tally", None), getattr(engine, "counted", ())
    if tally is None:
        return []
    out = []
    for t in sorted(engine.tiers):
        tier = engine.tiers[t]
        rows = sorted((k, v) for k, v in tally.rows.items() if k[0] == t)
        if not rows and engine.shares is None:
            want, graph = _expected(engine, tier, t, None)
            out.append(f"tier {t}, not run: scheduled {_per_token(want, t, graph)}")
        for (_, n, graph), (ubatches, total) in rows:
            if engine.shares is not None:  # a tensor split's parts have no launch table yet
                got = ", ".join(f"{getattr(total, f) / ubatches / n:.2f} {f}" for f in counted)
                out.append(f"tier {t}, {n}-token ubatches ({ubatches} run): counted per token "
                           f"{got}")  # fmt: skip
                continue
            # an engine that counts launches ran eagerly or as a graph; the others: as a GPU would
            want, want_graph = _expected(engine, tier, n, graph if "launches" in counted else None)
            got = ", ".join(f"{getattr(total, f) / ubatches / n:.2f} {f}" for f in counted)
            out.append(f"tier {t}, {n}-token ubatches ({ubatches} run"
                       f"{', CUDA graph' if graph else ''}): counted per token {got}; scheduled "
                       f"{_per_token(want, n, want_graph)}")  # fmt: skip
    return out


def _expected(engine, tier, tokens: int, graph: bool | None) -> tuple[Counts, bool]:
    """The schedule's counts of a ubatch: as a graph replay or eagerly, as given (None: a graph
    where a GPU would capture one)."""
    graph = graphable(tier.parts, tier.place, tokens) if graph is None else graph
    return ubatch_counts(engine.spec, tier.parts, tier.segments, tier.final_sync, tokens,
                         graph), graph  # fmt: skip


def _per_token(c: Counts, tokens: int, graph: bool) -> str:
    return (f"{c.launches / tokens:.2f} launches, {c.syncs / tokens:.2f} syncs, "
            f"{c.segments / tokens:.2f} segments per token ({'CUDA graph' if graph else 'eager'}"
            f"; per ubatch {c.downloads} hand-offs down, {c.uploads} up)")  # fmt: skip
