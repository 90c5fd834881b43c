"""Synthetic models: GGUF files of any supported architecture, depth, width, head layout and quant
type with random weights (that llama.cpp also loads), and spec-only models of sizes nobody
downloads here.

Weights are seeded and scaled so activations stay O(1): matrices ~ N(0, 1/n_in), embeddings
~ N(0, 0.25), norm weights near 1, and an untied output head (random, plus a bigram term; see
`SyntheticConfig.bigram_logit`). A matrix whose rows are not whole blocks of the asked type falls
back to Q8_0 (then F32), as llama-quantize does. K-quant tensors (which gguf-py cannot quantize)
are random valid blocks whose fp16 scale fields are set so the values have the same spread and
zero mean (docs/toolchain.md).
The vocabulary is the 256 GPT-2 byte characters, letter-pair merges and two control tokens, so the
file tokenizes text like a real byte-level BPE model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, TokenType
from gguf import quants as gq

from .arch import arch_traits
from .errors import UserError
from .hparams import (HParams, attention_scale, check_hparams, expert_rows, recurrent_layers,
                      shared_expert_rows, swa_base, swa_layers)
from .layout import F32, QUANTIZED, ROPE_FREQS, TensorSlot, layer_stem, tensor_layout
from .qmix import MIXES, fit_rows, mixed_type
from .quants import Q, dequantize, qtype, quantize, tensor_nbytes
from .spec import ModelSpec, TensorInfo, generic_role, layer_of, tensor_role


@dataclass(frozen=True)
class GenericSample:
    """How to write a file of an architecture the generic rule prices (for tests): the layout
    llama.cpp 0.3.36 loads for it (src/models/<arch>.cpp), as a modelled family's with its
    differences."""

    like: str  # the modelled family whose layout and keys it starts from
    drop: tuple[str, ...] = ()  # layer tensors that family has and this one lacks
    # layer F32 vectors it adds, each with its width: "d" n_embd, "q" Q's rows, "k" K's rows
    vectors: tuple[tuple[str, str], ...] = ()
    keys: tuple[tuple[str, float], ...] = ()  # float metadata it requires beyond the family's
    untied: bool = False  # output.weight required


GENERIC_SAMPLES = {
    # a routed llama (each expert feed_forward_length wide) whose logits are scaled
    "granitemoe": GenericSample("llama", keys=(("logit_scale", 1.0),)),
    # no norm before attention or the FFN: Q and K normed over all their heads, norms after both
    "olmo2": GenericSample("llama", drop=("attn_norm.weight", "ffn_norm.weight"),
                           vectors=(("attn_q_norm.weight", "q"), ("attn_k_norm.weight", "k"),
                                    ("post_attention_norm.weight", "d"),
                                    ("post_ffw_norm.weight", "d")), untied=True),
}


def layout_traits(arch: str, n_expert: int):
    """The traits whose layout a synthetic file of `arch` is written in: its own, or for an
    architecture the generic rule prices, its sample's family's."""
    traits = arch_traits(arch, n_expert)
    if not traits.generic:
        return traits
    if arch not in GENERIC_SAMPLES:
        raise UserError(f"refengine plans {arch} generically but writes synthetic files of "
                        f"{', '.join(GENERIC_SAMPLES)} only among such architectures")
    return arch_traits(GENERIC_SAMPLES[arch].like, n_expert)


def synthetic_layout(cfg: "SyntheticConfig", hp: HParams) -> list:
    """The tensors a synthetic file of `cfg` holds (layout.TensorSlot), in the file's order."""
    slots = tensor_layout(layout_traits(cfg.arch, cfg.n_expert), hp, cfg.tied_output,
                          cfg.rope_freqs)  # fmt: skip
    sample = GENERIC_SAMPLES.get(cfg.arch)
    if sample is None:
        return slots
    width = {"d": hp.n_embd, "q": hp.n_head * hp.head_dim, "k": hp.n_head_kv * hp.head_dim}
    out = []
    for slot in slots:
        il = layer_of(slot.name)
        if il is not None and layer_stem(slot.name) in sample.drop:
            continue
        out.append(slot)
        if slot.name == f"blk.{il}.attn_output.weight":  # the layer's vectors after attention
            out += [TensorSlot(f"blk.{il}.{name}", (width[w],), F32) for name, w in sample.vectors]
    if sample.untied and not any(slot.name == "output.weight" for slot in out):
        out.append(TensorSlot("output.weight", (hp.n_vocab, hp.n_embd), QUANTIZED))
    return out


