"""The runtime on a GPU: the plan's arena as one device allocation of the budget, weights and KV
copied from pinned host memory, the tier's schedule issued on a compute stream and a copy stream
ordered by CUDA events, the compute parts as Numba CUDA kernels (`devicemath`), the CPU parts on
the host thread with the CPU kernels (`hostmath`), a segment at a time.

The CPU queue is the host thread itself. Consecutive CPU parts run as one segment
(`segments.py`): the activations it reads go down from the device once, into pinned staging on
the compute stream, and the host waits once; its parts run back to back on the host; what the
device reads next goes up once, on the compute stream, so the device's later work is ordered
after it by issue, without a wait. Meanwhile the copy stream goes on prefetching. The engine counts
its kernel launches and host synchronizations per ubatch (`counts.py`, `tally`). It runs on
numba.cuda's streams, events and arrays, so the same code runs under the CUDA simulator in CI
(tiny models, tiers of at most 16 tokens) and on a GPU.
"""

from __future__ import annotations

import gc
import os
import time
from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from refengine.spec import ModelSpec
from refengine.weights import GGUFWeights
from solver import regions
from solver.cost import CPU, PINNED, ROUTED
from solver.groups import EXPERTS
from solver.workspace import MAX_DECODE_TOKENS, arrays, layout, nbytes

from . import counts, program
from .device_hops import DeviceHops
from .device_shards import DeviceShards
from .devicemath import CACHE_SLOTS, CACHED, ROUTED_IDS, DeviceMath, device_tensors
from .executor import PlanExecutor, Tier, group_bytes, weight_steps
from .plan_check import PlanError
from .expert_cache import Admission
from .hostmath import Act, HostMath
from .hostweights import cache_ranges, cache_stacks, routed_ranges
from .kvstore import EMPTY, host_runs, kv_views
from .program import routed_experts
from .schedule import (
    Compute, Copy, EventId, Lane, Record, Signal, SlotId, SlotKind, Unit, UnitKind, Wait,
    compute_queue, copy_queue, handed,
)
from .segments import Segment, SegmentRunner
from .shards import shard_spec, share_bytes


# what every ubatch with device parts uploads, beside the KV cells' keys
INPUTS = ("tokens", "pos", "q_key", "write", "write_swa")


def simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


