"""Memory terms: KV cache per layer, compute buffers, and the scratch ring (docs/llamacpp.md).

- KV bytes of a layer = cells x (row bytes of K + row bytes of V), K/V rows of head_dim x n_head_kv
  values in the KV type (f16: 2 B per value; q8_0: 34 B per 32). llama.cpp pads n_ctx to 256
  cells; a sliding-window layer holds pad256(min(n_ctx_seq, n_swa * n_seq + n_ubatch)) cells.
- Compute buffer of llama.cpp, fixed against llama.cpp's own `sched_reserve` figures (refengine
  verify; tests/test_verify.py): ggml's allocator reuses a tensor's memory once its last reader has
  run, so a device's buffer is the largest set of tensors alive at one point of the graph, sized for
  a full ubatch of T = min(n_ubatch, n_ctx) tokens of f32 activations: in a layer's attention 2
  n_embd + 2 q_dim values per token (with flash attention; without it, also the KQ scores, n_kv x
  n_head per token), in its FFN 3 n_ff (routed: n_ff_exp x experts used) + 2 n_embd + q_dim (routed,
  at least the k experts' outputs and their mix, (k + 3) n_embd), beside the KQ mask copied to the
  device (n_kv per token, f16 with flash attention, f32 without; sliding-window layers have their
  own); at the output head, logits and the normed input, n_vocab + n_embd per output row. With
  several devices and every layer offloaded without overrides, llama.cpp pipelines ubatches across
  the devices and keeps PIPELINE_COPIES copies of each input a device receives from another, for the
  whole graph: the activations entering it (n_embd per token) and, where it attends, the masks (the
  first device to attend holds the masks themselves, so one copy fewer; a device holding only the
  head receives no masks). A device whose layers' routed experts are computed on the CPU (held there
  and not offloaded: RPC devices never offload, a GPU only at 32 tokens and more) receives the
  experts' outputs, k n_embd per token, and mixes them: its FFN term is (k + 3) n_embd per token,
  (2k + 1) n_embd where it also mixes the layer before its first (CPU-computed experts of a layer
  elsewhere: their mix runs on the next device), and then the head beside such layers keeps n_embd
  more; a device holding the head alone mixes the last layer's and keeps those inputs, (k + 1)
  n_embd per token, beside the head's. With shared experts (glm4moe), computed after the mix, the
  FFN term of a mixing device is (k + 4) n_embd, and a device that holds the head and mixes a layer
  before the last keeps 2 k n_ff_exp + n_embd more beside the logits (a bound: llama.cpp reserved up
  to 2.9 MiB less). Measured on dense, MoE and sliding-window shapes to the 1/64 MiB llama.cpp
  prints, except where ggml's best-fit allocator fragments (an FFN narrower than about 2.5 n_embd;
  without flash attention the allocator's reuse varies). Latent attention (deepseek2) keeps per
  token n_head (2 kv_lora_rank + 2 n_rot + head_dim_mla) + 2 n_embd + q_lora_rank values (measured
  over seven shapes to 3 values a token), and, as a bound, the shared expert's n_ff_shexp.
- Scratch ring (our runtime): `prefetch_depth` slots, each as large as the largest set of tensors a
  layer streams, so layer i+1's copy lands while layer i computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.quants import qtype
from refengine.spec import ModelSpec

from .cells import pad_cells
from .targets import traits
KV_TYPES = ("f16", "q8_0")
PIPELINE_COPIES = 4  # GGML_SCHED_MAX_COPIES
PIPELINED_INT_INPUT_NBYTES = 24  # per token and copy
DELTA_NET_CHUNK = 64  # tokens a gated delta net's prompt pass takes together (llama.cpp's)


@dataclass(frozen=True)
class KVShape:
    n_ctx: int  # tokens of context, per sequence times users (unified cache)
    users: int = 1
    kv_type: str = "f16"
    n_ubatch: int = 512


def kv_cell_nbytes(spec: ModelSpec, kv_type: str) -> int:
    """Bytes one cached token takes in one layer (K and V)."""
    hp = spec.hparams
    q = qtype(kv_type.upper())
    v = 0 if hp.mla else q.row_nbytes(hp.head_dim_v * hp.n_head_kv)  # latent attention: no V
    return q.row_nbytes(hp.head_dim * hp.n_head_kv) + v


def kv_cells(spec: ModelSpec, il: int, kv: KVShape) -> int:
    n_ctx = pad_cells(kv.n_ctx)
    if spec.is_swa(il):
        return min(n_ctx, pad_cells(spec.hparams.n_swa * kv.users + kv.n_ubatch))
    return n_ctx


def kv_layer_nbytes(spec: ModelSpec, il: int, kv: KVShape) -> int:
    """A layer's cache: its cells' K and V, or a recurrent layer's state for each user."""
    if spec.hparams.recurrent(il):
        return kv.users * spec.hparams.state_nbytes
    return kv_cells(spec, il, kv) * kv_cell_nbytes(spec, kv.kv_type)


