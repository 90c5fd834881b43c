"""llama.cpp's per-tensor type mixes, for spec-only models that name a mixed file type.

From src/llama-quant.cpp (`llama_tensor_get_type_impl`, no user overrides, no imatrix), Q4_K_M:
- the output head (or a tied token_embd, which doubles as the head): Q6_K;
- attn_v: Q6_K in the layers `use_more_bits` picks, else Q4_K; Q5_K instead of Q4_K in a 70B
  llama (80 layers, grouped KV); Q8_0 in an 8-expert MoE;
- attn_k: Q8_0 in an 8-expert MoE; attn_output: Q5_K in an 8-expert MoE;
- ffn_down, ffn_down_exps and ffn_down_shexp: Q6_K in the layers `use_more_bits` picks (of all
  the file's blocks, NextN's included);
- every other matrix Q4_K, norms F32.
A matrix whose rows are not whole blocks falls back as llama.cpp's `tensor_type_fallback` does
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0), then to F16.

MXFP4_MOE (gpt-oss's release type): every expert stack MXFP4, every other matrix Q8_0.
"""

from __future__ import annotations

from gguf import GGMLQuantizationType as Q

from .hparams import HParams
from .quants import qtype

# the mixes and llama.cpp's file type of each (LLAMA_FTYPE_MOSTLY_*)
MIXES = {"Q4_K_M": 15, "MXFP4_MOE": 38}
_FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0}


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """The first and last eighth of the layers, and every third layer between."""
    return (
        i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2
    )


def mixed_type(mix: str, name: str, layer: int | None, hp: HParams, arch: str, tied: bool) -> Q:
    """The type `mix` gives the matrix `name` (before the row-length fallback)."""
    if mix == "MXFP4_MOE":
        return Q.MXFP4 if name.rsplit(".", 1)[0].endswith("_exps") else Q.Q8_0
    assert mix == "Q4_K_M", mix
    moe8 = hp.n_expert == 8
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q.Q6_K
    if layer is None:
        return Q.Q4_K
    kind = name.split(".")[2]
    if kind == "attn_v":
        if moe8:
            return Q.Q8_0
        if use_more_bits(layer, hp.n_block):  # counted over every block, NextN's too
            return Q.Q6_K
        llama_70b = arch == "llama" and hp.n_layer == 80 and hp.n_head != hp.n_head_kv
        return Q.Q5_K if llama_70b else Q.Q4_K
    if kind == "attn_k" and moe8:
        return Q.Q8_0
    if kind == "attn_output" and moe8:
        return Q.Q5_K
    if kind.startswith("ffn_down") and use_more_bits(layer, hp.n_block):
        return Q.Q6_K
    return Q.Q4_K


def fit_rows(t: Q, n_in: int) -> Q:
    """`t`, or what llama.cpp falls back to when rows of n_in values are not whole blocks."""
    for candidate in (t, _FALLBACK.get(t, t), Q.F16):
        if n_in % qtype(candidate).block_elems == 0:
            return candidate
    raise AssertionError("F16 takes any row length")