@dataclass(frozen=True)
class SyntheticConfig:
    arch: str = "llama"
    n_layer: int = 2
    n_embd: int = 128
    n_ff: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 0  # 0: n_embd / n_head
    n_rot: int = 0  # dimensions of each head RoPE rotates; 0: all
    head_dim_v: int = 0  # 0: head_dim
    # deepseek2's latent attention: head_dim and head_dim_v are a query's and a value's head
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    n_vocab: int = 512
    n_ctx_train: int = 4096
    qtype: str = "Q8_0"  # type of the matrices; norms, biases and the router stay F32
    rope_base: float = 0.0  # 0: the architecture's usual base
    rms_eps: float = 1e-6
    n_swa: int = 0  # gemma3: sliding window (0: 4, so short prompts already cross it)
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_expert_shared: int = 0  # shared experts (glm4moe), each n_ff_exp wide
    n_dense_lead: int = 0  # leading dense layers (glm4moe)
    n_nextn: int = 0  # NextN blocks after the n_layer (glm4moe); llama.cpp loads none
    n_ff_shexp: int = 0  # a gated shared expert's width (qwen35moe); 0: n_ff
    # qwen35moe's gated delta net on all layers but every full_attention_interval-th
    full_attention_interval: int = 4
    ssm_state: int = 0
    ssm_groups: int = 0
    ssm_v_heads: int = 0
    ssm_conv_kernel: int = 4
    moe_every: int = 1  # llama4: every moe_every-th layer routes, the others are dense
    rope_freqs: bool = False  # write llama3-style RoPE factors (all 1) where the arch takes them
    tied_output: bool = False  # tied, the residual's own token embedding dominates the logits
    # A random head gives flat distributions (top probability ~0.3) whose argmax llama.cpp's 8-bit
    # activation noise flips at 2-5% of positions. Adding to each token's row the direction of its
    # successor's embedding (a fixed permutation) gives a trained model's confidence, so greedy
    # runs test the forward pass rather than noise. This is the successor's logit for a final
    # hidden state that is all current-token embedding; in practice it is a fraction of that.
    bigram_logit: float = 40.0
    # Planted routing skew (MoE; 0: off, and the file's bytes are those of the config without
    # it). The token ids split into this many contiguous ranges ("domains", `domain_tokens`),
    # each with a unit direction u_d in embedding space: `domain_embed` * u_d is added to the
    # embedding rows of its tokens and `domain_router` * u_d to the router rows of its share of
    # the experts (`domain_experts`) in every layer. The residual stream carries u_d to every
    # router (the blocks' output matrices write nothing along the u_d), so text of one domain
    # prefers that domain's experts, as a trained router's topics do — what an expert cache
    # priced by one prompt set must carry over to another. The head adds `domain_logit` to a
    # domain's tokens along u_d and each token's bigram successor is in its own domain, so a
    # greedy continuation stays in its prompt's domain. The other tensors keep their bytes.
    routing_domains: int = 0
    domain_embed: float = 2.5
    domain_router: float = 2.5
    domain_logit: float = 60.0
    seed: int = 0
    name: str = ""

    def hparams(self) -> HParams:
        """The hyperparameters this config describes; UserError if the engine cannot run them."""
        traits = layout_traits(self.arch, self.n_expert)
        if self.n_head <= 0 or self.n_embd <= 0:
            raise UserError("a synthetic model needs positive --heads and --embd")
        hd = self.head_dim or self.n_embd // self.n_head
        for value, trait, what in ((self.n_expert_shared, traits.shared_experts, "shared experts"),
                                   (self.n_dense_lead, traits.dense_lead, "leading dense layers"),
                                   (self.n_nextn, traits.nextn, "NextN blocks"),
                                   (self.rope_freqs, traits.rope_freqs, "rope_freqs")):  # fmt: skip
            if value and not trait:
                raise UserError(f"a {self.arch} model has no {what}")
        n_swa = (self.n_swa or 4) if traits.swa_pattern else 0
        n_swa = traits.attention_chunk or n_swa  # llama.cpp's chunk, whatever the file says
        hp = HParams(
            n_vocab=self.n_vocab,
            n_ctx_train=self.n_ctx_train,
            n_embd=self.n_embd,
            n_layer=self.n_layer,
            n_ff=self.n_ff,
            n_head=self.n_head,
            n_head_kv=self.n_head_kv,
            head_dim=hd,
            head_dim_v=self.head_dim_v or hd,
            n_rot=self.n_rot or hd,
            rope_base=self.rope_base or traits.default_rope_base,
            rope_base_swa=swa_base(traits, self.rope_base or traits.default_rope_base),
            rope_scale=1.0,
            rms_eps=self.rms_eps,
            attn_scale=attention_scale(traits, self.n_layer, self.n_embd, self.n_head, hd),
            n_swa=n_swa,
            swa_layers=swa_layers(traits, self.n_layer) if n_swa else (),
            n_expert=self.n_expert,
            n_expert_used=self.n_expert_used,
            n_ff_exp=expert_rows(traits, self.n_ff, self.n_ff_exp),
            n_dense_lead=self.n_dense_lead,
            n_nextn=self.n_nextn,
            moe_every=self.moe_every,
            n_ff_shexp=shared_expert_rows(traits, self.n_ff, self.n_ff_exp, self.n_expert_shared,
                                          self.n_ff_shexp),
        )
        if self.moe_every > 1 and not traits.interleaved_moe:
            raise UserError(f"a {self.arch} model routes every layer")
        if traits.mla:  # the cache's row is the key: the latent and the RoPE key, one head
            hp = replace(hp, n_head_kv=1, head_dim=self.kv_lora_rank + hp.n_rot,
                         head_dim_v=self.kv_lora_rank, q_lora_rank=self.q_lora_rank,
                         kv_lora_rank=self.kv_lora_rank, head_dim_mla=hd,
                         head_dim_v_mla=hp.head_dim_v)  # fmt: skip
        elif self.kv_lora_rank or self.q_lora_rank:
            raise UserError(f"a {self.arch} model has no latent attention")
        if traits.hybrid:
            hp = replace(hp, recurrent_layers=recurrent_layers(self.n_layer,
                                                               self.full_attention_interval),
                         ssm_conv_kernel=self.ssm_conv_kernel, ssm_state=self.ssm_state,
                         ssm_groups=self.ssm_groups, ssm_v_heads=self.ssm_v_heads,
                         ssm_inner=self.ssm_state * self.ssm_v_heads)  # fmt: skip
        check_hparams(hp, traits, f"synthetic {self.arch}")
        return hp


