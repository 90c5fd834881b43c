"""The runtime on a GPU: the plan's arena as one device allocation of the budget, weights and KV
copied from pinned host memory, the tier's schedule issued on a compute stream and a copy stream
ordered by CUDA events, the compute parts as Numba CUDA kernels (`devicemath`), the CPU parts on
the host thread with the CPU kernels (`hostmath`).

The CPU queue is the host thread itself: its waits synchronize on the events they name, it
downloads what its part reads (on the compute stream), computes, and uploads what the part writes,
so the compute stream's later work is ordered after it by issue; meanwhile the copy stream goes on
prefetching. It runs on numba.cuda's streams, events and arrays, so the same code runs under the
CUDA simulator in CI (tiny models, tiers of at most 16 tokens) and on a GPU.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import numpy as np

from refengine.spec import ModelSpec
from solver.cost import CPU, PINNED, STREAMED
from solver.workspace import MAX_DECODE_TOKENS, arrays, layout

from .devicemath import DeviceMath, device_tensors
from .executor import PlanExecutor, Tier, group_bytes, weight_steps
from .hostmath import Act, HostMath
from .kvstore import ring_chunks, ring_positions, ring_views
from .schedule import Compute, Copy, Record, Wait

# what each part reads and writes of the activations (handed between device and host)
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


def simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


class CudaEngine(PlanExecutor):
    name = "cuda"

    def __init__(self, spec: ModelSpec, plan: dict, threads: int = 0, progress: bool = False):
        from . import driver

        if not simulated():
            driver.init()  # one line, "no NVIDIA GPU ...", where there is none
            self.free_at_start = driver.mem_info()[0]
        from numba import cuda

        self.cuda = cuda
        super().__init__(spec, plan, progress)
        self.arena = cuda.device_array(self.budget_bytes, np.uint8)  # the one allocation
        if simulated():
            self.compute, self.copy = cuda.stream(), cuda.stream()
            self.streams = None
        else:  # raw non-blocking streams (graph capture needs their handles)
            self.streams = driver.Stream(), driver.Stream()
            self.compute, self.copy = (st.numba_stream() for st in self.streams)
        self.dmath = DeviceMath(spec, self.streams[0].ptr if self.streams else 0)
        self.graphs: dict[tuple[int, int], object] = {}  # (tier, tokens) -> captured decode
        self.graph_nodes: dict[tuple[int, int], int | None] = {}
        self.ran_eagerly: set[tuple[int, int]] = set()
        self.use_graphs = not simulated()
        self.cpu_math = HostMath(spec, False, threads)
        self.workspaces: dict[int, dict] = {}  # tier -> its workspace arrays

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Pinned host memory: copies from it are asynchronous, and nothing streams from pageable
        memory."""
        if simulated():
            return np.empty(nbytes, np.uint8)
        return self.cuda.pinned_array(nbytes, np.uint8)

    def memory_report(self) -> list[str]:
        out = super().memory_report()
        if not simulated():
            from . import driver

            used = self.free_at_start - driver.mem_info()[0]
            verdict = "within" if used <= self.budget_bytes else "OVER (a memory-model bug)"
            out.append(f"device memory used since the context was created: {used / 2**20:.1f} "
                       f"MiB, {verdict} the budget of {self.budget_bytes / 2**20:.1f} MiB")  # fmt: skip
        return out

    def launch_report(self, launch_seconds: float) -> list[str]:
        out = []
        for (tier, n), nodes in sorted(self.graph_nodes.items()):
            out.append(f"tier {tier}, {n} token(s): 1 CUDA graph launch per ubatch replays {nodes} "
                       f"kernels and copies, which at the profile's {launch_seconds * 1e6:.1f} us "
                       f"per launch would cost {nodes * launch_seconds * 1e3:.2f} ms")  # fmt: skip
        if not self.graph_nodes:
            out.append("no tier ran as a CUDA graph (a decode tier qualifies when all its work is "
                       "on the GPU and its KV resident)")  # fmt: skip
        return out

    # -- tier switch -----------------------------------------------------------------------------

    def switch(self, tier: Tier) -> None:
        self.synchronize()
        if self.current is not None:  # device-resident KV back to the mirror first
            for il, loc in self.current.place.kv.items():
                if loc.kind == PINNED:
                    self._download_kv(il, self.region(self.current, f"kv:{il}"),
                                      self.current.kv_cells[il])  # fmt: skip
        for s in weight_steps(self.current.map if self.current else None, tier.map):
            if s.kind == "move":
                src = self.arena[s.src : s.src + s.nbytes]
                if abs(s.src - s.dst) < s.nbytes:  # overlapping: through the host
                    src = src.copy_to_host()
                self.arena[s.dst : s.dst + s.nbytes].copy_to_device(src)
            elif s.kind == "upload":
                data = group_bytes(self, s.name.removeprefix("weights:"))
                self.arena[s.dst : s.dst + s.nbytes].copy_to_device(data)
        for il, loc in tier.place.kv.items():
            if loc.kind == PINNED:
                self._upload_kv(il, self.region(tier, f"kv:{il}"), tier.kv_cells[il], None)
        self.synchronize()
        self.current = tier

    def _upload_kv(self, il: int, buf, cells: int, stream) -> None:
        """Lay the mirror's positions [0, n_past) of layer il into a device KV ring `buf`."""
        k, v = self._ring(buf, cells)
        for p, cell, n in ring_chunks(cells, 0, self.n_past):
            k[cell : cell + n].copy_to_device(self.mirror.k[il][p : p + n], stream=stream or 0)
            v[cell : cell + n].copy_to_device(self.mirror.v[il][p : p + n], stream=stream or 0)

    def _download_kv(self, il: int, buf, cells: int) -> None:
        """The ring's positions (the last `cells` of [0, n_past)) into the mirror."""
        k, v = self._ring(buf, cells)
        for p, cell, n in ring_chunks(cells, 0, self.n_past):
            k[cell : cell + n].copy_to_host(self.mirror.k[il][p : p + n])
            v[cell : cell + n].copy_to_host(self.mirror.v[il][p : p + n])

    def _ring(self, buf, cells: int):
        return ring_views(buf, cells, self.mirror.k_shape, self.mirror.v_shape)

    def synchronize(self) -> None:
        self.compute.synchronize()
        self.copy.synchronize()

    # -- one ubatch ------------------------------------------------------------------------------

    def workspace(self, tier: Tier) -> dict:
        if tier.tier not in self.workspaces:
            rows = 1 if tier.place.groups["output"].kind != CPU else 0
            slices = layout(self.spec, tier.tier, rows, self.n_ctx)
            self.workspaces[tier.tier] = arrays(self.region(tier, "workspace"), slices)
        return self.workspaces[tier.tier]

    def execute(self, tier: Tier, st: Act) -> None:
        n, start = st.tokens.size, int(st.pos[0])
        ws = self.workspace(tier)
        host = Act(st.tokens, st.pos, st.all_logits)  # the CPU parts' activations
        ws["tokens"][:n].copy_to_device(st.tokens, stream=self.compute)
        ws["pos"][:n].copy_to_device(st.pos, stream=self.compute)
        for key, cells in self._cell_counts(tier).items():
            ws[key][:cells].copy_to_device(ring_positions(cells, start + n), stream=self.compute)
        key = (tier.tier, n)
        if self._graphable(tier, st) and key in self.ran_eagerly:  # kernels compiled by then
            if key not in self.graphs:
                self.graphs[key] = self._capture(tier, st, ws)
            self.graphs[key].launch(self.streams[0])
            st.logits = np.empty((1, self.spec.hparams.n_vocab), np.float32)
            ws["logits"][:1].copy_to_host(st.logits, stream=self.compute)
        else:
            self._issue(tier, st, ws, host, capturing=False)
            self.ran_eagerly.add(key)
        self.synchronize()

    def _graphable(self, tier: Tier, st: Act) -> bool:
        """A decode ubatch whose work is all on the device, its KV resident: one CUDA graph (its
        streamed-weight copies included) replayed per token."""
        return (
            self.use_graphs
            and st.tokens.size <= MAX_DECODE_TOKENS
            and not st.all_logits
            and not self.requested
            and self.trace_events is None  # a traced run is timed op by op, eagerly
            and all(p.queue == "compute" for p in tier.parts)
            and all(loc.kind != STREAMED for loc in tier.place.kv.values())
        )

    def _capture(self, tier: Tier, st: Act, ws: dict):
        from . import driver

        compute, copy = self.streams
        compute.begin_capture()
        fork, join = driver.Event(timing=False), driver.Event(timing=False)
        fork.record(compute)
        copy.wait(fork)  # the copy stream joins the capture
        self._issue(tier, st, ws, None, capturing=True)
        join.record(copy)
        compute.wait(join)
        graph = compute.end_capture()
        self.graph_nodes[(tier.tier, st.tokens.size)] = graph.node_count()
        return graph

    def _issue(self, tier: Tier, st: Act, ws: dict, host: Act | None, capturing: bool) -> None:
        """Issue the tier's schedule: copies on the copy stream, device parts on the compute
        stream, CPU parts on this thread, events between them."""
        events: dict[str, object] = {}
        parts = {p.name: p for p in tier.parts}
        timer = _Timer(self) if self.trace_events is not None and not capturing else None
        for op in tier.schedule:
            if isinstance(op, Record):
                # untimed events are cheaper; the simulator's take no arguments
                ev = events[op.event] = self.cuda.event() if simulated() else self.cuda.event(False)
                ev.record(self.copy if op.queue == "copy" else self.compute)
            elif isinstance(op, Wait):
                if op.queue == "cpu":
                    events[op.event].synchronize()
                else:
                    events[op.event].wait(self.copy if op.queue == "copy" else self.compute)
            elif isinstance(op, Copy):
                with _span(timer, "copy", f"copy {op.tensor}", self.copy):
                    self._copy_unit(tier, op.tensor, op.slot)
            elif isinstance(op, Compute):
                part = parts[op.name]
                slot = next((s for _, s in op.reads if s.startswith("slot:")), None)
                if part.queue == "cpu":
                    with _span(timer, "cpu", op.name, None):
                        self._cpu_part(tier, part, st, host, ws)
                else:
                    with _span(timer, "compute", op.name, self.compute):
                        self._device_part(tier, part, st, ws, slot, capturing)
        if timer is not None:
            self.synchronize()
            self.trace_events.extend(timer.events())

    def _cell_counts(self, tier: Tier) -> dict[str, int]:
        out = {}
        for il, cells in tier.kv_cells.items():
            if tier.place.kv[il].kind != CPU:
                out["k_pos_swa" if self.spec.is_swa(il) else "k_pos"] = cells
        return out

    def _slot(self, tier: Tier, slot: str):
        return self.region(tier, "scratch:" + slot.removeprefix("slot:"))

    def _copy_unit(self, tier: Tier, unit: str, slot: str) -> None:
        buf = self._slot(tier, slot)
        if unit.startswith("kv:"):
            il = int(unit[3:])
            self._upload_kv(il, buf, tier.kv_cells[il], self.copy)
        else:
            data = self.host.group(unit)
            buf[: data.size].copy_to_device(data, stream=self.copy)

    def _weights(self, tier: Tier, group: str, slot: str | None) -> dict:
        loc = tier.place.groups[group]
        buf = (
            self.region(tier, f"weights:{group}") if loc.kind == PINNED else self._slot(tier, slot)
        )
        return device_tensors(self.host.layouts[group], buf[: self.groups[group].nbytes])

    def _device_part(self, tier: Tier, part, st: Act, ws: dict, slot: str | None,
                     capturing: bool = False) -> None:  # fmt: skip
        n, s = st.tokens.size, self.compute
        if part.kind == "kq":
            il = part.layer
            loc = tier.place.kv[il]
            buf = self.region(tier, f"kv:{il}") if loc.kind == PINNED else self._slot(tier, slot)
            cells = tier.kv_cells[il]
            k, v = self._ring(buf, cells)
            k_pos = ws["k_pos_swa" if self.spec.is_swa(il) else "k_pos"][:cells]
            # cells past the last position are empty; a graph replays at every position
            used = cells if capturing else min(cells, int(st.pos[-1]) + 1)
            self.dmath.kq(ws, n, il, k, v, k_pos, s, used)
            if loc.kind == PINNED:  # the ring stays; the mirror catches up at the next switch
                return
            start = int(st.pos[0])  # a streamed KV's new rows go back to the host
            ws["k_stage"][:n].copy_to_host(
                self.mirror.k[il][start : start + n].reshape(n, -1), stream=s
            )
            ws["v_stage"][:n].copy_to_host(
                self.mirror.v[il][start : start + n].reshape(n, -1), stream=s
            )
            return
        w = self._weights(tier, part.group, slot)
        getattr(self.dmath, part.kind)(ws, n, w, part.layer, s)
        if part.kind.startswith("ffn_down"):
            self._record(st, f"blk.{part.layer}.out", ws["x"][:n])
        elif part.kind == "output" and capturing:
            self.dmath.head(ws, w, n - 1, s)  # the logits are read after the replay
        elif part.kind == "output":
            self._record(st, "output_norm", ws["h"][:n])
            rows = range(n) if st.all_logits else [n - 1]
            st.logits = np.empty((len(rows), self.spec.hparams.n_vocab), np.float32)
            for i, r in enumerate(rows):
                self.dmath.head(ws, w, r, s)
                ws["logits"][:1].copy_to_host(st.logits[i : i + 1], stream=s)
                s.synchronize()

    def _record(self, st: Act, name: str, dev) -> None:
        if name in self.requested:
            st.record[name] = dev.copy_to_host(stream=self.compute)
            self.compute.synchronize()

    def _cpu_part(self, tier: Tier, part, st: Act, host: Act, ws: dict) -> None:
        reads, writes = (
            [f for f in fields if self.spec.arch.moe or f not in ("ids", "gates")]
            for fields in FIELDS[part.kind]
        )
        n = st.tokens.size
        for f in reads:
            setattr(host, f, self._download(f, ws, n))
        self.compute.synchronize()
        if part.kind == "kq":
            self.cpu_math.kq_on_host(host, part.layer, self.mirror)
        else:
            w = self.host.tensors(part.group)
            host.record = st.record
            self.cpu_math.run(part.kind, part.layer, host, w)
        for f in writes:
            self._upload(f, getattr(host, f), ws)
        if part.kind == "output":
            st.logits = host.logits

    def _download(self, field: str, ws: dict, n: int) -> np.ndarray:
        used = self.spec.hparams.n_expert_used
        if field in ("gate", "up") and self.spec.arch.moe:
            return ws[field][: n * used].copy_to_host(stream=self.compute).reshape(n, used, -1)
        out = ws[field][:n].copy_to_host(stream=self.compute)
        return out.astype(np.int64) if field == "ids" else out

    def _upload(self, field: str, value: np.ndarray, ws: dict) -> None:
        dst = ws[field]  # MoE's [T, k, n] host arrays are [T * k, n] rows on the device
        rows = np.ascontiguousarray(value, dtype=dst.dtype).reshape(-1, *dst.shape[1:])
        dst[: rows.shape[0]].copy_to_device(rows, stream=self.compute)


