"""CPU segments: the runs of consecutive CPU parts of a tier (within a layer and across layers),
each run on the host as one unit between two hand-offs of the activations.

A hybrid plan puts some parts on the CPU (`program.parts`, on the host's queue). Run one by one,
each costs a device round trip: wait for the device, copy its inputs down, compute, copy its
outputs up — also between two CPU parts in a row. A segment pays that once: at its start the
activations it reads go down in one batch of copies (into pinned staging) and the host waits
once; its parts run back to back on the host; at its end the activations the device reads next
go up in one batch, and the compute stream's later work is ordered after them without a wait.
`cpu_segments` derives them once per tier, a pure function of the parts:

- what a segment reads at its start: the activations its parts read before writing them, less
  those the host holds current (written or read on the host since the device last wrote them);
- what it writes at its end: the activations it writes that a later device part reads before
  anything writes them again;
- whether the host waits for the device at its start: when it reads something, or when the
  previous segment's upload may still be reading the staging buffers;
- the dense layers it covers whole: at decode each is one call of the cpu engine's fused layer
  (`kernels/cpu_layer.py`), whose only input and output is the residual `x`.

`SegmentRunner` runs a segment's parts on host arrays; the CUDA and stand-in engines share it.
What the segments leave out: the order of the work on the device, and the schedule's events,
which `schedule.pipeline_schedule` builds and `schedule.validate` proves (the `act` slot of a CPU
step is its hand-off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from refengine.spec import ModelSpec

from .hostweights import in_file
from .schedule import compute_queue

# what each part reads and writes of the activations (`hostmath.Act`, the device workspace)
FIELDS = {
    "embed": ((), ("x",)),
    "qkv": (("x",), ("q", "k", "v")),
    "kq": (("q", "k", "v"), ("a",)),
    "o": (("a", "x"), ("x", "h", "ids", "gates")),
    "ffn_gate": (("h",), ("gate",)),
    "ffn_up": (("h",), ("up",)),
    "ffn_down": (("gate", "up", "x"), ("x",)),
    "ffn_gate_exps": (("h", "ids"), ("gate",)),
    "ffn_up_exps": (("h", "ids"), ("up",)),
    "ffn_down_exps": (("gate", "up", "ids", "gates", "x"), ("x",)),
    "output": (("x",), ()),
}
MOE_ONLY = ("ids", "gates")


def fields(kind: str, moe: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(reads, writes) of a part of this kind; the router's fields only for MoE models."""
    return tuple(
        tuple(f for f in names if moe or f not in MOE_ONLY) for names in FIELDS[kind]
    )  # type: ignore[return-value]


@dataclass(frozen=True)
class Segment:
    first: int  # index in the tier's parts of its first part
    stop: int  # one past its last part
    reads: tuple[str, ...]  # handed device -> host at its start
    writes: tuple[str, ...]  # handed host -> device at its end
    sync: bool  # the host waits for the compute stream at its start
    layers: tuple[int, ...]  # dense layers it covers whole


@dataclass(frozen=True)
class _Unit:
    """A part, or a dense layer whole on the CPU (one fused call: it reads and writes only x)."""

    first: int
    stop: int
    cpu: bool
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    layer: int | None = None


def whole_layers(parts, moe: bool) -> set[int]:
    """Dense layers every part of which runs on the CPU (MoE layers run part by part)."""
    if moe:
        return set()
    on_cpu: dict[int, bool] = {}
    for p in parts:
        if p.layer is not None:
            on_cpu[p.layer] = on_cpu.get(p.layer, True) and p.queue.on_host
    return {il for il, cpu in on_cpu.items() if cpu}


def _units(parts, moe: bool) -> list[_Unit]:
    whole = whole_layers(parts, moe)
    out, i = [], 0
    while i < len(parts):
        p = parts[i]
        if p.layer in whole:
            j = i
            while j < len(parts) and parts[j].layer == p.layer:
                j += 1
            out.append(_Unit(i, j, True, ("x",), ("x",), p.layer))
            _check_only_x_leaves(parts, i, j, moe)
            i = j
            continue
        reads, writes = fields(p.kind, moe)
        out.append(_Unit(i, i + 1, p.queue.on_host, reads, writes))
        i += 1
    return out


def _check_only_x_leaves(parts, first: int, stop: int, moe: bool) -> None:
    """A fused layer hands on only x: nothing after it may read what its parts wrote but x
    before writing it again (true of `program.parts`: each layer writes what it reads)."""
    inner = {f for p in parts[first:stop] for f in fields(p.kind, moe)[1]} - {"x"}
    for p in parts[stop:]:
        reads, writes = fields(p.kind, moe)
        assert not inner & set(reads), f"{p.name} reads {inner & set(reads)} of a fused layer"
        inner -= set(writes)