# Shapes of real models, for planning (spec-only) and for synthetic files at real sizes.
SHAPES_FILE = Path(__file__).with_name("shapes.json")
_NOT_CONFIG = ("params", "source", "note")


def load_shapes() -> dict[str, dict]:
    """The spec-only shape table (shapes.json): name -> real hyperparameters and their source."""
    return {k: v for k, v in json.loads(SHAPES_FILE.read_text()).items() if not k.startswith("_")}


PRESETS: dict[str, SyntheticConfig] = {
    name: SyntheticConfig(**{k: v for k, v in row.items() if k not in _NOT_CONFIG})
    for name, row in load_shapes().items()
}


def shape_for(arch: str, params: str) -> str:
    """The table's name for `--arch A --params P`; UserError listing what there is otherwise."""
    rows = load_shapes()
    for name, row in rows.items():
        if row["arch"] == arch and row["params"].lower() == params.lower():
            return name
    known = ", ".join(f"{r['arch']} {r['params']}" for r in rows.values())
    raise UserError(f"no shape for --arch {arch} --params {params} (known: {known})")


def preset(name: str, **changes) -> SyntheticConfig:
    if name not in PRESETS:
        raise UserError(f"unknown model preset {name!r} (known: {', '.join(PRESETS)})")
    return replace(PRESETS[name], name=name, **changes)


