"""Per-architecture differences, in one table.

Everything that varies between the supported GGUF architectures is a field of `ArchTraits`; the
forward pass, the spec reader and the synthetic writer read these fields and never test the
architecture's name. Semantics follow llama.cpp (src/models/*.cpp, src/llama-model.cpp):

- RoPE: `norm` rotates adjacent pairs (2i, 2i+1) — llama files, whose Q/K rows the converter
  permuted for it; `neox` rotates (i, i + n_rot/2) — qwen2/qwen3/qwen3moe/gemma3.
- gemma3: embeddings scaled by sqrt(n_embd); RMSNorm on Q and K per head; norms after attention and
  after the FFN (before the residual add); GELU (tanh form) gate; layer il uses a sliding window
  unless il % pattern == pattern - 1 (pattern 6), with RoPE base 10000 on sliding layers and the
  file's `rope.freq_base` on global ones. Its GGUF norm weights already include gemma's "+1".
- qwen2: biases on Q, K and V. qwen3: RMSNorm on Q and K per head, before RoPE.
- qwen3moe: softmax router over all experts, top-k, weights renormalized to sum 1.
- llama with `llama.expert_count` > 0 (Mixtral's layout): every layer routes as qwen3moe does, each
  expert `feed_forward_length` wide (docs/llamacpp-architectures.md, 2.7).
- gpt-oss (planned, not run by the engines; docs/llamacpp-architectures.md, 2.1): every layer
  routed, with biases on the router, the experts and the attention's output, a sink logit per
  head, the pre-FFN norm named post_attention_norm, an untied head; even layers slide (pattern 2).
- glm4moe (planned; 2.2): Q/K/V biases, optional Q/K norms, the pre-FFN norm post_attention_norm;
  the first leading_dense_block_count layers dense, the others routed (a sigmoid router whose
  selection adds exp_probs_b) beside expert_shared_count shared experts; the trailing
  nextn_predict_layers blocks (multi-token prediction) are in the file but llama.cpp loads none
  of their tensors and gives them no KV.
- deepseek2 (planned; 2.3): as glm4moe's layers (leading dense, routed beside shared experts, an
  optional selection bias, NextN blocks) with multi-head latent attention: Q through a rank
  q_lora_rank (none in the "lite" models), K and V through kv_lora_rank, split per head into
  attn_k_b and attn_v_b; the cache keeps kv_lora_rank + RoPE dims a token and layer, no V.
- qwen35moe (planned; 2.5): every full_attention_interval-th layer gated full attention (Q twice
  as wide: queries and their gate; Q/K norms), the others a gated delta net whose state per
  sequence replaces the KV cache; every layer routed beside a sigmoid-gated shared expert;
  NextN blocks as glm4moe's.
- qwen3next (planned; 2.4): qwen35moe's layers but for the delta net's write strength and decay
  in one product (ssm_ba), and no M-RoPE sections.
- llama4 (planned; 2.6): every interleave_moe_layer_step-th layer routed beside one shared expert
  as wide as a routed one, the others dense; 3 of every 4 layers attend within chunks of 8192
  tokens (cached as a sliding window of 8192), unless the file's sliding_window is 0.

The other causal text architectures llama.cpp 0.3.36 knows (llamacpp_arches.json) are planned by
the generic rule (`refengine/generic.py`), but those with a state per sequence, which it cannot
price; encoders, projectors and the like are refused with what they are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path

from .errors import UserError


@dataclass(frozen=True)
class ArchTraits:
    name: str
    rope_style: str  # "norm" (adjacent pairs) or "neox" (halves)
    ffn_act: str  # "silu" or "gelu" (tanh approximation), applied to the gate
    qkv_bias: bool = False  # attn_q/k/v carry .bias tensors
    qk_norm: bool = False  # per-head RMSNorm of Q and K before RoPE
    post_norms: bool = False  # attn_post_norm and ffn_post_norm before each residual add
    embed_scale: bool = False  # token embeddings multiplied by sqrt(n_embd)
    moe: bool = False  # routed experts instead of a dense FFN
    expert_weights_norm: bool = False  # top-k router weights renormalized to sum 1
    swa_pattern: int = 0  # layers il with il % p != p-1 use the sliding window; 0: no SWA
    rope_base_swa: float = 0.0  # RoPE base of sliding-window layers (llama.cpp's default)
    gemma3_27b_scale: bool = False  # llama.cpp's 62-layer special case of the attention scale
    default_rope_base: float = 10000.0  # the usual base, for synthetic and spec-only models
    synthetic_pre_tokenizer: str = "default"  # what the synthetic writer declares
    # routed when the file's expert_count > 0, each expert as wide as feed_forward_length
    moe_by_count: bool = False
    engines: bool = True  # our engines run it; otherwise it is planned for llama.cpp only
    attn_out_bias: bool = False  # attn_output carries a .bias
    attn_sinks: bool = False  # attn_sinks.weight: a sink logit per query head
    router_bias: bool = False  # ffn_gate_inp carries a .bias
    expert_bias: bool = False  # each expert stack carries a .bias per expert
    ffn_norm: str = "ffn_norm"  # the name of the norm before the FFN
    untied_output: bool = False  # output.weight is required (llama.cpp has no tied fallback)
    # metadata llama.cpp requires of it beyond the common keys (without the "{arch}." prefix)
    required_keys: tuple[str, ...] = ()
    shared_experts: bool = False  # routed layers add expert_shared_count experts every token uses
    dense_lead: bool = False  # the first leading_dense_block_count layers have a dense FFN
    expert_probs_bias: bool = False  # exp_probs_b.bias: a per-expert bias on the selection
    nextn: bool = False  # nextn_predict_layers trailing blocks: in the file, not loaded
    qk_norm_optional: bool = False  # attn_q_norm and attn_k_norm may be present
    mla: bool = False  # multi-head latent attention (HParams.mla)
    hybrid: bool = False  # gated delta net layers between gated full-attention ones (qwen35moe)
    # the shared expert: sigmoid-gated per token (ffn_gate_inp_shexp), as wide as the file's
    # expert_shared_feed_forward_length (else feed_forward_length), not a count of experts
    gated_shared_expert: bool = False
    optional_tensors: tuple[str, ...] = ()  # layer tensors (blk.N. left out) a file may omit
    one_shared_expert: bool = False  # routed layers add one shared expert, as wide as a routed one
    interleaved_moe: bool = False  # interleave_moe_layer_step: every step-th layer routes
    # chunked attention on the sliding-window pattern's layers: llama.cpp's chunk, whatever the
    # file's sliding_window says but 0 (none)
    attention_chunk: int = 0
    delta_net_ba: bool = False  # the delta net's write strength and decay in one ssm_ba product
    # rope_freqs.weight may be present: llama3-style RoPE scaling's factor per frequency, which
    # llama.cpp keeps with the first layer (and a copy with every other device's layers)
    rope_freqs: bool = False
    # no exact model: priced from the file's tensor names and shapes (refengine/generic.py)
    generic: bool = False


_QWEN35MOE = ArchTraits(
    "qwen35moe",
    rope_style="neox",
    ffn_act="silu",
    qk_norm=True,
    moe=True,
    expert_weights_norm=True,
    default_rope_base=1e7,
    synthetic_pre_tokenizer="qwen2",
    engines=False,
    ffn_norm="post_attention_norm",
    required_keys=("rope.dimension_sections", "ssm.conv_kernel", "ssm.inner_size",
                   "ssm.state_size", "ssm.time_step_rank", "ssm.group_count"),
    nextn=True,
    hybrid=True,
    gated_shared_expert=True,
)

ARCHES: dict[str, ArchTraits] = {
    t.name: t
    for t in (
        ArchTraits("llama", rope_style="norm", ffn_act="silu", moe_by_count=True),
        ArchTraits(
            "qwen2",
            rope_style="neox",
            ffn_act="silu",
            qkv_bias=True,
            default_rope_base=1e6,
            synthetic_pre_tokenizer="qwen2",
        ),
        ArchTraits(
            "qwen3",
            rope_style="neox",
            ffn_act="silu",
            qk_norm=True,
            default_rope_base=1e6,
            synthetic_pre_tokenizer="qwen2",
        ),
        ArchTraits(
            "qwen3moe",
            rope_style="neox",
            ffn_act="silu",
            qk_norm=True,
            moe=True,
            expert_weights_norm=True,
            default_rope_base=1e6,
            synthetic_pre_tokenizer="qwen2",
        ),
        ArchTraits(
            "gemma3",
            rope_style="neox",
            ffn_act="gelu",
            qk_norm=True,
            post_norms=True,
            embed_scale=True,
            swa_pattern=6,
            rope_base_swa=10000.0,
            gemma3_27b_scale=True,
            default_rope_base=1e6,
        ),
        ArchTraits(
            "gpt-oss",
            rope_style="neox",
            ffn_act="swiglu_oai",
            qkv_bias=True,
            moe=True,
            swa_pattern=2,
            default_rope_base=150000.0,
            engines=False,
            attn_out_bias=True,
            attn_sinks=True,
            router_bias=True,
            expert_bias=True,
            ffn_norm="post_attention_norm",
            untied_output=True,
            required_keys=("expert_feed_forward_length", "attention.sliding_window"),
        ),
        ArchTraits(
            "glm4moe",
            rope_style="neox",
            ffn_act="silu",
            qkv_bias=True,
            moe=True,
            expert_weights_norm=True,
            default_rope_base=1e6,
            engines=False,
            ffn_norm="post_attention_norm",
            required_keys=("expert_feed_forward_length", "expert_shared_count"),
            shared_experts=True,
            dense_lead=True,
            expert_probs_bias=True,
            nextn=True,
            qk_norm_optional=True,
        ),
        ArchTraits(
            "deepseek2",
            rope_style="norm",
            ffn_act="silu",
            moe=True,
            expert_weights_norm=True,
            engines=False,
            required_keys=("expert_feed_forward_length", "expert_shared_count",
                           "attention.kv_lora_rank"),  # fmt: skip
            shared_experts=True,
            dense_lead=True,
            expert_probs_bias=True,
            nextn=True,
            mla=True,
            optional_tensors=("exp_probs_b.bias",),
        ),
        _QWEN35MOE,
        replace(_QWEN35MOE, name="qwen3next", required_keys=_QWEN35MOE.required_keys[1:],
                delta_net_ba=True),  # fmt: skip
        ArchTraits(
            "llama4",
            rope_style="norm",
            ffn_act="silu",
            moe=True,
            swa_pattern=4,
            default_rope_base=500000.0,
            engines=False,
            required_keys=("expert_feed_forward_length", "interleave_moe_layer_step"),
            one_shared_expert=True,
            interleaved_moe=True,
            attention_chunk=8192,
            rope_freqs=True,
        ),
    )
}
RUN_BY_ENGINES = tuple(name for name, t in ARCHES.items() if t.engines)


def arch_traits(name, n_expert: int = 0) -> ArchTraits:
    """The traits of architecture `name`, routed where its files decide by their `n_expert`; a
    causal text architecture without a model here gets the generic rule's (no routing: the
    generic reader decides that from the file's expert stacks)."""
    if isinstance(name, str) and name not in ARCHES and plannable_generically(name):
        return ArchTraits(name, rope_style="norm", ffn_act="silu", engines=False, generic=True)
    if not isinstance(name, str) or name not in ARCHES:
        raise UserError(unsupported(name))
    traits = ARCHES[name]
    if traits.moe_by_count and n_expert > 0:
        return replace(traits, moe=True, expert_weights_norm=True)
    return traits


