"""The `cpu` engine: every part of the forward pass (`program.parts`) on the host's own kernels —
what a user without a GPU runs, and the CPU half of every hybrid plan (`hostmath.HostMath`, the
named int8 path), with the fp16 KV of every layer in host memory (`kvstore.KVMirror`).

The weights are read in place from the memory-mapped GGUF: nothing is copied at load. A plan, when
given, supplies its context, workload and tiers; its placement does not matter here, since every
part runs on the host. Several sequences (docs/sequences.md) share the mirror's cells
(`kvstore.KVCells`): a decode step over many of them is one fused call a layer (a routed
layer: two, the router between them).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refengine import defaults
from refengine import reference as ref
from refengine.engine import SequenceCalls, keep_all
from refengine.sequences import Sequences, Ubatch
from refengine.spec import ModelSpec
from solver.cost import CPU, Loc, TierPlacement, Workload
from solver.groups import tensor_groups

from . import program
from .hostmath import Act, HostMath
from .kernels import cpu, cpu_layer
from .hostweights import Placed, group_layout, tensors_of
from .kvstore import KVCells, KVMirror


@dataclass
class HostTier:
    """A tier of the cpu engine: its size, an all-CPU placement and its parts."""

    tier: int
    place: TierPlacement
    parts: list


@dataclass
class FusedLayer:
    """A layer's decode as one kernel call (dense) or two (routed: the attention half, then the
    experts, the router between them in Python): the seven matrices' types (q, k, v, o, then the
    FFN's gate, up, down or their expert stacks), each half's arguments, the router's tensor."""

    qtypes: tuple
    attention: tuple  # q, k, v, o, their biases, the norms, the layer's K and V cache
    ffn: tuple  # gate, up, down (routed: and an expert's bytes in each), the post-FFN norm
    router: str | None
    ints: np.ndarray  # cpu_layer.INTS
    floats: np.ndarray  # cpu_layer.FLOATS
    swa: bool


# a fused layer's FFN matrices (and groups), dense or routed
FFN_MATRICES = {False: ("ffn_gate", "ffn_up", "ffn_down"),
                True: ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}  # fmt: skip


def _fused_tensors(moe: bool):
    attn = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q.bias",
            "attn_k.bias", "attn_v.bias", "attn_q_norm", "attn_k_norm", "post_attention_norm",
            "ffn_norm", "post_ffw_norm")  # fmt: skip
    ffn = (("ffn_gate_inp",) if moe else ()) + FFN_MATRICES[moe]
    names = [n if n.endswith(".bias") else n + ".weight" for n in attn + ffn]
    return lambda prefix: {prefix + n for n in names}