class CudaEngine(PlanExecutor):
    name = "cuda"

    def __init__(self, spec: ModelSpec, plan: dict, threads: int = 0, progress: bool = False,
                 n_seq: int = 1, unified: bool = False):  # fmt: skip
        from . import driver

        if not simulated():
            driver.init()  # one line, "no NVIDIA GPU ...", where there is none
            self.free_at_start = driver.mem_info()[0]
        self.free_marks: list[tuple[str, int]] = []  # (after what, free device bytes)
        from numba import cuda

        self.cuda = cuda
        super().__init__(spec, plan, progress, n_seq, unified)
        # one allocation a device; several budgets are virtual devices of this GPU, each its own
        # arena and streams, the activations handed between them through pinned host memory
        self.arenas = [cuda.device_array(b, np.uint8) for b in self.budgets]
        self.arena = self.arenas[0]
        self.queues, self.dmaths, raw = {}, {}, []
        for d in range(len(self.budgets)):
            if simulated():
                pair = cuda.stream(), cuda.stream()
            else:  # raw non-blocking streams (graph capture needs their handles)
                raw.append((driver.Stream(), driver.Stream()))
                pair = tuple(st.numba_stream() for st in raw[-1])
            self.queues[compute_queue(d)], self.queues[copy_queue(d)] = pair
            self.dmaths[d] = DeviceMath(self.device_spec(d), raw[-1][0].ptr if raw else 0)
            if self.shares is not None:  # gate, up and down of every layer on each device
                self.dmaths[d].glu_layers = frozenset(range(spec.hparams.n_layer))
        self.streams = raw[0] if raw else None
        self.compute, self.copy = self.queues[compute_queue()], self.queues[copy_queue()]
        self.dmath = self.dmaths[0]
        self.graphs: dict[tuple[int, int], object] = {}  # (tier, tokens) -> captured decode
        self.graph_nodes: dict[tuple[int, int], int | None] = {}
        self.ran_eagerly: set[tuple[int, int]] = set()
        self.use_graphs = not simulated()
        self.cpu_math = HostMath(spec, False, threads)
        self.runner = SegmentRunner(spec, self.cpu_math, self.host, self.mirror)
        self.workspaces: dict[int, dict] = {}  # tier -> its workspace arrays
        self.stagings: dict[int, dict] = {}  # tier -> its pinned host staging arrays
        self.pinned: list = []  # the staging buffers' owners
        self.swa_stages: dict[tuple[int, int], np.ndarray] = {}  # (tier, layer) -> pinned rows
        self.copy_done = self._event()  # the copy stream's end, waited for by the compute stream
        self.tally = counts.Tally()  # launches, syncs, segments per (tier, tokens, graph)
        self.counted = ("launches", "syncs", "segments")
        self.counter: counts.Counter | None = None  # the ubatch being issued
        self.pending_logits: np.ndarray | None = None  # filled from staging after the last wait
        self.routed_held: dict[str, int] = {}  # routed stack -> experts its slot holds now
        self.field_buffers: dict[tuple, np.ndarray] = {}  # (tier, key) -> pinned (`pinned_rows`)
        self.hops = DeviceHops(self)  # a layer split over several devices: their hand-offs
        self.shards = None  # a tensor split: its parts, and the file its shares are cut from
        if self.shares is not None:
            self.shards, self.weights_file = DeviceShards(self), GGUFWeights(spec)
        self._mark("construction (arenas, streams)")

    def _mark(self, after: str) -> None:
        if not simulated():
            from . import driver

            self.free_marks.append((after, driver.mem_info()[0]))

    def warm_up(self) -> None:
        super().warm_up()
        self._mark("warm-up (kernels loaded, cuBLAS's handle, workspaces)")

    def device_spec(self, d: int) -> ModelSpec:
        """The model as device d's kernels see it: under a tensor split, its shares'."""
        return self.spec if self.shares is None else shard_spec(self.spec, self.shares, d)

    def host_alloc(self, nbytes: int) -> np.ndarray:
        """Pinned host memory: copies from it are asynchronous, and nothing streams from pageable
        memory."""
        if simulated():
            return np.empty(nbytes, np.uint8)
        return self.cuda.pinned_array(nbytes, np.uint8)

    def device_path(self, tier: int, kind: str) -> str:
        """The named path of a device part (`PlanExecutor.path`): past MAX_DECODE_TOKENS a dense
        matmul multiplies fp16 panels through cuBLAS (`DeviceMath.mm`); the expert matvecs and
        the head (one row at a time) stay on the matvec kernels at any tier."""
        if tier > MAX_DECODE_TOKENS and not kind.endswith("_exps") and kind != "output":
            return "fp16"
        return "fp32"

    def warm_up_tokens(self, tier: int) -> int:
        """Past MAX_DECODE_TOKENS a ubatch takes the prefill path (fp16 panels, cuBLAS, the
        prefill attention): a tier that reaches it warms up on it, so the first prompt compiles
        nothing inside its TTFT."""
        return min(tier, MAX_DECODE_TOKENS + 1, self.n_ctx) if tier > MAX_DECODE_TOKENS else 1

    def memory_report(self) -> list[str]:
        out = super().memory_report()
        if not simulated():
            from . import driver

            runtime = self.plan.runtime_nbytes * len(self.budgets)
            used, budget = self.free_at_start - driver.mem_info()[0], sum(self.budgets) + runtime
            outside = used - sum(a.nbytes for a in self.arenas)
            out.append(f"device memory used since the context was created: {used / 2**20:.1f} "
                       f"MiB, {'within' if used <= budget else 'OVER'} the budget of "
                       f"{budget / 2**20:.1f} MiB"
                       + (" (its virtual devices' together)" if len(self.budgets) > 1 else "")
                       + f": the arena{'s' if len(self.arenas) > 1 else ''} and "
                       f"{outside / 2**20:.1f} MiB outside (cuBLAS's handle, the kernels' code, "
                       f"CUDA graphs; the plan left {runtime / 2**20:.1f} MiB for them)")  # fmt: skip
            before = self.free_at_start - sum(a.nbytes for a in self.arenas)
            for after, free in self.free_marks:  # where the memory outside the arenas came from
                out.append(f"  outside the arenas after {after}: {(before - free) / 2**20:.1f} MiB")
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
            for il, buf, heads in self._resident_kv(self.current):
                self._download_kv(il, buf, self.current.kv_cells[il], heads)
        self.pool = self.new_pool(tier)
        for d, arena in enumerate(self.arenas):
            before = self.current.map.get(d, []) if self.current else None
            for s in weight_steps(before, tier.map.get(d, [])):
                if s.kind == "move":
                    src = arena[s.src : s.src + s.nbytes]
                    if abs(s.src - s.dst) < s.nbytes:  # overlapping: through the host
                        src = src.copy_to_host()
                    arena[s.dst : s.dst + s.nbytes].copy_to_device(src)
                elif s.kind == "upload":
                    data = self._group_bytes(s.region.key, d)
                    arena[s.dst : s.dst + s.nbytes].copy_to_device(data)
        self.current = tier
        for il, buf, heads in self._resident_kv(tier):
            self._upload_kv(il, buf, tier.kv_cells[il], None, heads)
        # the moves and uploads above ran on the legacy default stream, which our non-blocking
        # streams do not wait for: the whole context, before the tier's first kernel
        self.cuda.synchronize()

    def _group_bytes(self, group: str, d: int) -> np.ndarray:
        """What device d holds of a group: the whole group, or its share under a tensor split."""
        if self.shares is None:
            return group_bytes(self, group)
        return share_bytes(self.spec, self.groups[group], self.shares, d, self.weights_file.raw)

    def _resident_kv(self, tier: Tier):
        """(layer, device buffer, KV heads it holds; None: all) of a tier's device-resident KV:
        under a tensor split, each device's KV heads of every layer (a head held by several is
        the same on each, so each may write it back)."""
        if self.shares is None:
            for il, loc in tier.place.kv.items():
                if loc.kind == PINNED:
                    yield il, self.region(tier, regions.kv(il, loc.device)), None
            return
        for d in self.shares.devices:
            heads = self.shares.kv_heads(self.spec, d)
            for il in range(self.spec.hparams.n_layer) if heads[1] > heads[0] else ():
                yield il, self.region(tier, regions.kv(il, d)), heads

    def _upload_kv(self, il: int, buf, cells: int, stream, heads=None) -> None:
        """Lay the mirror's keys and values of layer il (of KV `heads` [lo, hi) only, under a
        tensor split) into a device KV buffer `buf` of the current tier
        (`PlanExecutor.kv_rows`): a full-context layer's straight from the mirror; the
        sliding-window pool's gathered into pinned staging first (every copy from it has ended by
        the next ubatch's: each has a reader that a later hand-off or sync waits for)."""
        k, v = self._kv(buf, cells, heads)
        dev, host = self.kv_rows(il)
        lo, hi = heads or (0, self.mirror.k_shape[0])
        if isinstance(dev, slice) and heads is None:  # straight from the mirror
            src_k, src_v, n = self.mirror.k[il], self.mirror.v[il], dev.stop
        elif isinstance(dev, slice):  # a tier switch's: its heads, gathered
            n = dev.stop
            src_k, src_v = (m[il][:n, lo:hi].copy() for m in (self.mirror.k, self.mirror.v))
        else:
            src_k, src_v = self._kv(self._swa_stage(il, cells), cells, heads)
            src_k[dev], src_v[dev] = (m[il][host, lo:hi] for m in (self.mirror.k, self.mirror.v))
            n = self.pool.n_used
        if n == 0:  # nothing cached yet (an empty gather's strides are not the buffer's)
            return
        k[:n].copy_to_device(src_k[:n], stream=stream or 0)
        v[:n].copy_to_device(src_v[:n], stream=stream or 0)

    def _download_kv(self, il: int, buf, cells: int, heads=None) -> None:
        """A device KV buffer of the current tier (of KV `heads`) back into the mirror."""
        k, v = self._kv(buf, cells, heads)
        dev, host = self.kv_rows(il)
        if isinstance(dev, slice) and heads is None:  # straight into the mirror
            k[dev].copy_to_host(self.mirror.k[il][host])
            v[dev].copy_to_host(self.mirror.v[il][host])
        else:
            lo, hi = heads or (0, self.mirror.k_shape[0])
            self.mirror.k[il][host, lo:hi] = k.copy_to_host()[dev]
            self.mirror.v[il][host, lo:hi] = v.copy_to_host()[dev]

    def _swa_stage(self, il: int, cells: int) -> np.ndarray:
        key = (self.current.tier, il)
        if key not in self.swa_stages:
            self.swa_stages[key] = self.host_alloc(cells * self.cell_nbytes)
        return self.swa_stages[key]

    def _kv(self, buf, cells: int, heads=None):
        """A KV buffer's keys and values [cells, heads, dim] (of KV `heads` [lo, hi) only)."""
        if heads is None:
            return kv_views(buf, cells, self.mirror.k_shape, self.mirror.v_shape)
        n = heads[1] - heads[0]
        return kv_views(buf, cells, (n, *self.mirror.k_shape[1:]),
                        (n, *self.mirror.v_shape[1:]))  # fmt: skip

    def synchronize(self) -> None:
        for stream in self.queues.values():
            stream.synchronize()

    def close(self) -> None:
        """Give the arenas, workspaces, graphs and pinned buffers back now, not at Numba's next
        deallocation sweep: a benchmark then runs the next engine, or llama.cpp, on the memory."""
        self.synchronize()
        for dmath in self.dmaths.values():
            if dmath.blas is not None:
                dmath.blas.close()
        for owner in self.pinned:  # the driver's pinned buffers have no finalizer
            owner.free()
        for graph in (self.graphs or {}).values():
            graph.close()
        self.arenas = self.arena = self.workspaces = self.graphs = None
        self.pinned, self.stagings, self.field_buffers, self.swa_stages = [], {}, {}, {}
        self.pool = self.mirror = None
        gc.collect()
        if not simulated():  # the simulator's arrays are NumPy's
            self.cuda.current_context().deallocations.clear()

    # -- one ubatch ------------------------------------------------------------------------------

    def workspace(self, tier: Tier, d: int = 0) -> dict:
        """Device d's workspace arrays in a tier (logit rows where the head is: its memory map's
        size)."""
        if (tier.tier, d) not in self.workspaces:
            head = tier.place.groups["output"]
            on_head = self.shares is not None or head.device == d  # a tensor split: every device
            rows = self._logit_rows(tier) if head.kind != CPU and on_head else 0
            slices = layout(self.device_spec(d), tier.tier, rows, self.n_ctx)
            if self.shares is not None and "partial" in slices:
                # as many KV splits as the whole model's workspace (which the plan reserved)
                # holds: a device with fewer KV heads would take more
                whole = layout(self.spec, tier.tier, rows, self.n_ctx)["partial"].shape[1]
                sl = slices["partial"]
                slices["partial"] = replace(sl, shape=(sl.shape[0], min(sl.shape[1], whole),
                                                       *sl.shape[2:]))  # fmt: skip
            region = self.region(tier, regions.workspace(d))
            if nbytes(slices) > region.size:  # a plan solved by an earlier layout
                raise PlanError(f"tier {tier.tier}: the plan reserves {region.size} B of "
                                f"workspace on device {d} where this runtime needs "
                                f"{nbytes(slices)} B; solve again")  # fmt: skip
            self.workspaces[tier.tier, d] = arrays(region, slices)
        return self.workspaces[tier.tier, d]

    def staging(self, tier: Tier) -> dict:
        """Pinned host arrays, allocated once per tier, through which the activations go down and
        up at the CPU segments' hand-offs, the inputs up and the logits down: copies from and to
        them are asynchronous (pageable ones would wait, or be staged by the driver)."""
        if tier.tier in self.stagings:
            return self.stagings[tier.tier]
        for op in tier.schedule:  # each CPU wait is on a device part's end: the hand-off's wait
            if isinstance(op, Wait) and op.queue.on_host:
                assert op.event.signal is Signal.DONE and any(
                    p.name == op.event.of and not p.queue.on_host for p in tier.parts), op
        rows = self._logit_rows(tier)
        slices = layout(self.spec, tier.tier, rows, self.n_ctx)
        names = {f for seg in tier.segments for f in seg.reads + seg.writes}
        if any(not p.queue.on_host for p in tier.parts):
            # a tensor split's logits come down per device (`DeviceShards`)
            logits = {"logits"} if rows and self.shares is None else set()
            names |= {*INPUTS, *self._cell_counts(tier)} | logits
        want = {n: slices[n] for n in sorted(names)}
        sizes = {n: int(np.prod(sl.shape)) * np.dtype(sl.dtype).itemsize for n, sl in want.items()}
        total = sum(-(-b // 256) * 256 for b in sizes.values())
        if simulated():
            buf = np.empty(max(total, 1), np.uint8)
        else:
            from . import driver

            owner = driver.PinnedHostBuffer(max(total, 1))
            self.pinned.append(owner)
            buf = owner.array
        out, offset = {}, 0
        for n, sl in want.items():
            out[n] = buf[offset : offset + sizes[n]].view(sl.dtype).reshape(sl.shape)
            offset += -(-sizes[n] // 256) * 256
        self.stagings[tier.tier] = out
        return out

    def pinned_rows(self, tier: Tier, key: tuple, field: str, d: int | None = None) -> np.ndarray:
        """A pinned host buffer of a workspace field's rows (device d's layout: under a tensor
        split, its share's), one a tier and key: each kind of copy its own, so no later copy
        overwrites one an earlier copy still reads."""
        if (tier.tier, key) not in self.field_buffers:
            spec = self.spec if d is None else self.device_spec(d)
            sl = layout(spec, tier.tier, self._logit_rows(tier), self.n_ctx)[field]
            nbytes = int(np.prod(sl.shape)) * np.dtype(sl.dtype).itemsize
            buf = self.host_alloc(max(nbytes, 1))[:nbytes]
            self.field_buffers[tier.tier, key] = buf.view(sl.dtype).reshape(sl.shape)
        return self.field_buffers[tier.tier, key]

    def _logit_rows(self, tier: Tier) -> int:
        """Rows of logits the device head computes at once: one a sequence (what the memory
        model reserves), none with the head on the CPU."""
        if tier.place.groups["output"].kind == CPU:
            return 0
        return min(tier.tier, self.seqs.n_seq, MAX_DECODE_TOKENS)  # the matvec kernels' rows

    def execute(self, tier: Tier, st: Act) -> None:
        if self.shards is not None:
            return self.shards.execute(tier, st)
        if len(self.budgets) > 1:
            return self.hops.execute(tier, st)
        n = st.tokens.size
        ws, stage = self.workspace(tier), self.staging(tier)
        host = st.for_host()  # the CPU segments' activations
        key = (tier.tier, n)
        self.dmath.glu_layers = counts.glu_layers(tier.parts)
        graph = self._graphable(tier, st) and key in self.ran_eagerly  # kernels compiled by then
        self.counter = counter = counts.Counter()
        with counts.counting(counter):
            if "tokens" in stage:  # some part runs on the device
                self._upload_inputs(tier, st, ws, stage)
            if graph:
                if key not in self.graphs:
                    with counts.counting(None):  # the capture's kernels run in the replays
                        self.graphs[key] = self._capture(tier, st, ws)
                self.graphs[key].launch(self.streams[0])
                counter.launches += 1
                st.logits = np.empty((1, self.spec.hparams.n_vocab), np.float32)
                ws["logits"][:1].copy_to_host(stage["logits"][:1], stream=self.compute)
                self.pending_logits = st.logits
            else:
                self._issue(tier, st, ws, stage, host, capturing=False)
                self.ran_eagerly.add(key)
            if graph or tier.final_sync:
                self.copy_done.record(self.copy)  # every copy has a reader on the compute
                self.copy_done.wait(self.compute)  # stream; made sure of, without a wait
                self._sync(self.compute)
        if self.pending_logits is not None:
            self.pending_logits[:] = stage["logits"][: self.pending_logits.shape[0]]
            self.pending_logits = None
        self.counter = None
        self.tally.add(tier.tier, n, graph, counter.counts())

    def _sync(self, waitable) -> None:
        """A host synchronization (a stream or an event), counted."""
        if self.counter is not None:
            self.counter.syncs += 1
        waitable.synchronize()

    def _event(self):
        # untimed events are cheaper; the simulator's take no arguments
        return self.cuda.event() if simulated() else self.cuda.event(False)

    def _upload_inputs(self, tier: Tier, st: Act, ws: dict, stage: dict, device: int = 0) -> None:
        """Token ids, positions, the device cells the tokens write and the keys they and every
        KV cell hold (`kvstore.DeviceCells`; cells past those in use are EMPTY), through
        staging."""
        d, n = st.device, st.tokens.size
        values = {"tokens": st.tokens, "pos": st.pos, "q_key": d.q_keys, "write": d.write,
                  "write_swa": d.write_swa, "k_pos": d.keys, "k_pos_swa": d.keys_swa}  # fmt: skip
        counts = {name: n for name in INPUTS if ws[name].size}
        for key, count in {**counts, **self._cell_counts(tier)}.items():
            src = stage[key][:count]
            src[: values[key].size] = values[key]
            src[values[key].size :] = EMPTY
            ws[key][:count].copy_to_device(src, stream=self.queues[compute_queue(device)])

    def _graphable(self, tier: Tier, st: Act) -> bool:
        """A decode ubatch whose work is all on the device, its KV resident: one CUDA graph (its
        streamed-weight copies included) replayed per token."""
        return (
            self.use_graphs
            and counts.graphable(tier.parts, tier.place, st.tokens.size)
            and not st.all_logits
            and list(st.logit_rows) == [st.tokens.size - 1]  # the head's one captured row
            and not self.requested
            and self.trace_events is None  # a traced run is timed op by op, eagerly
        )

    def _capture(self, tier: Tier, st: Act, ws: dict):
        from . import driver

        compute, copy = self.streams
        # Numba frees what it holds pending in batches; a cuMemFree inside a capture invalidates it
        with self.cuda.current_context().deallocations.disable():
            compute.begin_capture()
            fork, join = driver.Event(timing=False), driver.Event(timing=False)
            fork.record(compute)
            copy.wait(fork)  # the copy stream joins the capture
            self._issue(tier, st, ws, None, None, capturing=True)
            join.record(copy)
            compute.wait(join)
            graph = compute.end_capture()
        self.graph_nodes[(tier.tier, st.tokens.size)] = graph.node_count()
        return graph

    def _issue(self, tier: Tier, st: Act, ws: dict, stage: dict | None, host: Act | None,
               capturing: bool) -> None:  # fmt: skip
        """Issue the tier's schedule: copies on the copy stream, device parts on the compute
        stream, each CPU segment on this thread at its first part, events between them."""
        events: dict[EventId, object] = {}
        routed: dict[tuple[str, bool], Admission] = {}  # (router step, prefetch) -> its choice
        index = {p.name: i for i, p in enumerate(tier.parts)}
        starts = {seg.first: seg for seg in tier.segments}
        timer = _Timer(self) if self.trace_events is not None and not capturing else None
        for op in tier.schedule:
            if isinstance(op, Record):
                ev = events[op.event] = self._event()
                # (the host's: on the compute stream, which its segment's hand-off is last on)
                ev.record(self.copy if op.queue.lane is Lane.COPY else self.compute)
            elif isinstance(op, Wait):
                if not op.queue.on_host:  # a CPU wait is the segment's hand-off (`staging`)
                    events[op.event].wait(self.queues[op.queue])
            elif isinstance(op, Copy) and not handed(op):  # (the segments hand fields over)
                with _span(timer, "copy", f"copy {op.tensor}", self.copy):
                    if op.reads:  # routed or prefetched: the router's choice (or guess) first
                        by = op.reads[0][0].key  # the router's step
                        prefetch = op.tensor.kind is UnitKind.PREFETCH
                        if (by, prefetch) not in routed:
                            part = tier.parts[index[by]]
                            admission, ids = self._route(tier, part, events, st, host, ws,
                                                         prefetch)  # fmt: skip
                            if not prefetch:
                                self._place_experts(tier, part.layer, admission, ids, ws,
                                                    self.copy)  # fmt: skip
                            routed[by, prefetch] = admission
                        self._copy_routed(tier, op.tensor.key, op.slot, routed[by, prefetch],
                                          prefetch)  # fmt: skip
                    else:
                        self._copy_unit(tier, op.tensor, op.slot)
            elif isinstance(op, Compute):
                i = index[op.name]
                part = tier.parts[i]
                if part.queue.on_host:
                    if i in starts:  # the segment's other parts ran with it
                        seg = starts[i]
                        with _span(timer, "cpu", _segment_name(tier, seg), None):
                            self._segment(tier, seg, st, host, ws, stage)
                    continue
                slot = next((s for _, s in op.reads if s.kind is SlotKind.RING), None)
                with _span(timer, "compute", op.name, self.compute):
                    self._device_part(tier, part, st, ws, stage, slot, capturing)
        if timer is not None:
            self._sync(self.compute)
            self._sync(self.copy)
            self.trace_events.extend(timer.events())

    def _cell_counts(self, tier: Tier) -> dict[str, int]:
        out = {}
        for il, cells in tier.kv_cells.items():
            if tier.place.kv[il].kind != CPU:
                out["k_pos_swa" if self.spec.is_swa(il) else "k_pos"] = cells
        return out

    def _slot(self, tier: Tier, slot: SlotId):
        return self.region(tier, tier.slot_region[slot])

    def _copy_unit(self, tier: Tier, unit: Unit, slot: SlotId, copy=None) -> None:
        buf, copy = self._slot(tier, slot), copy or self.copy
        if unit.kind is UnitKind.KV:
            il = unit.key
            self._upload_kv(il, buf, tier.kv_cells[il], copy)
        else:
            data = self.host.group(unit.key)
            buf[: data.size].copy_to_device(data, stream=copy)
            if self.groups[unit.key].kind == EXPERTS:
                self.expert_copied_nbytes += data.size

    def _route(self, tier: Tier, part, events: dict, st: Act, host: Act, ws: dict,
               prefetch: bool) -> tuple[Admission, np.ndarray]:  # fmt: skip
        """The experts a router chose (or, for a prefetch, is predicted to choose: `part` is the
        layer's `qkv`), read back from `ws` (a sync: the copies depend on them, as under
        llama.cpp's op-offload), and where each goes (`Admission`: its expert cache, else the
        routed copy); with the ids [T, k]."""
        n, il = st.tokens.size, part.layer
        if part.queue.on_host:
            ids = host.ids
        else:
            name = "pred" if prefetch else "ids"
            self._sync(events[EventId(Signal.PREDICTED if prefetch else Signal.ROUTED, part.name)])
            ids = ws[name][:n].copy_to_host()
        if il in tier.cache_slots:
            admission = self.admit(tier, il, ids, prefetch)
        else:
            admission = Admission(overflow=routed_experts(ids))
        return admission, ids

    def _place_experts(self, tier: Tier, il: int, admission: Admission, ids, ws: dict,
                       copy) -> None:  # fmt: skip
        """Each chosen expert's place (its expert cache slot, else its place in the routed copy)
        into the workspace the expert products read it from, on the copy stream before the
        copies' events, which the products wait for."""
        slots = tier.cache_slots.get(il, 0)
        places = np.vectorize(lambda e: admission.place(int(e), slots), otypes=[np.int32])
        ws["slot_ids"][: ids.shape[0]].copy_to_device(places(ids), stream=copy)

    def _copy_routed(self, tier: Tier, unit: str, slot: SlotId, admission: Admission,
                     prefetch: bool, copy=None) -> None:  # fmt: skip
        """A routed stack's experts from pinned host memory: those its expert cache keeps
        (`admission.inserted`) into their cache slots, the others chosen into its ring slot, one
        copy per run of consecutive experts (`routed_ranges`); a prefetch fills the cache only."""
        src, layout, at = self.host.group(unit), self.host.layouts[unit], 0
        copy = copy or self.copy
        if admission.inserted:
            loc = tier.place.groups[unit]
            cache, slots = self.region(tier, regions.cache(unit, loc.device)), loc.cache
            for e, place in admission.inserted.items():
                for lo, to, nbytes in cache_ranges(layout, slots, e, place):
                    cache[to : to + nbytes].copy_to_device(src[lo : lo + nbytes], stream=copy)
                    self.expert_copied_nbytes += nbytes
        if prefetch:
            return
        buf = self._slot(tier, slot)
        for lo, nbytes in routed_ranges(layout, admission.overflow):
            buf[at : at + nbytes].copy_to_device(src[lo : lo + nbytes], stream=copy)
            at += nbytes
        self.routed_held[unit] = len(admission.overflow)
        self.expert_copied_nbytes += at

    def _weights(self, tier: Tier, group: str, slot: SlotId | None, ws: dict) -> dict:
        loc = tier.place.groups[group]
        if loc.kind == ROUTED:  # as many experts as the router chose, in their places
            layout = self.host.layouts[group]
            w = device_tensors(layout, self._slot(tier, slot), self.routed_held[group])
            w[ROUTED_IDS] = ws["slot_ids"]
            if loc.cache:  # each stack's cached experts, before the copy's
                cache = self.region(tier, regions.cache(group, loc.device))
                for p, at, nbytes in cache_stacks(layout, loc.cache):
                    w[p.info.name + CACHED] = cache[at : at + nbytes]
                w[CACHE_SLOTS] = loc.cache
            return w
        buf = (self.region(tier, regions.weights(group, loc.device)) if loc.kind == PINNED
               else self._slot(tier, slot))  # fmt: skip
        return device_tensors(self.host.layouts[group], buf[: self.groups[group].nbytes])

    def _device_part(self, tier: Tier, part, st: Act, ws: dict, stage: dict | None,
                     slot: SlotId | None, capturing: bool = False) -> None:  # fmt: skip
        n, s, dmath = st.tokens.size, self.queues[part.queue], self.dmaths[part.queue.device]
        if part.kind == "kq":
            il = part.layer
            loc = tier.place.kv[il]
            buf = (self.region(tier, regions.kv(il, loc.device)) if loc.kind == PINNED
                   else self._slot(tier, slot))  # fmt: skip
            cells = tier.kv_cells[il]
            k, v = self._kv(buf, cells)
            swa = self.spec.is_swa(il)
            k_pos = ws["k_pos_swa" if swa else "k_pos"][:cells]
            # a graph replays with other cells in use: over every cell, EMPTY ones masked
            ranges = [(0, n, 0, cells)] if capturing else self.attention_ranges(st, il)
            dmath.kq(ws, n, il, k, v, k_pos, ws["write_swa" if swa else "write"][:n],
                          self.attention_window(il), ranges, s)  # fmt: skip
            if loc.kind == PINNED:  # the buffer stays; the mirror catches up at the next switch
                return
            for t, cell, count in host_runs(st.cells.write):  # streamed: new rows to the host
                ws["k_stage"][t : t + count].copy_to_host(
                    self.mirror.k[il][cell : cell + count].reshape(count, -1), stream=s
                )
                ws["v_stage"][t : t + count].copy_to_host(
                    self.mirror.v[il][cell : cell + count].reshape(count, -1), stream=s
                )
            return
        w = self._weights(tier, part.group, slot, ws)
        getattr(dmath, part.kind)(ws, n, w, part.layer, s)
        if part.kind == "qkv" and program.predicts(tier.parts, tier.parts.index(part)):
            dmath.predict(ws, n, w, part.layer, s)
        if part.kind.startswith("ffn_down"):
            self._record(st, f"blk.{part.layer}.out", ws["x"][:n], s)
        elif part.kind == "output" and capturing:
            dmath.head(ws, w, n - 1, 1, s)  # the logits are read after the replay
        elif part.kind == "output":
            self._record(st, "output_norm", ws["h"][:n], s)
            rows = ws["logits"].shape[0]
            chunks = [(t + i, c + i, min(rows, count - i)) for t, c, count in
                      host_runs(st.logit_rows) for i in range(0, count, rows)]  # fmt: skip
            st.logits = np.empty((st.logit_rows.size, self.spec.hparams.n_vocab), np.float32)
            for j, (first, row, count) in enumerate(chunks):
                # consecutive rows at once; staged, the last read after the end's wait
                dmath.head(ws, w, row, count, s)
                ws["logits"][:count].copy_to_host(stage["logits"][:count], stream=s)
                if j + 1 < len(chunks):
                    self._sync(s)
                    st.logits[first : first + count] = stage["logits"][:count]
            if chunks:  # (a prompt's ubatch before its last wants none)
                first, _, count = chunks[-1]
                self.pending_logits = st.logits[first : first + count]

    def _record(self, st: Act, name: str, dev, stream) -> None:
        if name in self.requested:
            st.record[name] = dev.copy_to_host(stream=stream)
            self._sync(stream)

    def _segment(self, tier: Tier, seg: Segment, st: Act, host: Act, ws: dict,
                 stage: dict) -> None:  # fmt: skip
        """A CPU segment: its inputs down in one batch and one wait, its parts on the host, what
        the device reads next up in one batch."""
        n, counter = st.tokens.size, self.counter
        counter.segments += 1
        if seg.sync:
            for f in seg.reads:
                dev, staged = self._rows(ws, stage, f, n)
                dev.copy_to_host(staged, stream=self.compute)
            self._sync(self.compute)
            for f in seg.reads:  # fresh views: HostMath keys its quantized inputs by identity
                setattr(host, f, self._host_value(f, stage, n))
            counter.downloads += bool(seg.reads)
        self.runner.run(seg, tier.parts, host, self.requested)
        for f in seg.writes:
            dev, staged = self._rows(ws, stage, f, n)
            staged[...] = np.reshape(getattr(host, f), staged.shape)
            dev.copy_to_device(staged, stream=self.compute)
        counter.uploads += bool(seg.writes)
        if tier.parts[seg.stop - 1].kind == "output":
            st.logits = host.logits

    def _per_slot(self, field: str) -> bool:
        """MoE's gate and up: a row per (token, chosen expert) on the device, [T, k, n] on the
        host."""
        return field in ("gate", "up") and self.spec.arch.moe

    def _row_count(self, field: str, n: int) -> int:
        """Rows of a field for n tokens (MoE's gate and up: a row per chosen expert)."""
        return n * self.spec.hparams.n_expert_used if self._per_slot(field) else n

    def _rows(self, ws: dict, stage: dict, field: str, n: int):
        """The device rows and the staging rows of a field for n tokens."""
        rows = self._row_count(field, n)
        return ws[field][:rows], stage[field][:rows]

    def _host_value(self, field: str, stage: dict, n: int) -> np.ndarray:
        """A field as the CPU kernels take it (int64 ids), viewing the staging rows."""
        _, staged = self._rows(stage, stage, field, n)
        if self._per_slot(field):
            return staged.reshape(n, self.spec.hparams.n_expert_used, -1)
        return staged.astype(np.int64) if field == "ids" else staged


def _segment_name(tier: Tier, seg: Segment) -> str:
    first, last = tier.parts[seg.first].name, tier.parts[seg.stop - 1].name
    return first if first == last else f"{first} .. {last}"


class _Timer:
    """Spans of a traced ubatch: device work timed by CUDA events on its stream (against one
    event recorded, and waited for, when the host clock is read), CPU parts by the host clock.
    Under the simulator, whose streams run as they are issued, the host clock times everything."""

    def __init__(self, engine: CudaEngine):
        self.engine, self.spans = engine, []
        if not simulated():
            self.base = engine.cuda.event()
            self.base.record(engine.compute)
            engine._sync(self.base)
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