def plannable_generically(name: str) -> bool:
    """A causal text architecture llama.cpp knows whose memory is a KV cache alone."""
    known = llamacpp_arches()
    return name in known["decoder"] and not _stateful(name)


def _stateful(name: str) -> str:
    """What state per sequence an architecture keeps beside (or instead of) a KV cache, or ''."""
    state = llamacpp_arches()["stateful"]
    if name in state["recurrent"]:
        return "a recurrent state per sequence instead of a KV cache"
    if name in state["hybrid"]:
        return "a recurrent state per sequence beside its KV cache"
    return ""


@cache
def llamacpp_arches() -> dict:
    """llama.cpp 0.3.36's architectures: {"decoder": [names], "refused": {name: what it is},
    "stateful": {"recurrent": [names], "hybrid": [names]}}."""
    return json.loads(Path(__file__).with_name("llamacpp_arches.json").read_text())


def unsupported(name) -> str:
    """Why a file of architecture `name` is refused, in one line."""
    known = llamacpp_arches()
    if name in known["refused"]:
        return (f"architecture {name!r} is not a text generator refengine can plan "
                f"({known['refused'][name]})")  # fmt: skip
    if name in known["decoder"]:  # only a stateful one is refused
        return (f"architecture {name!r} keeps {_stateful(name)}, which refengine's generic rule "
                f"cannot price (of such models it plans "
                f"{', '.join(n for n, t in ARCHES.items() if t.hybrid)})")  # fmt: skip
    return (f"architecture {name!r} is not one of the {len(known['decoder'])} text "
            f"architectures llama.cpp 0.3.36 knows; the file is damaged or newer than it")


def require_engines(traits: ArchTraits) -> None:
    """One line when our engines cannot run a model of this architecture (it is planned only)."""
    if not traits.engines:
        raise UserError(f"planned only: the engines run {', '.join(RUN_BY_ENGINES)}; "
                        f"`refengine solve` and `export` plan {traits.name} for llama.cpp")
