"""The tensor layout of each architecture: which GGUF tensors a model of given hyperparameters has,
and their numpy shapes. The synthetic writer writes exactly this; `spec_from_hparams` plans with it;
a test checks it against the real files."""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ArchTraits
from .spec import HParams

MATRIX, VECTOR = "matrix", "vector"  # matrices take the model's quant type; vectors stay F32


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    kind: str


def tensor_layout(traits: ArchTraits, hp: HParams, tied_output: bool = True) -> list[TensorSlot]:
    d, hd, hdv = hp.n_embd, hp.head_dim, hp.head_dim_v
    q_dim, k_dim, v_dim = hp.n_head * hd, hp.n_head_kv * hd, hp.n_head_kv * hdv
    out = [TensorSlot("token_embd.weight", (hp.n_vocab, d), MATRIX)]
    for il in range(hp.n_layer):
        def add(base, shape, kind=MATRIX):
            out.append(TensorSlot(f"blk.{il}.{base}", shape, kind))

        add("attn_norm.weight", (d,), VECTOR)
        add("attn_q.weight", (q_dim, d))
        add("attn_k.weight", (k_dim, d))
        add("attn_v.weight", (v_dim, d))
        if traits.qkv_bias:
            add("attn_q.bias", (q_dim,), VECTOR)
            add("attn_k.bias", (k_dim,), VECTOR)
            add("attn_v.bias", (v_dim,), VECTOR)
        if traits.qk_norm:
            add("attn_q_norm.weight", (hd,), VECTOR)
            add("attn_k_norm.weight", (hd,), VECTOR)
        add("attn_output.weight", (d, hp.n_head * hdv))
        if traits.post_norms:
            add("post_attention_norm.weight", (d,), VECTOR)
        add("ffn_norm.weight", (d,), VECTOR)
        if traits.moe:
            e, f = hp.n_expert, hp.n_ff_exp
            add("ffn_gate_inp.weight", (e, d), VECTOR)  # the router stays F32, as converters write it
            add("ffn_gate_exps.weight", (e, f, d))
            add("ffn_up_exps.weight", (e, f, d))
            add("ffn_down_exps.weight", (e, d, f))
        else:
            add("ffn_gate.weight", (hp.n_ff, d))
            add("ffn_up.weight", (hp.n_ff, d))
            add("ffn_down.weight", (d, hp.n_ff))
        if traits.post_norms:
            add("post_ffw_norm.weight", (d,), VECTOR)
    out.append(TensorSlot("output_norm.weight", (d,), VECTOR))
    if not tied_output:
        out.append(TensorSlot("output.weight", (hp.n_vocab, d), MATRIX))
    return out