def config_for(preset_name: str | None, arch: str = "llama", **changes) -> SyntheticConfig:
    """A preset's shape with `changes`, or the architecture's default shape with them (`synth`:
    a preset fixes the architecture, so `arch` must be left at its default beside one)."""
    if preset_name:
        if arch != "llama":
            raise UserError("--preset fixes the architecture; leave out --arch")
        return preset(preset_name, **changes)
    return replace(SyntheticConfig(arch=arch), **changes)


def matrix_type(t: GGMLQuantizationType, n_in: int) -> GGMLQuantizationType:
    """The type a matrix with rows of n_in values gets: `t`, or Q8_0 (then F32) when its rows are
    not whole blocks of `t` — as llama-quantize falls back for such tensors."""
    for candidate in (t, Q.Q8_0, Q.F32):
        if n_in % qtype(candidate).block_elems == 0:
            return candidate
    raise AssertionError("F32 takes any row length")


def slot_type(cfg: SyntheticConfig, hp: HParams, slot) -> GGMLQuantizationType:
    """A tensor's type: F32 for vectors; the mix's choice (llama.cpp's Q4_K_M) or `cfg.qtype` for
    matrices, falling back where rows are not whole blocks."""
    if slot.kind != QUANTIZED:
        return Q.F32
    mix = cfg.qtype.upper() if cfg.qtype.upper() in MIXES else None
    if mix:
        want = mixed_type(mix, slot.name, layer_of(slot.name), hp, cfg.arch, cfg.tied_output)
        return fit_rows(want, slot.shape[-1])
    return matrix_type(qtype(cfg.qtype).ggml, slot.shape[-1])


def spec_from_hparams(cfg: SyntheticConfig) -> ModelSpec:
    """A ModelSpec for a model described by hyperparameters alone (no file, no weights)."""
    traits, hp = arch_traits(cfg.arch, cfg.n_expert), cfg.hparams()
    role_of = generic_role if traits.generic else tensor_role
    traits = replace(traits, moe=True) if traits.generic and hp.n_expert else traits
    tensors = []
    for slot in synthetic_layout(cfg, hp):  # NextN blocks last
        tt = slot_type(cfg, hp, slot)
        tensors.append(
            TensorInfo(
                slot.name,
                slot.shape,
                tt,
                tensor_nbytes(slot.shape, tt),
                layer_of(slot.name),
                role_of(slot.name),
            )
        )
    nextn = [t.layer is not None and t.layer >= hp.n_layer for t in tensors]
    return ModelSpec(arch=traits, hparams=hp,
                     tensors=tuple(t for t, x in zip(tensors, nextn) if not x),
                     name=cfg.name or f"{cfg.arch}-spec",
                     unloaded=tuple(t for t, x in zip(tensors, nextn) if x))  # fmt: skip


# -- vocabulary -----------------------------------------------------------------------------------


