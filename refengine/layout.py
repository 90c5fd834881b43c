"""The tensor layout of each architecture: which GGUF tensors a model of given hyperparameters has,
and their numpy shapes. The synthetic writer writes exactly this, `spec_from_hparams` plans with it,
and `check_tensors` holds every opened file to it (tests check it against the real files too)."""

from __future__ import annotations

from dataclasses import dataclass

from .arch import ArchTraits
from .errors import UserError
from .hparams import HParams

QUANTIZED, F32 = "quantized", "f32"  # matrices take the model's quant type; the rest stay F32


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]  # numpy order
    kind: str  # QUANTIZED or F32


ROPE_FREQS = "rope_freqs.weight"


def tensor_layout(traits: ArchTraits, hp: HParams, tied_output: bool = True,
                  rope_freqs: bool = False) -> list[TensorSlot]:  # fmt: skip
    d, hd, hdv = hp.n_embd, hp.head_dim, hp.head_dim_v
    q_dim, k_dim, v_dim = hp.n_head * hd, hp.n_head_kv * hd, hp.n_head_kv * hdv
    out = [TensorSlot("token_embd.weight", (hp.n_vocab, d), QUANTIZED)]
    for il in range(hp.n_block):

        def add(base, shape, kind=QUANTIZED):
            out.append(TensorSlot(f"blk.{il}.{base}", shape, kind))

        add("attn_norm.weight", (d,), F32)
        recurrent = il < hp.n_layer and hp.recurrent(il)
        if hp.mla:
            out.extend(_latent_attention(hp, f"blk.{il}."))
        elif recurrent:
            out.extend(_delta_net(hp, f"blk.{il}.", traits.delta_net_ba))
        elif traits.hybrid:  # gated attention: Q's rows twice, the queries and their gate
            add("attn_q.weight", (2 * q_dim, d))
            add("attn_k.weight", (k_dim, d))
            add("attn_v.weight", (v_dim, d))
        else:
            add("attn_q.weight", (q_dim, d))
            add("attn_k.weight", (k_dim, d))
            add("attn_v.weight", (v_dim, d))
        if traits.qkv_bias:
            add("attn_q.bias", (q_dim,), F32)
            add("attn_k.bias", (k_dim,), F32)
            add("attn_v.bias", (v_dim,), F32)
        if traits.qk_norm and not recurrent:
            add("attn_q_norm.weight", (hd,), F32)
            add("attn_k_norm.weight", (hd,), F32)
        if not recurrent:
            add("attn_output.weight", (d, hp.n_head * (hp.head_dim_v_mla if hp.mla else hdv)))
        if traits.attn_out_bias:
            add("attn_output.bias", (d,), F32)
        if traits.attn_sinks:
            add("attn_sinks.weight", (hp.n_head,), F32)
        if traits.post_norms:
            add("post_attention_norm.weight", (d,), F32)
        add(f"{traits.ffn_norm}.weight", (d,), F32)
        if hp.routed(il):
            e, f = hp.n_expert, hp.n_ff_exp
            add("ffn_gate_inp.weight", (e, d), F32)  # the router stays F32, as converters write it
            if traits.router_bias:
                add("ffn_gate_inp.bias", (e,), F32)
            if traits.expert_probs_bias:
                add("exp_probs_b.bias", (e,), F32)
            for stack, rows, cols in (("gate", f, d), ("up", f, d), ("down", d, f)):
                add(f"ffn_{stack}_exps.weight", (e, rows, cols))
                if traits.expert_bias:
                    add(f"ffn_{stack}_exps.bias", (e, rows), F32)
            if traits.gated_shared_expert:
                add("ffn_gate_inp_shexp.weight", (d,), F32)
            if hp.n_ff_shexp:
                fs = hp.n_ff_shexp
                add("ffn_gate_shexp.weight", (fs, d))
                add("ffn_up_shexp.weight", (fs, d))
                add("ffn_down_shexp.weight", (d, fs))
        else:
            add("ffn_gate.weight", (hp.n_ff, d))
            add("ffn_up.weight", (hp.n_ff, d))
            add("ffn_down.weight", (d, hp.n_ff))
        if traits.post_norms:
            add("post_ffw_norm.weight", (d,), F32)
        if il >= hp.n_layer:  # a NextN block: the layer's input and the token's, mixed
            add("nextn.eh_proj.weight", (d, 2 * d))
            add("nextn.enorm.weight", (d,), F32)
            add("nextn.hnorm.weight", (d,), F32)
    if rope_freqs:
        out.append(TensorSlot(ROPE_FREQS, (hp.n_rot // 2,), F32))
    out.append(TensorSlot("output_norm.weight", (d,), F32))
    if not tied_output or traits.untied_output:
        out.append(TensorSlot("output.weight", (hp.n_vocab, d), QUANTIZED))
    return out


def _latent_attention(hp: HParams, prefix: str) -> list[TensorSlot]:
    """Multi-head latent attention's projections (deepseek2): Q through a rank q_lora_rank (or
    directly), the cached latent and the RoPE key from one product, and per head the latent's
    maps to a key without RoPE and to a value."""
    d, h, r_kv = hp.n_embd, hp.n_head, hp.kv_lora_rank
    nope = hp.head_dim_mla - hp.n_rot
    q = [("attn_q_a_norm.weight", (hp.q_lora_rank,), F32),
         ("attn_q_a.weight", (hp.q_lora_rank, d), QUANTIZED),
         ("attn_q_b.weight", (h * hp.head_dim_mla, hp.q_lora_rank), QUANTIZED)
         ] if hp.q_lora_rank else [("attn_q.weight", (h * hp.head_dim_mla, d), QUANTIZED)]
    return [TensorSlot(prefix + name, shape, kind) for name, shape, kind in (
        *q,
        ("attn_kv_a_norm.weight", (r_kv,), F32),
        ("attn_kv_a_mqa.weight", (r_kv + hp.n_rot, d), QUANTIZED),
        ("attn_k_b.weight", (h, r_kv, nope), QUANTIZED),
        ("attn_v_b.weight", (h, hp.head_dim_v_mla, r_kv), QUANTIZED),
    )]  # fmt: skip


def _delta_net(hp: HParams, prefix: str, fused_ba: bool) -> list[TensorSlot]:
    """A gated delta net's tensors (qwen35moe's and qwen3next's recurrent layers): Q, K and V in
    one product and their gate, a short convolution over them, per value head a decay (ssm_a,
    ssm_alpha), a time step's bias and a write strength (ssm_beta; qwen3next's ssm_ba holds both
    products), a norm per head and the output."""
    d, heads = hp.n_embd, hp.ssm_v_heads
    conv = 2 * hp.ssm_groups * hp.ssm_state + hp.ssm_inner
    ba = [("ssm_ba.weight", (2 * heads, d), QUANTIZED)] if fused_ba else [
        ("ssm_beta.weight", (heads, d), QUANTIZED), ("ssm_alpha.weight", (heads, d), QUANTIZED)]
    return [TensorSlot(prefix + name, shape, kind) for name, shape, kind in (
        ("attn_qkv.weight", (conv, d), QUANTIZED),
        ("attn_gate.weight", (hp.ssm_inner, d), QUANTIZED),
        ("ssm_conv1d.weight", (conv, hp.ssm_conv_kernel), F32),
        ("ssm_dt.bias", (heads,), F32),
        ("ssm_a", (heads,), F32),
        *ba,
        ("ssm_norm.weight", (hp.ssm_state,), F32),
        ("ssm_out.weight", (d, hp.ssm_inner), QUANTIZED),
    )]  # fmt: skip


def optional_slots(traits: ArchTraits, hp: HParams) -> list[TensorSlot]:
    """Tensors llama.cpp accepts when present (and the engine applies): Q/K/V biases on any
    architecture; Q/K norms where optional; a NextN block's own embedding and head."""
    out = []
    if not traits.qkv_bias:
        dims = {
            "q": hp.n_head * hp.head_dim,
            "k": hp.n_head_kv * hp.head_dim,
            "v": hp.n_head_kv * hp.head_dim_v,
        }
        out += [TensorSlot(f"blk.{il}.attn_{x}.bias", (n,), F32)
                for il in range(hp.n_block) for x, n in dims.items()]  # fmt: skip
    if traits.qk_norm_optional:
        out += [TensorSlot(f"blk.{il}.attn_{x}_norm.weight", (hp.head_dim,), F32)
                for il in range(hp.n_block) for x in "qk"]  # fmt: skip
    if traits.rope_freqs:
        out.append(TensorSlot(ROPE_FREQS, (hp.n_rot // 2,), F32))
    for il in range(hp.n_layer, hp.n_block):
        out += [TensorSlot(f"blk.{il}.nextn.embed_tokens.weight", (hp.n_vocab, hp.n_embd),
                           QUANTIZED),
                TensorSlot(f"blk.{il}.nextn.shared_head_head.weight", (hp.n_vocab, hp.n_embd),
                           QUANTIZED),
                TensorSlot(f"blk.{il}.nextn.shared_head_norm.weight", (hp.n_embd,), F32)]
    return out


def layer_stem(name: str) -> str:
    """A tensor's name without its layer prefix (blk.3.attn_q.weight -> attn_q.weight)."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def check_tensors(
    traits: ArchTraits, hp: HParams, shapes: dict[str, tuple[int, ...]], where: str
) -> None:
    """Refuse a file whose tensors are not the layout of its architecture: a missing tensor, one of
    the wrong shape, or one this engine would silently ignore (e.g. experts in a llama file)."""
    tied = "output.weight" not in shapes
    expected = {s.name: s.shape for s in tensor_layout(traits, hp, tied)}
    optional = {s.name: s.shape for s in optional_slots(traits, hp)}
    for name, shape in shapes.items():
        want = expected.get(name, optional.get(name))
        if want is None:
            raise UserError(
                f"{where}: tensor {name} is not part of the {traits.name} layout this "
                "engine runs; the file is a variant it does not support"
            )
        if tuple(shape) != tuple(want):
            raise UserError(
                f"{where}: tensor {name} has shape {tuple(shape)}, expected {want} "
                "from the file's hyperparameters"
            )
    missing = [n for n in expected if n not in shapes
               and layer_stem(n) not in traits.optional_tensors]  # fmt: skip
    if missing:
        raise UserError(
            f"{where}: {len(missing)} tensors are missing (first: {missing[0]}); the file "
            "is incomplete"
        )