def compute_nbytes(
    spec: ModelSpec,
    n_ubatch: int,
    n_ctx: int,
    flash_attn: bool,
    output_rows: int,
    target: str = "llamacpp",
    pipeline_copies: int = 1,
    attends: bool = True,
    holds_masks: bool = False,
    mixes_cpu_experts: bool = False,
    mixes_the_layer_before: bool = False,
    mixed_cpu_layers: tuple[int, ...] = (),
    one_layer: bool = False,
) -> int:
    """Compute buffer of one device for ubatches of n_ubatch tokens, `output_rows` of which get
    logits there (llama.cpp reserves for all n_ubatch; our runtime, one per sequence): llama.cpp's
    as measured against it (above); our runtime's, exact (its workspace layout, and the most
    that aligning its memory map's regions adds)."""
    if not traits(target).ggml_memory:
        from .workspace import layout, map_padding_nbytes, nbytes

        return nbytes(layout(spec, n_ubatch, output_rows, n_ctx)) + map_padding_nbytes(spec)
    return llamacpp_compute_nbytes(spec, n_ubatch, n_ctx, flash_attn, output_rows, pipeline_copies,
                                   attends, holds_masks, mixes_cpu_experts,
                                   mixes_the_layer_before, mixed_cpu_layers, one_layer)  # fmt: skip