def _byte_chars() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocabulary(n_vocab: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges): 2 control tokens, 256 byte tokens, then letter merges."""
    if n_vocab < 258:
        raise UserError("a synthetic vocabulary needs at least 258 tokens")
    tokens = ["<s>", "</s>"] + _byte_chars()
    types = [TokenType.CONTROL, TokenType.CONTROL] + [TokenType.NORMAL] * 256
    merges = []
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    space = _byte_chars()[ord(" ")]
    pairs = [(space, a) for a in letters] + [(a, b) for a in letters for b in letters]
    for a, b in pairs[: n_vocab - len(tokens)]:
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        types.append(TokenType.NORMAL)
    while len(tokens) < n_vocab:  # beyond the pairs: unused filler tokens keep the size exact
        tokens.append(f"<unused{len(tokens)}>")
        types.append(TokenType.UNUSED)
    return tokens, [int(t) for t in types], merges


# -- weights --------------------------------------------------------------------------------------

# Field offsets of the K-quant blocks (ggml-common.h): where the fp16 d (and dmin) live, and the
# expected value of the unsigned quant * sub-scale product that dmin must cancel for zero mean.
# a K-quant's mean unsigned quant (its minimum, dmin x m, offsets it to zero mean)
_KQUANT_MEAN_Q = {Q.Q2_K: 1.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5, Q.Q6_K: 0.0}


def random_kquant_blocks(
    rng: np.random.Generator, shape: tuple[int, ...], t: GGMLQuantizationType, std: float
) -> np.ndarray:
    """Random valid blocks of a type gguf-py cannot quantize (the K-quants, IQ4_NL, IQ4_XS) for a
    tensor of numpy `shape`, values of spread ~std, mean ~0."""
    q = qtype(t)
    n_blocks = int(np.prod(shape)) // q.block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, q.block_nbytes), dtype=np.uint8)

    def set_scales(d: float):
        at = q.offset("d")
        blocks[:, at : at + 2] = np.full((n_blocks, 1), d, np.float16).view(np.uint8)
        if q.has("dmin"):
            at, dmin = q.offset("dmin"), np.float16(d * _KQUANT_MEAN_Q[t])
            blocks[:, at : at + 2] = np.full((n_blocks, 1), dmin, np.float16).view(np.uint8)

    set_scales(1.0 / 64)
    probe = gq.dequantize(blocks[: min(n_blocks, 256)], t)
    set_scales(1.0 / 64 * std / float(np.std(probe)))
    return blocks.reshape(*shape[:-1], q.row_nbytes(shape[-1]))


def _tensor_bytes(
    rng, shape, kind: str, t: GGMLQuantizationType, std: float
) -> tuple[np.ndarray, GGMLQuantizationType]:
    if kind != QUANTIZED:
        return quantize(rng.normal(1.0, 0.1, size=shape).astype(np.float32), Q.F32), Q.F32
    t = matrix_type(t, shape[-1])
    if not qtype(t).quantizable:
        return random_kquant_blocks(rng, shape, t, std), t
    return quantize(rng.normal(0.0, std, size=shape).astype(np.float32), t), t


def domain_tokens(cfg: SyntheticConfig, d: int) -> range:
    """The token ids of planted domain d (contiguous ranges covering the vocabulary)."""
    n, v = cfg.routing_domains, cfg.n_vocab
    return range(d * v // n, (d + 1) * v // n)


def domain_experts(cfg: SyntheticConfig, d: int) -> range:
    """The experts planted domain d prefers, in every layer (contiguous, E / domains of them)."""
    n, e = cfg.routing_domains, cfg.n_expert
    return range(d * e // n, (d + 1) * e // n)


def _domain_directions(cfg: SyntheticConfig, n_embd: int) -> np.ndarray:
    """[domains, n_embd] orthonormal directions, from their own generator so that the weights
    drawn from the file's generator stay those of the same config without domains."""
    rng = np.random.default_rng([cfg.seed, 1 + cfg.routing_domains])
    q, _ = np.linalg.qr(rng.normal(size=(n_embd, cfg.routing_domains)))
    return q.T


