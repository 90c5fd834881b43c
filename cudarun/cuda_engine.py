"""The runtime on a GPU. Each device (`cuda_device.CudaDevice`: a real GPU, or a virtual one, a
budget of it) holds its arena, one allocation of its budget laid out as the plan's memory map, and
its compute and copy streams; the weights and the KV mirror are in pinned host memory
(`pinned_host`). A tier switch moves and uploads the arenas' weights and lays the resident KV out
(`device_kv`). A ubatch is issued by the one loop (`issue.issue`) onto a `cuda_ubatch.CudaUbatch`
(one device, or a layer split over several: copies on the copy streams, device parts as Numba
CUDA kernels on the compute streams, each CPU segment on the host thread with the CPU kernels,
the activations handed over between them) or onto `device_shards.DeviceShards` (a tensor split),
or replayed as a CUDA graph (`cuda_graphs`). The engine counts its kernel launches and host
synchronizations per ubatch (`counts.py`, `tally`). It runs on numba.cuda's streams, events and
arrays, so the same code runs under the CUDA simulator in CI (tiny models, tiers of at most 16
tokens) and on a GPU.
"""
from __future__ import annotations

import gc
from dataclasses import replace

import numpy as np

from refengine.spec import ModelSpec
from refengine.weights import GGUFWeights
from solver import regions
from solver.cost import CPU
from solver.workspace import INT8_TYPES, MAX_DECODE_TOKENS, arrays, layout, nbytes


from . import counts
from .cuda_device import CudaDevice, new_event, simulated
from .cuda_graphs import DecodeGraphs
from .device_kv import DeviceKV
from .cuda_ubatch import CudaUbatch
from .device_shards import DeviceShards
from .executor import PlanExecutor, Tier, group_bytes, weight_steps
from .hostmath import Act, HostMath
from .issue import issue
from .kvstore import EMPTY
from .pinned_host import PinnedHost
from .plan_check import PlanError
from .schedule import Copy, Signal, Wait, handed
from .segments import SegmentRunner
from .shards import shard_spec, share_bytes


# what every ubatch with device parts uploads, beside the KV cells' keys
INPUTS = ("tokens", "pos", "q_key", "write", "write_swa")


