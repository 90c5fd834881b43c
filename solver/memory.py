"""Memory terms: KV cache per layer, compute buffers, and the scratch ring (LLAMACPP.md).

- KV bytes of a layer = cells x (row bytes of K + row bytes of V), K/V rows of head_dim x n_head_kv
  values in the KV type (f16: 2 B per value; q8_0: 34 B per 32). llama.cpp pads n_ctx to 256
  cells; a sliding-window layer holds pad256(min(n_ctx_seq, n_swa * n_seq + n_ubatch)) cells.
- Compute buffer (approximate, from reading llama.cpp; to be checked against `llama-fit-params
  -fitp on`): without flash attention the KQ scores, 4 * n_ctx * n_ubatch * n_head bytes, dominate;
  with it, the activations of one ubatch (residual, Q/K/V, FFN intermediates) in f32; the device
  holding the output head also holds f32 logits: n_ubatch rows for llama.cpp, which reserves for
  the worst case, one per sequence for our runtime.
- Scratch ring (our runtime): `prefetch_depth` slots, each as large as the largest set of tensors a
  layer streams, so layer i+1's copy lands while layer i computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from refengine.quants import qtype
from refengine.spec import ModelSpec

CELL_PAD = 256
KV_TYPES = ("f16", "q8_0")


def pad_cells(n: int) -> int:
    return -(-n // CELL_PAD) * CELL_PAD


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
    return q.row_nbytes(hp.head_dim * hp.n_head_kv) + q.row_nbytes(hp.head_dim_v * hp.n_head_kv)


def kv_cells(spec: ModelSpec, il: int, kv: KVShape) -> int:
    n_ctx = pad_cells(kv.n_ctx)
    if spec.is_swa(il):
        return min(n_ctx, pad_cells(spec.hparams.n_swa * kv.users + kv.n_ubatch))
    return n_ctx


def kv_layer_nbytes(spec: ModelSpec, il: int, kv: KVShape) -> int:
    return kv_cells(spec, il, kv) * kv_cell_nbytes(spec, kv.kv_type)


def compute_nbytes(
    spec: ModelSpec,
    n_ubatch: int,
    n_ctx: int,
    flash_attn: bool,
    output_rows: int,
    target: str = "llamacpp",
) -> int:
    """Compute buffer of one device for ubatches of n_ubatch tokens, `output_rows` of which get
    logits there (llama.cpp reserves for all n_ubatch; our runtime, one per sequence): llama.cpp's,
    approximate; our runtime's, exact (its workspace layout)."""
    if target == "refengine":
        from .workspace import layout, nbytes

        return nbytes(layout(spec, n_ubatch, output_rows, n_ctx))
    hp = spec.hparams
    n_ff = hp.n_ff_active
    q_dim = hp.n_head * hp.head_dim
    activations = 4 * n_ubatch * (3 * hp.n_embd + 3 * q_dim + 3 * n_ff)
    scores = 0 if flash_attn else 4 * pad_cells(n_ctx) * n_ubatch * hp.n_head
    logits = 4 * hp.n_vocab * output_rows
    return max(activations, scores) + logits


def expected_distinct_experts(n_expert: int, n_used: int, tokens: int) -> float:
    """Experts a ubatch of `tokens` touches when each picks n_used of n_expert uniformly:
    E * (1 - (1 - k/E)^M) (PSHARD.md, reason 5)."""
    if n_expert == 0:
        return 0.0
    return n_expert * (1.0 - (1.0 - n_used / n_expert) ** tokens)
