"""The `cpu` engine: every part of the forward pass (`program.parts`) on the host's own kernels —
what a user without a GPU runs, and the CPU half of every hybrid plan (`hostmath.HostMath`, the
named int8 path), with the fp16 KV of every layer in host memory (`kvstore.KVMirror`).

The GGUF is read once into memory of huge pages (`hostweights.file_in_memory`), and the weights
are used in place there. A plan, when given, supplies its context, workload and tiers; its
placement does not matter here, since every part runs on the host. Several sequences
(docs/sequences.md) share the mirror's cells (`kvstore.KVCells`): a decode step over many of them
is one fused call a layer (a routed layer: two, the router between them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refengine import defaults
from refengine.engine import SequenceCalls, keep_all
from refengine.sequences import Sequences, Ubatch
from refengine.spec import ModelSpec, require_runnable
from solver.cost import CPU, Loc, TierPlacement, Workload
from solver.groups import tensor_groups

from . import program
from .hostmath import Act, HostMath
from .kernels import cpu
from .fused_layers import FusedLayers
from .hostweights import file_in_memory, group_layout, in_file
from .kvstore import KVCells, KVMirror
from .plan_check import check_plan


@dataclass
class HostTier:
    """A tier of the cpu engine: its size, an all-CPU placement and its parts."""

    tier: int
    place: TierPlacement
    parts: list


def all_cpu(spec: ModelSpec) -> TierPlacement:
    cpu = Loc(CPU)
    return TierPlacement(
        {g.name: cpu for g in tensor_groups(spec)}, dict.fromkeys(range(spec.hparams.n_layer), cpu)
    )


class CpuEngine(SequenceCalls):
    name = "cpu"
    tolerance = 5e-2  # docs/contracts.md: the named int8 path
    path = "int8"

    def __init__(self, spec: ModelSpec, plan: dict | None = None, threads: int = 0,
                 n_ctx: int | None = None, tiers: list[int] | None = None, progress: bool = False,
                 n_seq: int = 1, unified: bool = False):  # fmt: skip
        from solver.plan import Plan

        self.spec = spec
        require_runnable(spec, self.name)
        if plan is not None:
            check_plan(plan, spec)
            parsed = Plan.from_json(plan, spec)
            self.workload, tiers = parsed.workload, sorted(parsed.tiers)
        else:
            n_ctx = min(n_ctx or defaults.N_CTX, spec.hparams.n_ctx_train)
            self.workload = Workload(n_ctx, max(1, n_ctx - defaults.GEN_TOKENS),
                                     defaults.GEN_TOKENS, threads=threads)  # fmt: skip
        self.n_ctx = self.workload.n_ctx
        self.tier_sizes = sorted(tiers or [1, defaults.N_UBATCH])
        self.ubatch_tokens = self.tier_sizes[-1]
        place = all_cpu(spec)
        parts = program.parts(spec, place)
        self.tiers = {t: HostTier(t, place, parts) for t in self.tier_sizes}
        self.budget_bytes = 0
        if threads:  # once, on the thread that runs the engine (Numba's count is per thread)
            import numba

            numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
        self.math = HostMath(spec, exact=False)
        source = file_in_memory(spec.path)
        self.weights = {}  # group -> its tensors, read in place from the copy
        for g in tensor_groups(spec):
            self.weights[g.name] = {
                p.info.name: in_file(source, p.info) for p in group_layout(spec, g)
            }
        self.seqs = Sequences(self.n_ctx, n_seq, unified)
        self.mirror = KVMirror(spec, self.n_ctx)  # n_ctx cells, shared out by `cells`
        self.cells = KVCells(self.seqs, spec.hparams.n_swa)
        self.fused = FusedLayers(spec, self.weights, self.math, self.mirror)
        self.layers = self.fused.layers  # None: the parts run one by one
        self.trace_events = None

    # -- Engine API (prefill, decode and the calls of several sequences: SequenceCalls) -----------

    def reset(self) -> None:
        self.seqs.reset()
        self.cells.reset()

    def tier_for(self, n_tokens: int) -> HostTier:
        return self.tiers[next((t for t in self.tier_sizes if t >= n_tokens), self.tier_sizes[-1])]

    def _removed(self, seq: int) -> None:
        self.cells.free(seq)

    def _forward(self, ub: Ubatch, all_logits, rec, record) -> np.ndarray:
        tier = self.tier_for(ub.size)
        st = Act(ub.tokens, ub.pos, all_logits)
        st.cells, st.logit_rows = self.cells.place(ub), ub.logit_rows
        math = self.math
        # a decode step (of one sequence or many) runs each layer as one call (routed: two)
        fused = (self.layers is not None and ub.size <= cpu.MAX_DECODE_ROWS
                 and max(n for _, _, n in ub.segments) < cpu.BLAS_TOKENS)  # fmt: skip
        for part in tier.parts:
            if fused and part.layer is not None and self.layers[part.layer] is not None:
                if part.kind == "qkv":
                    self.fused.run(st, part.layer, self.requested)
            elif part.kind == "kq":
                math.kq_on_host(st, part.layer, self.mirror)
            else:
                math.run(part.kind, part.layer, st, self.weights[part.group])
        keep_all(rec, record, st.record)
        return st.logits

    def warm_up(self) -> None:
        """Compile every kernel a tier runs before the first token: one token, then one ubatch of
        the smallest tier that takes the BLAS path, then reset."""
        for size in sorted({1, min(self.tier_sizes[-1], 8)}):
            self.prefill(np.zeros(size, np.int64))
            self.reset()

    def memory_report(self) -> list[str]:
        kv = self.mirror.buffer.nbytes
        return [f"host: {self.spec.path.name} read into memory; KV {kv / 2**20:.1f} MiB"]

    def launch_report(self, launch_seconds: float) -> list[str]:
        return []
