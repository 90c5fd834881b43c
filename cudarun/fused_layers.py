"""The cpu engine's fused decode layer: a layer's decode as one kernel call (dense) or two
(routed: the attention half, then the experts, the router between them in Python), over any
engine's host weights, host math and KV mirror — the cpu engine's own, and the CPU segments of a
hybrid plan (`segments`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from refengine.spec import ModelSpec

from .hostmath import Act
from .kernels import cpu, cpu_layer, cpu_ops


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


class FusedLayers:
    """Per layer, its `FusedLayer` (`layers`; None when some layer cannot take one: a matrix type
    without int8 rows, a tensor the kernels do not know), and `run` to compute one."""

    def __init__(self, spec: ModelSpec, weights: Mapping, math, mirror):
        self.spec, self.weights, self.math, self.mirror = spec, weights, math, mirror
        self.layers = self._layer_calls()

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

    def run(self, st: Act, il: int, requested) -> None:
        """Layer `il` of the activations `st`, recording its output if `requested`."""
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
            ids, gates = cpu_ops.route(logits, self.spec.hparams.n_expert_used,
                                       self.spec.arch.expert_weights_norm)  # fmt: skip
            cpu_layer.moe_ffn_kernel(layer.qtypes[4:])(x, h, ids, gates, *layer.ffn,
                                                      layer.ints, layer.floats)  # fmt: skip
        st.x = x
        if f"blk.{il}.out" in requested:
            st.record[f"blk.{il}.out"] = x.copy()