def cpu_segments(parts, moe: bool) -> list[Segment]:
    """The CPU segments of a tier's parts (`program.parts`), in order."""
    units = _units(parts, moe)
    out: list[Segment] = []
    host_has: set[str] = set()  # activations the host holds current
    upload_in_flight = False
    i = 0
    while i < len(units):
        if not units[i].cpu:
            host_has -= set(units[i].writes)
            i += 1
            continue
        j = i
        while j < len(units) and units[j].cpu:
            j += 1
        reads, written = [], set()
        for u in units[i:j]:
            reads += [f for f in u.reads if f not in written | host_has and f not in reads]
            written |= set(u.writes)
        writes = tuple(f for f in sorted(written) if _read_on_device_next(units[j:], f))
        sync = bool(reads) or upload_in_flight
        out.append(Segment(units[i].first, units[j - 1].stop, tuple(reads), writes, sync,
                           tuple(u.layer for u in units[i:j] if u.layer is not None)))  # fmt: skip
        host_has |= set(reads) | written
        upload_in_flight = bool(writes) or (upload_in_flight and not sync)
        i = j
    return out


def _read_on_device_next(later: list[_Unit], field: str) -> bool:
    """Whether a device part reads `field` before anything writes it again."""
    for u in later:
        if field in u.reads and not u.cpu:
            return True
        if field in u.writes:
            return False
    return False


def ends_with_sync(parts, segments: list[Segment]) -> bool:
    """Whether the host must wait for the compute stream at the end of a ubatch: device work (a
    part, an upload, the inputs' copies at the start) was issued after its last wait. A ubatch
    whose last work was a segment that waited at its start and uploaded nothing ends without."""
    if not any(p.queue == compute_queue() for p in parts):
        return False  # nothing goes to the device, not even the inputs
    pending, at = True, {s.first: s for s in segments}
    i = 0
    while i < len(parts):
        s = at.get(i)
        if s is None:
            pending, i = True, i + 1
        else:
            pending, i = (pending and not s.sync) or bool(s.writes), s.stop
    return pending


# -- running a segment on the host ---------------------------------------------------------------


class SegmentRunner:
    """Runs a segment's parts on an `Act` with the CPU kernels (`HostMath`, the named int8 path):
    a kq part over the host KV mirror, the others over the group's host tensors, and a dense layer
    the segment covers whole, for a ubatch of fewer than `cpu.BLAS_TOKENS` tokens, as one call of
    the cpu engine's fused layer (`fused_layers`, over this engine's weights)."""

    def __init__(self, spec: ModelSpec, math, host, mirror):
        self.spec, self.math, self.host, self.mirror = spec, math, host, mirror
        self._fused = None  # built at the first whole layer of a decode ubatch
        self.calls = 0  # segments run

    def run(self, segment: Segment, parts, st, requested=frozenset()) -> None:
        from .kernels import cpu

        self.calls += 1
        fused = self._fused_layers() if segment.layers and st.tokens.size < cpu.BLAS_TOKENS else None
        done = -1
        for part in parts[segment.first : segment.stop]:
            if fused is not None and part.layer in segment.layers:
                if part.layer != done:
                    fused.run(st, part.layer, requested)
                    done = part.layer
            elif part.kind == "kq":
                self.math.kq_on_host(st, part.layer, self.mirror)
            else:
                self.math.run(part.kind, part.layer, st, self.host.tensors(part.group))

    def _fused_layers(self):
        if self._fused is None:
            from .fused_layers import FusedLayers

            self._fused = FusedLayers(self.spec, _GroupTensors(self.spec, self.host), self.math,
                                      self.mirror)  # fmt: skip
        return self._fused if self._fused.layers is not None else None


class _GroupTensors(Mapping):
    """group -> its tensors: from host memory where the engine holds the group, else read in place
    from the memory-mapped file (the layers no tier runs on the CPU, which the fused calls are
    built for but never run)."""

    def __init__(self, spec: ModelSpec, host):
        self.spec, self.host = spec, host
        self.layouts = host.layouts
        self._source = None

    def __getitem__(self, group: str) -> dict:
        if group in self.host.offsets:
            return self.host.tensors(group)
        if self._source is None:
            self._source = np.memmap(self.spec.path, dtype=np.uint8, mode="r").view(np.ndarray)
        return {p.info.name: in_file(self._source, p.info) for p in self.layouts[group]}

    def __iter__(self):
        return iter(self.layouts)

    def __len__(self) -> int:
        return len(self.layouts)