# Embedding spread: small enough that the blocks' output, not the token's own embedding, dominates.
EMBED_STD = 0.5
# The router's logits spread like a trained router's: a random router's near-tied experts flip
# under llama.cpp's activation noise and change a token's output discontinuously.
ROUTER_LOGIT_STD = 4.0


def write_synthetic(path: str | Path, cfg: SyntheticConfig) -> Path:
    """Write a random-weight GGUF for `cfg`; the same cfg always gives the same bytes."""
    traits, hp = layout_traits(cfg.arch, cfg.n_expert), cfg.hparams()
    file_type = MIXES.get(cfg.qtype.upper()) or int(qtype(cfg.qtype).ggml)
    rng = np.random.default_rng(cfg.seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(path, cfg.arch)
    w.add_name(cfg.name or f"synthetic-{cfg.arch}")
    w.add_context_length(hp.n_ctx_train)
    w.add_embedding_length(hp.n_embd)
    w.add_block_count(hp.n_block)
    w.add_feed_forward_length(hp.n_ff)
    w.add_head_count(hp.n_head)
    w.add_head_count_kv(hp.n_head_kv)
    w.add_key_length(hp.head_dim)
    w.add_value_length(hp.head_dim_v)
    w.add_rope_dimension_count(hp.n_rot)
    w.add_rope_freq_base(hp.rope_base)
    w.add_layer_norm_rms_eps(hp.rms_eps)
    if hp.n_swa:
        w.add_sliding_window(hp.n_swa)
    if traits.moe:
        w.add_expert_count(hp.n_expert)
        w.add_expert_used_count(hp.n_expert_used)
        if not traits.moe_by_count:  # a routed llama's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(hp.n_ff_exp)
    if traits.shared_experts:  # GLM-4.5's routing: sigmoid, the top-k weights summing to 1
        w.add_expert_shared_count(cfg.n_expert_shared)
        w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(1.0)
    if traits.dense_lead:
        w.add_leading_dense_block_count(hp.n_dense_lead)
    if traits.interleaved_moe:
        w.add_interleave_moe_layer_step(hp.moe_every)
    if traits.nextn:
        w.add_nextn_predict_layers(hp.n_nextn)
    if traits.gated_shared_expert:
        w.add_expert_shared_feed_forward_length(hp.n_ff_shexp)
    if traits.hybrid:
        w.add_full_attention_interval(cfg.full_attention_interval)
        w.add_ssm_conv_kernel(hp.ssm_conv_kernel)
        w.add_ssm_inner_size(hp.ssm_inner)
        w.add_ssm_state_size(hp.ssm_state)
        w.add_ssm_time_step_rank(hp.ssm_v_heads)
        w.add_ssm_group_count(hp.ssm_groups)
        if "rope.dimension_sections" in traits.required_keys:  # M-RoPE's (time, height,
            half = hp.n_rot // 2  # width) sections: text uses them alike
            w.add_rope_dimension_sections([half - 2 * (half // 3), half // 3, half // 3, 0])
    if hp.mla:
        if hp.q_lora_rank:
            w.add_q_lora_rank(hp.q_lora_rank)
        w.add_kv_lora_rank(hp.kv_lora_rank)
        w.add_key_length_mla(hp.head_dim_mla)
        w.add_value_length_mla(hp.head_dim_v_mla)
    for key, value in GENERIC_SAMPLES.get(cfg.arch, GenericSample("")).keys:
        w.add_float32(f"{cfg.arch}.{key}", value)
    w.add_file_type(file_type)

    tokens, types, merges = vocabulary(hp.n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(traits.synthetic_pre_tokenizer)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)

    embd = None
    domains = cfg.routing_domains
    if domains and not (traits.moe and 0 < domains <= min(hp.n_expert, hp.n_embd, hp.n_vocab)):
        raise UserError(f"routing_domains={domains} needs a MoE architecture and at most "
                        "min(experts, embd, vocab) domains")  # fmt: skip
    u = _domain_directions(cfg, hp.n_embd) if domains else None
    for slot in synthetic_layout(cfg, hp):
        n_in = slot.shape[-1]
        std = 1.0 / np.sqrt(n_in)
        t = slot_type(cfg, hp, slot)
        if slot.name == ROPE_FREQS:
            data, tt = quantize(np.ones(slot.shape, dtype=np.float32), Q.F32), Q.F32
        elif slot.name.endswith(".bias"):
            data, tt = (
                quantize(rng.normal(0.0, 0.1, size=slot.shape).astype(np.float32), Q.F32),
                Q.F32,
            )
        elif slot.name.endswith("ffn_gate_inp.weight"):
            data, tt = (
                quantize(
                    rng.normal(0.0, ROUTER_LOGIT_STD * std, size=slot.shape).astype(np.float32),
                    Q.F32,
                ),
                Q.F32,
            )
            if domains:
                rows = dequantize(data, tt, slot.shape).copy()
                for d in range(domains):
                    rows[domain_experts(cfg, d)] += cfg.domain_router * u[d]
                data = quantize(rows.astype(np.float32), Q.F32)
        elif slot.name == "token_embd.weight":
            # scaled by sqrt(n_embd) in the forward pass where the architecture does (gemma3)
            e_std = EMBED_STD / np.sqrt(hp.n_embd) if traits.embed_scale else EMBED_STD
            data, tt = _tensor_bytes(rng, slot.shape, slot.kind, t, e_std)
            embd = dequantize(data, tt, slot.shape)
            if domains:
                # the head's bigram term below keeps the embedding without u_d: with it, every
                # row of a domain would share a bias and one domain would take every argmax
                planted = embd.copy()
                for d in range(domains):
                    planted[domain_tokens(cfg, d)] += cfg.domain_embed * u[d]
                # gguf-py cannot quantize given values to a K-quant (as the head below)
                tt = matrix_type(tt if qtype(tt).quantizable else Q.Q8_0, n_in)
                data = quantize(planted.astype(np.float32), tt)
        elif slot.name == "output.weight":
            successor = rng.permutation(slot.shape[0])
            if domains:  # each token's successor in its own domain: a domain's text stays in it
                drng = np.random.default_rng([cfg.seed, 2 + domains])
                successor = np.concatenate([drng.permutation(domain_tokens(cfg, d))
                                            for d in range(domains)])  # fmt: skip
            unit = embd[successor] / np.linalg.norm(embd[successor], axis=1, keepdims=True)
            values = rng.normal(0.0, 3.0 * std, size=slot.shape) + cfg.bigram_logit * std * unit
            if domains:
                # the rows without their u parts, so that u_d in the final state raises its
                # domain's tokens alike (a domain's text continues in it) and picks no favourite
                # among them: which one follows stays the bigram's and the context's choice
                values -= (values @ u.T) @ u
                for d in range(domains):
                    values[domain_tokens(cfg, d)] += cfg.domain_logit * std * u[d]
            # gguf-py cannot quantize given values to a K-quant: such heads are written as Q8_0
            tt = matrix_type(t if qtype(t).quantizable else Q.Q8_0, n_in)
            data = quantize(values.astype(np.float32), tt)
        else:
            data, tt = _tensor_bytes(rng, slot.shape, slot.kind, t, std)
            if domains and slot.name.endswith(("attn_output.weight", "ffn_down_exps.weight")):
                # the blocks write nothing along the u_d: the residual's u part stays its
                # token's own domain at every depth instead of drifting into another's
                values = dequantize(data, tt, slot.shape)
                values = values - u.T @ (u @ values)
                tt = matrix_type(tt if qtype(tt).quantizable else Q.Q8_0, n_in)
                data = quantize(values.astype(np.float32), tt)
        w.add_tensor(slot.name, data, raw_dtype=tt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