class _Timer:
    """Spans of a traced ubatch: device work timed by CUDA events on its stream (against one
    event recorded, and waited for, when the host clock is read), CPU parts by the host clock.
    Under the simulator, whose streams run as they are issued, the host clock times everything."""

    def __init__(self, engine: CudaEngine):
        self.engine, self.spans = engine, []
        if not simulated():
            self.base = engine.cuda.event()
            self.base.record(engine.compute)
            self.base.synchronize()
        self.host0 = time.perf_counter()

    def events(self) -> list[tuple[str, str, float, float]]:
        out = []
        for lane, name, a, b in self.spans:
            if isinstance(a, float):
                out.append((lane, name, a, b))
            else:
                start = self.host0 + self.engine.cuda.event_elapsed_time(self.base, a) / 1e3
                out.append((lane, name, start, self.host0 +
                            self.engine.cuda.event_elapsed_time(self.base, b) / 1e3))  # fmt: skip
        return out


@contextmanager
def _span(timer: _Timer | None, lane: str, name: str, stream):
    if timer is None:
        yield
        return
    if stream is None or simulated():
        start = time.perf_counter()
        yield
        timer.spans.append((lane, name, start, time.perf_counter()))
        return
    a, b = timer.engine.cuda.event(), timer.engine.cuda.event()
    a.record(stream)
    yield
    b.record(stream)
    timer.spans.append((lane, name, a, b))


def require_gpu() -> None:
    """One line, before any solving, where the cuda engine cannot run."""
    if not simulated():
        from . import driver

        driver.init()