def llamacpp_compute_nbytes(
    spec: ModelSpec,
    n_ubatch: int,
    n_ctx: int,
    flash_attn: bool,
    output_rows: int,
    pipeline_copies: int = 1,
    attends: bool = True,
    holds_masks: bool = False,
    mixes_cpu_experts: bool = False,
    mixes_the_layer_before: bool = False,
    mixed_cpu_layers: tuple[int, ...] = (),
    one_layer: bool = False,
) -> int:
    """`pipeline_copies`: llama.cpp's scheduler keeps that many copies of each input a device
    receives (the incoming activations, and the KQ masks where it `attends` but does not hold them
    itself) when it pipelines ubatches across devices; the defaults bound every device.
    `mixes_cpu_experts`: the routed experts of the device's layers run on the CPU, the device only
    mixes their outputs; `mixes_the_layer_before`: it also mixes those of the layer before its
    first (with no layers: before the head); `mixed_cpu_layers`: the layers of the device whose
    CPU-computed experts it mixes; `one_layer`: the device computes a single layer, whose masks
    its allocator frees after the attention (unpipelined)."""
    hp = spec.hparams
    n_kv = pad_cells(n_ctx)
    tokens = min(n_ubatch, n_kv)  # llama.cpp caps the ubatch at the context
    q_dim = hp.n_head * hp.head_dim
    mask_value_nbytes = 2 if flash_attn else 4
    swa = [spec.is_swa(il) for il in range(hp.n_layer)]
    n_kv_swa = min(n_kv, pad_cells(hp.n_swa + tokens)) if any(swa) else 0
    n_kv_full = n_kv if not all(swa) else 0
    masks = mask_value_nbytes * tokens * (n_kv_full + n_kv_swa)
    attention = 4 * tokens * (2 * hp.n_embd + 2 * q_dim)
    if hp.mla:  # the absorbed queries (latent + RoPE per head), the latent output per head,
        # the projected queries, their RoPE part, and Q's low-rank input (measured, fa on/off);
        # and a shared expert's rows, which the allocator left in the way from three routed
        # layers on (0.72 MiB of its 0.75 at 512 tokens)
        attention = 4 * tokens * (hp.n_head * (2 * hp.kv_lora_rank + 2 * hp.n_rot
                                               + hp.head_dim_mla)
                                  + 2 * hp.n_embd + hp.q_lora_rank + hp.n_ff_shexp)  # fmt: skip
        q_dim = hp.n_head * hp.head_dim_v_mla  # what the FFN's term keeps of the attention's
    if not flash_attn:
        # the scores, and a copy of the attention's output made contiguous (at most n_embd / 2
        # beyond the flash path's tensors, as measured)
        attention += 4 * tokens * (max(n_kv_full, n_kv_swa) * hp.n_head + hp.n_embd // 2)
    ffn = 4 * tokens * (3 * hp.n_ff_active + 2 * hp.n_embd + q_dim)
    head = 4 * min(output_rows, tokens) * (hp.n_vocab + hp.n_embd)
    k, activations = hp.n_expert_used, 4 * tokens * hp.n_embd
    if hp.n_expert:  # the chosen experts' outputs and their mix, where wider than the products
        ffn = max(ffn, activations * (k + 3))
    if hp.recurrent_layers:
        attention = max(attention, _delta_net_nbytes(hp, tokens))
        # beside a gated shared expert the chosen experts' outputs twice (measured, qwen35moe)
        ffn = max(ffn, activations * (2 * k + 1) + 4 * tokens * k * hp.n_ff_exp)
    shared = 1 if hp.n_ff_shexp else 0  # the shared experts' output beside the routed mix
    if mixes_cpu_experts:
        ffn = activations * (2 * k + 1 if mixes_the_layer_before else k + 3 + shared)
        # n_embd more beside the head where the layer before was another device's (measured;
        # none after CPU layers: reserved either way)
        head += activations if output_rows and mixes_the_layer_before else 0
    elif mixes_the_layer_before and output_rows:  # the head alone
        head += activations * (k + 1)
    gated = spec.arch.gated_shared_expert
    if shared and output_rows and any(gated or il < hp.n_layer - 1 for il in mixed_cpu_layers):
        # beside the logits where it mixes a layer before the last, the chosen experts' gate and
        # up outputs and n_embd (measured on glm4moe, tests/test_glm4moe.py: 0.0-2.9 MiB over
        # llama.cpp's figure, which its allocator's placement of earlier tensors sets); beside a
        # gated shared expert (qwen35moe), where it mixes any layer, their outputs and two n_embd
        head += activations * (k + 2) if gated else 4 * tokens * (2 * k * hp.n_ff_exp
                                                                  + hp.n_embd)  # fmt: skip
    if pipeline_copies == 1:
        # (measured: llama and olmo2 layouts, one layer at 16384 cells, 16 MiB of masks:
        # 20.0 and 19.0 MiB allocated, where the masks beside the FFN's 12 would be 28)
        # (not where it mixes CPU experts: between its splits the masks stay, 22.0 MiB
        # allocated on granitemoe where freeing them would leave 20)
        body = (max(masks + attention, ffn) if one_layer and not mixes_cpu_experts
                else masks + max(attention, ffn))  # fmt: skip
        return max(body, head) if attends else head
    # the activations, and the small integer inputs (positions, output ids: measured 20 bytes a
    # token on a device that attends, 24 on the head's; the larger bounds both)
    arriving = pipeline_copies * tokens * (4 * hp.n_embd + PIPELINED_INT_INPUT_NBYTES)
    if not attends:  # the head alone
        return head + arriving
    if holds_masks:
        return max(masks + max(attention, ffn), head) + (pipeline_copies - 1) * masks + arriving
    return max(max(attention, ffn), head) + pipeline_copies * masks + arriving


def _delta_net_nbytes(hp, tokens: int) -> int:
    """A gated delta net's compute buffer (qwen35moe's recurrent layers), a bound fitted to
    llama.cpp's over 30 shapes (docs/measured/2026-11-28-qwen35moe-compute.txt): its convolution's
    inputs and outputs, three times the convolved width a token, beside a state; or its chunks
    of 64 tokens, which keep two states, per-chunk products and per-token queries, keys and values.
    """
    keys, values = hp.ssm_groups * hp.ssm_state, hp.ssm_inner
    conv = 2 * keys + values
    state = 4 * hp.ssm_state * hp.ssm_inner
    convolution = 4 * tokens * (3 * conv + 2 * hp.n_embd + 64) + state
    chunks = (3 * state // 2 + 4 * tokens * (4 * values + 5 * keys + 2 * hp.n_embd)
              + 2 * 4 * DELTA_NET_CHUNK * values)  # fmt: skip
    return max(convolution, chunks)


def expected_distinct_experts(n_expert: int, n_used: int, tokens: int) -> float:
    """Experts a ubatch of `tokens` touches when each picks n_used of n_expert uniformly:
    E * (1 - (1 - k/E)^M) (docs/pshard.md, reason 5)."""
    if n_expert == 0:
        return 0.0
    return n_expert * (1.0 - (1.0 - n_used / n_expert) ** tokens)