# what a fused layer computes: a layer with any other tensor runs part by part
FUSED_TENSORS = {moe: _fused_tensors(moe) for moe in (False, True)}


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
        from solver.plan import plan_workload

        from .executor import check_plan

        self.spec = spec
        if plan is not None:
            check_plan(plan, spec)
            self.workload = plan_workload(plan)
            tiers = sorted(int(t) for t in plan["tiers"])
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
        # a plain ndarray over the mapping: memmap slices cost a Python hook each
        source = np.memmap(spec.path, dtype=np.uint8, mode="r").view(np.ndarray)
        self.weights = {}  # group -> its tensors, read in place from the file
        for g in tensor_groups(spec):
            self.weights[g.name] = {
                p.info.name: _in_file(source, p.info) for p in group_layout(spec, g)
            }
        self.seqs = Sequences(self.n_ctx, n_seq, unified)
        self.mirror = KVMirror(spec, self.n_ctx)  # n_ctx cells, shared out by `cells`
        self.cells = KVCells(self.seqs, spec.hparams.n_swa)
        self.layers = self._layer_calls()
        self.trace_events = None

    def _layer_calls(self) -> list | None:
        """Per layer, its `FusedLayer` — None when some layer cannot take one (a matrix type
        without int8 rows, a tensor the kernels do not know), and the parts run one by one."""
        spec, hp, tr = self.spec, self.spec.hparams, self.spec.arch
        empty = np.empty(0, np.float32)
        out = []
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            ffn = FFN_MATRICES[tr.moe]
            t = {k: v for g in ("attn", *ffn) for k, v in self.weights.get(p + g, {}).items()}
            names = ("attn_q", "attn_k", "attn_v", "attn_output", *ffn)
            if any(p + n + ".weight" not in t for n in names) or set(t) - FUSED_TENSORS[tr.moe](p):
                return None
            infos = [spec.by_name[p + n + ".weight"] for n in names]
            if any(i.qtype not in cpu.Q8_ROWS for i in infos):
                return None

            def vec(name):
                return self.math._dense(t, p + name) if p + name in t else empty

            swa = spec.is_swa(il)
            base, scale = (hp.rope_base_swa, 1.0) if swa else (hp.rope_base, hp.rope_scale)
            ints = np.array([hp.n_head, hp.n_head_kv, hp.head_dim, hp.head_dim_v, hp.n_rot,
                             tr.rope_style == "neox", hp.n_swa if swa else 0, tr.ffn_act == "gelu",
                             infos[4].shape[-2]], np.int64)  # fmt: skip
            floats = np.array([hp.rms_eps, base, scale, hp.attn_scale], np.float64)
            attention = (
                *(t[i.name].reshape(-1) for i in infos[:4]),
                vec("attn_q.bias"), vec("attn_k.bias"), vec("attn_v.bias"),
                vec("attn_norm.weight"), vec("attn_q_norm.weight"), vec("attn_k_norm.weight"),
                vec("post_attention_norm.weight"), vec("ffn_norm.weight"),
                self.mirror.k[il].view(np.uint16), self.mirror.v[il].view(np.uint16),
            )  # fmt: skip
            stacks = [t[i.name] for i in infos[4:]]
            sizes = (np.array([a[0].nbytes for a in stacks], np.int64),) if tr.moe else ()
            out.append(FusedLayer(
                tuple(i.qtype for i in infos), attention,
                (*(a.reshape(-1) for a in stacks), *sizes, vec("post_ffw_norm.weight")),
                p + "ffn_gate_inp.weight" if tr.moe else None, ints, floats, swa,
            ))  # fmt: skip
        return out

    def _fused_layer(self, st: Act, il: int) -> None:
        layer = self.layers[il]
        # a copy: the kernels update the residual in place, and an earlier part may have recorded
        # st.x itself as its block's output
        x = np.array(st.x, np.float32, order="C")
        c = st.cells
        cells = (st.pos, c.write, c.lo_swa if layer.swa else c.lo, c.hi, c.seq, c.cell_pos,
                 c.cell_seq, layer.ints, layer.floats)  # fmt: skip
        key = cpu.token_key(x.shape[0])
        if layer.router is None:
            cpu_layer.layer_kernel(layer.qtypes, key)(x, *layer.attention, *cells, *layer.ffn)
        else:  # the attention half, the router here (any architecture's rule), the experts
            h = np.empty_like(x)
            cpu_layer.attention_kernel(layer.qtypes[:4], key)(x, *layer.attention, *cells, h)
            logits = self.math.mm(h, self.weights[f"blk.{il}.attn"], layer.router)
            ids, gates = ref.moe_route(logits, self.spec.hparams.n_expert_used,
                                       self.spec.arch.expert_weights_norm)  # fmt: skip
            cpu_layer.moe_ffn_kernel(layer.qtypes[4:])(x, h, ids, gates, *layer.ffn,
                                                      layer.ints, layer.floats)  # fmt: skip
        st.x = x
        if f"blk.{il}.out" in self.requested:
            st.record[f"blk.{il}.out"] = x.copy()

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
                    self._fused_layer(st, part.layer)
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
        return [f"host: weights read in place from {self.spec.path.name}; KV {kv / 2**20:.1f} MiB"]

    def launch_report(self, launch_seconds: float) -> list[str]:
        return []


def _in_file(source: np.ndarray, info) -> np.ndarray:
    """A tensor's bytes in the memory-mapped file, as `tensors_of` gives a group's."""
    return tensors_of([Placed(info, 0)], source[info.offset : info.offset + info.nbytes])[info.name]
