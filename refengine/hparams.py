"""Hyperparameters of a model, and the rules llama.cpp derives from them, in one place."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .arch import ArchTraits
from .errors import UserError


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_ctx_train: int  # tokens
    n_embd: int
    n_layer: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key/query head size
    head_dim_v: int
    n_rot: int  # leading dims of each head that RoPE rotates
    rope_base: float
    rope_base_swa: float
    rope_scale: float  # positions are multiplied by this (linear RoPE scaling: 1/factor)
    rms_eps: float
    attn_scale: float  # multiplies Q.K before the softmax
    n_swa: int = 0  # sliding window in tokens; 0: none
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_dense_lead: int = 0  # leading layers with a dense FFN (n_ff wide) in a routed model
    n_ff_shexp: int = 0  # the shared experts' rows beside the routed ones (every routed layer)
    n_nextn: int = 0  # trailing NextN (multi-token prediction) blocks llama.cpp does not load
    moe_every: int = 1  # layer il routes when (il + 1) % moe_every == 0 (llama4's interleave)
    routed_layers: tuple[bool, ...] = ()  # per layer, where the file says (the generic rule)
    # multi-head latent attention (deepseek2): Q and KV through low-rank projections; the cache
    # holds one row per token of head_dim = kv_lora_rank + n_rot values (n_head_kv = 1), no V
    q_lora_rank: int = 0  # 0: Q projected directly
    kv_lora_rank: int = 0
    head_dim_mla: int = 0  # a query head's size after the projections (no RoPE + RoPE dims)
    head_dim_v_mla: int = 0

    # a gated delta net (qwen35moe's linear attention) on the layers flagged here: per sequence a
    # convolution's last ssm_conv_kernel - 1 inputs and a state of ssm_state x ssm_inner, in F32
    recurrent_layers: tuple[bool, ...] = ()
    ssm_conv_kernel: int = 0
    ssm_inner: int = 0  # the values' width: ssm_state x ssm_v_heads
    ssm_state: int = 0  # a head's key (and value) size
    ssm_groups: int = 0  # key heads
    ssm_v_heads: int = 0  # value heads (the file's ssm.time_step_rank)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def recurrent(self, il: int) -> bool:
        return bool(self.recurrent_layers and self.recurrent_layers[il])

    @property
    def state_nbytes(self) -> int:
        """A recurrent layer's state for one sequence (llama.cpp's n_embd_r + n_embd_s, F32)."""
        conv = (self.ssm_conv_kernel - 1) * (self.ssm_inner + 2 * self.ssm_groups * self.ssm_state)
        return 4 * (conv + self.ssm_state * self.ssm_inner)

    @property
    def n_block(self) -> int:
        """llama.cpp's layer count (the file's block_count): the NextN blocks follow the
        n_layer it computes, and the output layer has this index."""
        return self.n_layer + self.n_nextn

    def routed(self, il: int | None) -> bool:
        """Whether layer il routes its tokens to experts (a leading dense layer does not)."""
        if self.routed_layers:
            return il is not None and self.routed_layers[il]
        return (self.n_expert > 0 and il is not None and il >= self.n_dense_lead
                and (il + 1) % self.moe_every == 0)  # fmt: skip

    @property
    def dense_layers(self) -> bool:
        """Whether any computed layer has a dense FFN (n_ff wide)."""
        return not all(self.routed(il) for il in range(self.n_layer))

    @property
    def n_ff_active(self) -> int:
        """The widest FFN product's rows per token: a routed layer's chosen experts' or its
        shared experts' (computed after them), or a dense layer's."""
        if not self.n_expert:
            return self.n_ff
        dense = self.n_ff if self.dense_layers else 0
        return max(self.n_ff_exp * self.n_expert_used, self.n_ff_shexp, dense)


def swa_layers(traits: ArchTraits, n_layer: int, pattern: int | None = None) -> tuple[bool, ...]:
    """Which layers slide: il % p < p - 1 (llama.cpp's swa pattern; p from the file or the arch)."""
    p = pattern if pattern is not None else traits.swa_pattern
    if not p:
        return ()
    return tuple(il % p < p - 1 for il in range(n_layer))


def expert_rows(traits: ArchTraits, n_ff: int, stated: int) -> int:
    """An expert's FFN rows: none without experts; a routed llama's, feed_forward_length (llama.cpp
    reads no other key for it); the others', as `stated` (the file's key, a config's value)."""
    if not traits.moe:
        return 0
    return n_ff if traits.moe_by_count else stated


def shared_expert_rows(traits: ArchTraits, n_ff: int, n_ff_exp: int, count: int,
                       stated: int) -> int:  # fmt: skip
    """A routed layer's shared experts' rows: a gated one as wide as `stated` (the file's
    expert_shared_feed_forward_length) or else n_ff (qwen35moe, qwen3next); one as wide as a
    routed expert (llama4); `count` such (glm4moe, deepseek2); none elsewhere."""
    if traits.gated_shared_expert:
        return stated or n_ff
    if traits.one_shared_expert:
        return n_ff_exp
    return n_ff_exp * count if traits.shared_experts else 0


def recurrent_layers(n_layer: int, interval: int) -> tuple[bool, ...]:
    """llama.cpp's hybrid pattern: every interval-th layer attends, the others are recurrent."""
    return tuple((il + 1) % interval != 0 for il in range(n_layer))


def swa_base(traits: ArchTraits, rope_base: float) -> float:
    """The RoPE base of sliding-window layers where the file names none: the architecture's own
    (gemma3's 10000), else the model's base (llama.cpp's default)."""
    return traits.rope_base_swa or rope_base


def attention_scale(
    traits: ArchTraits, n_layer: int, n_embd: int, n_head: int, head_dim: int
) -> float:
    """1/sqrt(head_dim); llama.cpp gives Gemma-3 27B (recognized by its 62 layers)
    1/sqrt(n_embd/n_head) instead, its query_pre_attn_scalar."""
    if traits.gemma3_27b_scale and n_layer == 62:
        return 1.0 / math.sqrt(n_embd / n_head)
    return 1.0 / math.sqrt(head_dim)


def check_hparams(hp: HParams, traits: ArchTraits, where: str) -> None:
    """Refuse shapes the forward pass cannot run, naming the value."""
    positive = (
        "n_vocab",
        "n_ctx_train",
        "n_embd",
        "n_layer",
        "n_head",
        "n_head_kv",
        "head_dim",
        "head_dim_v",
        "n_rot",
    )
    for name in positive:
        if getattr(hp, name) <= 0:
            raise UserError(f"{where}: {name} = {getattr(hp, name)} must be positive")
    if hp.n_head % hp.n_head_kv:
        raise UserError(
            f"{where}: {hp.n_head} query heads are not a multiple of {hp.n_head_kv} KV heads"
        )
    if hp.n_rot > hp.head_dim or hp.n_rot % 2:
        raise UserError(
            f"{where}: RoPE dimension {hp.n_rot} must be even and at most the head size "
            f"{hp.head_dim}"
        )
    if traits.moe:
        if not (0 < hp.n_expert_used <= hp.n_expert) or hp.n_ff_exp <= 0:
            raise UserError(
                f"{where}: a MoE model needs 0 < experts used ({hp.n_expert_used}) <= "
                f"experts ({hp.n_expert}) and an expert FFN size ({hp.n_ff_exp})"
            )
    if hp.n_ff <= 0 and (not traits.moe or hp.dense_layers):
        raise UserError(f"{where}: n_ff = {hp.n_ff} must be positive")
    if hp.mla and not (hp.n_rot < hp.head_dim_mla and hp.head_dim_v_mla > 0
                       and hp.head_dim == hp.kv_lora_rank + hp.n_rot):  # fmt: skip
        raise UserError(
            f"{where}: latent attention needs RoPE dims {hp.n_rot} below the query head size "
            f"{hp.head_dim_mla}, a value head size ({hp.head_dim_v_mla}) and a cached key of "
            f"kv_lora_rank + RoPE dims ({hp.kv_lora_rank} + {hp.n_rot}, not {hp.head_dim})"
        )
    if hp.moe_every < 1:
        raise UserError(f"{where}: a MoE layer every {hp.moe_every} layers")
    if not 0 <= hp.n_dense_lead <= hp.n_layer:
        raise UserError(f"{where}: {hp.n_dense_lead} leading dense layers of {hp.n_layer}")
    if hp.swa_layers and len(hp.swa_layers) != hp.n_layer:
        raise UserError(
            f"{where}: the sliding-window pattern names {len(hp.swa_layers)} layers, "
            f"the model has {hp.n_layer}"
        )