class CudaEngine(PlanExecutor):
    name = "cuda"
    ubatch_class = CudaUbatch  # what issues an eager ubatch (a check may wrap it)

    def __init__(self, spec: ModelSpec, plan: dict, threads: int = 0, progress: bool = False,
                 n_seq: int = 1, unified: bool = False):  # fmt: skip
        from . import driver

        if not simulated():
            driver.init()  # one line, "no NVIDIA GPU ...", where there is none
            self.free_at_start = driver.mem_info()[0]
        self.free_marks: list[tuple[str, int]] = []  # (after what, free device bytes)
        from numba import cuda

        self.cuda = cuda
        self.pinned = PinnedHost(cuda)  # (the host weights and the KV mirror are allocated in it)
        super().__init__(spec, plan, progress, n_seq, unified)
        # one allocation a device; several budgets are virtual devices of this GPU, each its own
        # arena and streams, the activations handed between them through pinned host memory
        self.devices = [CudaDevice(cuda, d, b, self.device_spec(d))
                        for d, b in enumerate(self.budgets)]  # fmt: skip
        if self.shares is not None:  # gate, up and down of every layer on each device
            for dev in self.devices:
                dev.math.glu_layers = frozenset(range(spec.hparams.n_layer))
        self.graphs = DecodeGraphs(self)
        self.kv = DeviceKV(self)
        self.cpu_math = HostMath(spec, False, threads)
        self.runner = SegmentRunner(spec, self.cpu_math, self.host, self.mirror)
        self.copy_done = new_event(cuda)  # the copy stream's end, waited for by compute
        self.tally = counts.Tally()  # launches, syncs, segments per (tier, tokens, graph)
        self.counted = ("launches", "syncs", "segments")
        self.counter: counts.Counter | None = None  # the ubatch being issued
        self.pending_logits: np.ndarray | None = None  # filled from staging after the last wait
        self.routed_held: dict[str, int] = {}  # routed stack -> experts its slot holds now
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
        return self.pinned.alloc(nbytes)

    def device_path(self, tier: int, kind: str) -> str:
        """The named path of a device part (`PlanExecutor.path`): past MAX_DECODE_TOKENS a dense
        matmul multiplies fp16 panels through cuBLAS (`DeviceMath.mm`); the expert matvecs and
        the head (one row at a time) stay on the matvec kernels at any tier, which multiply the
        quantized types in integers (int8) and the float ones in fp32."""
        if tier > MAX_DECODE_TOKENS and not kind.endswith("_exps") and kind != "output":
            return "fp16"
        quantized = any(t.qtype.name in INT8_TYPES for t in self.spec.tensors if len(t.shape) > 1)
        return "int8" if quantized else "fp32"

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
        return self.graphs.report(launch_seconds)

    # -- tier switch -----------------------------------------------------------------------------

    def switch(self, tier: Tier) -> None:
        self.synchronize()
        if self.current is not None:  # device-resident KV back to the mirror first
            for il, buf, heads in self.kv.resident(self.current):
                self.kv.download(il, buf, self.current.kv_cells[il], heads)
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
        for il, buf, heads in self.kv.resident(tier):
            self.kv.upload(il, buf, tier.kv_cells[il], None, heads)
        # the moves and uploads above ran on the legacy default stream, which our non-blocking
        # streams do not wait for: the whole context, before the tier's first kernel
        self.cuda.synchronize()

    def _group_bytes(self, group: str, d: int) -> np.ndarray:
        """What device d holds of a group: the whole group, or its share under a tensor split."""
        if self.shares is None:
            return group_bytes(self, group)
        return share_bytes(self.spec, self.groups[group], self.shares, d, self.weights_file.raw)

    @property
    def arenas(self) -> list:
        return [dev.arena for dev in self.devices]

    @property
    def arena(self):
        return self.devices[0].arena

    def synchronize(self) -> None:
        for dev in self.devices:
            dev.synchronize()

    def close(self) -> None:
        """Give the arenas, workspaces, graphs and pinned buffers back now, not at Numba's next
        deallocation sweep: a benchmark then runs the next engine, or llama.cpp, on the memory."""
        for dev in self.devices:
            dev.close()
        self.devices = None
        self.pinned.close()
        self.graphs.close()
        self.pinned = None
        self.pool = self.mirror = None
        gc.collect()
        if not simulated():  # the simulator's arrays are NumPy's
            self.cuda.current_context().deallocations.clear()

    # -- one ubatch ------------------------------------------------------------------------------

    def workspace(self, tier: Tier, d: int = 0) -> dict:
        """Device d's workspace arrays in a tier (logit rows where the head is: its memory map's
        size)."""
        dev = self.devices[d]
        if tier.tier not in dev.workspaces:
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
            dev.workspaces[tier.tier] = arrays(region, slices)
        return dev.workspaces[tier.tier]

    def staging(self, tier: Tier) -> dict:
        """Pinned host arrays, allocated once per tier, through which the activations go down and
        up at the CPU segments' hand-offs, the inputs up and the logits down: copies from and to
        them are asynchronous (pageable ones would wait, or be staged by the driver)."""
        return self.pinned.laid_out(("staging", tier.tier), lambda: self._staged(tier))

    def _staged(self, tier: Tier) -> dict:
        for op in tier.schedule:  # each CPU wait is on a device part's end: the hand-off's wait
            if isinstance(op, Wait) and op.queue.on_host:
                assert op.event.signal is Signal.DONE and any(
                    p.name == op.event.of and not p.queue.on_host for p in tier.parts), op
        rows = self._logit_rows(tier)
        slices = layout(self.spec, tier.tier, rows, self.n_ctx)
        names = {op.tensor.key for op in tier.schedule if isinstance(op, Copy) and handed(op)}
        if any(not p.queue.on_host for p in tier.parts):
            # a tensor split's logits come down per device (`DeviceShards`)
            logits = {"logits"} if rows and self.shares is None else set()
            names |= {*INPUTS, *self._cell_counts(tier)} | logits
        return {n: slices[n] for n in sorted(names)}

    def pinned_rows(self, tier: Tier, key: tuple, field: str, d: int | None = None) -> np.ndarray:
        """A pinned host buffer of a workspace field's rows (device d's layout: under a tensor
        split, its share's), one a tier and key (`PinnedHost.array`)."""

        def shape():
            spec = self.spec if d is None else self.device_spec(d)
            sl = layout(spec, tier.tier, self._logit_rows(tier), self.n_ctx)[field]
            return sl.shape, sl.dtype

        return self.pinned.array((tier.tier, *key), shape)

    def _logit_rows(self, tier: Tier) -> int:
        """Rows of logits the device head computes at once: one a sequence (what the memory
        model reserves), none with the head on the CPU."""
        if tier.place.groups["output"].kind == CPU:
            return 0
        return min(tier.tier, self.seqs.n_seq, MAX_DECODE_TOKENS)  # the matvec kernels' rows

    def execute(self, tier: Tier, st: Act) -> None:
        if self.shards is not None:
            return self.shards.execute(tier, st)
        n = st.tokens.size
        stage, key = self.staging(tier), (tier.tier, n)
        used = sorted({p.queue.device for p in tier.parts if not p.queue.on_host})
        for d in used:
            self.devices[d].math.glu_layers = counts.glu_layers(tier.parts, d)
        graph = self.graphs.replays(tier, st)
        self.counter = counter = counts.Counter()
        with counts.counting(counter):
            for d in used:
                self._upload_inputs(tier, st, self.workspace(tier, d), stage, d)
            if graph:
                self.graphs.launch(tier, st)
                st.logits = np.empty((1, self.spec.hparams.n_vocab), np.float32)
                self.workspace(tier)["logits"][:1].copy_to_host(stage["logits"][:1],
                                                                stream=self.devices[0].compute)
                self.pending_logits = st.logits
            else:
                ubatch = self.ubatch_class(self, tier, st)
                issue(tier.schedule, ubatch)
                ubatch.finish()
                self.graphs.ran_eagerly.add(key)
            if len(self.devices) > 1:  # every stream waited for
                for dev in self.devices:
                    self.sync(dev.compute)
                    self.sync(dev.copy)
            elif graph or tier.final_sync:
                dev = self.devices[0]
                self.copy_done.record(dev.copy)  # every copy has a reader on the compute
                self.copy_done.wait(dev.compute)  # stream; made sure of, without a wait
                self.sync(dev.compute)
        if self.pending_logits is not None:
            self.pending_logits[:] = stage["logits"][: self.pending_logits.shape[0]]
            self.pending_logits = None
        self.counter = None
        self.tally.add(tier.tier, n, graph, counter.counts())

    def sync(self, waitable) -> None:
        """A host synchronization (a stream or an event), counted."""
        if self.counter is not None:
            self.counter.syncs += 1
        waitable.synchronize()

    def record_activation(self, st: Act, name: str, dev, stream) -> None:
        """A requested activation (`SequenceCalls.requested`), read back: a counted sync."""
        if name in self.requested:
            st.record[name] = dev.copy_to_host(stream=stream)
            self.sync(stream)

    def _cell_counts(self, tier: Tier) -> dict[str, int]:
        out = {}
        for il, cells in tier.kv_cells.items():
            if tier.place.kv[il].kind != CPU:
                out["k_pos_swa" if self.spec.is_swa(il) else "k_pos"] = cells
        return out

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
            ws[key][:count].copy_to_device(src, stream=self.devices[device].compute)



def require_gpu() -> None:
    """One line, before any solving, where the cuda engine cannot run."""
    if not simulated():
        from . import driver

        driver.init()
