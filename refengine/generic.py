"""The generic rule: hyperparameters for a causal text architecture refengine has no exact model of
(llama.cpp 0.3.36 loads 130; `arch.ARCHES` models a few), read from what every such file states.

The planner then prices the model by its tensors alone: each `blk.N` weight is read once a token
but a routed stack (`*_exps`), of which a token reads the experts it chose; a layer routes where
it holds such stacks (`expert_count` and `expert_used_count` are then required); the KV cache
keeps `attention.head_count_kv` x (`key_length` + `value_length`) F16 values a token on every
layer, within a sliding window only where the file says which layers slide (else every layer is
priced with a full cache: never less than llama.cpp allocates); where the file gives head counts
per layer, every layer is priced with the most. The FFN's widths, which llama.cpp's
compute buffer follows, are the rows of the file's own products. Architectures with a state per
sequence are refused before this (`arch.unsupported`): the rule has nothing to price it by.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from .arch import ArchTraits
from .hparams import HParams, swa_layers


def generic_hparams(m, traits: ArchTraits, shapes: dict[str, tuple[int, ...]], n_vocab: int
                    ) -> tuple[ArchTraits, HParams]:  # fmt: skip
    """`m`: the file's `{arch}.*` metadata (spec._Meta); `shapes`: its tensors' numpy shapes.
    The traits come back routed when the file holds expert stacks."""
    m.require("attention.head_count")
    n_embd, n_layer = m.need("embedding_length"), m.need("block_count")
    n_head = _most(m, "attention.head_count", 0)
    head_dim = m.get("attention.key_length", n_embd // n_head if n_head > 0 else 0)
    routed = tuple(f"blk.{il}.ffn_down_exps.weight" in shapes for il in range(n_layer))
    n_expert = n_used = n_ff_exp = 0
    if any(routed):
        n_expert, n_used = m.need("expert_count"), m.need("expert_used_count")
        n_ff_exp = max(s[-1] for n, s in shapes.items() if n.endswith(".ffn_down_exps.weight"))
    n_swa = m.get("attention.sliding_window", 0)
    pattern = m.fields.get(f"{m.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, np.ndarray):  # a per-layer list of booleans, true = sliding
        swa = tuple(bool(b) for b in pattern[:n_layer])
    elif pattern is not None and n_swa:
        swa = swa_layers(traits, n_layer, m.get("attention.sliding_window_pattern", 0))
    else:
        swa = ()
    swa = swa if any(swa) else ()
    rope_base = m.get("rope.freq_base", 10000.0, float)
    hp = HParams(
        n_vocab=n_vocab,
        n_ctx_train=m.need("context_length"),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=_rows(shapes, ("ffn_up", "ffn_gate")) or _most(m, "feed_forward_length", 0),
        n_head=n_head,
        n_head_kv=_most(m, "attention.head_count_kv", n_head),
        head_dim=head_dim,
        head_dim_v=m.get("attention.value_length", head_dim),
        n_rot=m.get("rope.dimension_count", head_dim),
        rope_base=rope_base,
        rope_base_swa=rope_base,
        rope_scale=1.0,
        rms_eps=1e-5,  # not priced
        attn_scale=head_dim ** -0.5 if head_dim > 0 else 1.0,
        n_swa=n_swa if swa else 0,
        swa_layers=swa,
        n_expert=n_expert,
        n_expert_used=n_used,
        n_ff_exp=n_ff_exp,
        n_ff_shexp=_rows(shapes, ("ffn_up_shexp", "ffn_gate_shexp")),
        routed_layers=routed if any(routed) else (),
    )
    return replace(traits, moe=any(routed)), hp


def _most(m, key: str, default: int) -> int:
    """A key's value, or where the file gives one per layer, the largest (a bound on every
    layer's cache and products)."""
    value = m.fields.get(f"{m.arch}.{key}")
    if isinstance(value, np.ndarray) and value.size:
        return int(value.max())
    return m.get(key, default)


def _rows(shapes: dict[str, tuple[int, ...]], products: tuple[str, ...]) -> int:
    """The most output rows of any layer's product named in `products` (0: none in the file)."""
    stems = tuple(f".{p}.weight" for p in products)
    return max((s[0] for n, s in shapes.items() if n.startswith("blk.") and n.endswith(stems)),
               default=0)  # fmt: skip


def generic_note(name: str) -> str:
    """The line `info` and `solve` print for a model the generic rule prices."""
    return (f"priced generically: refengine has no exact model of {name}; each layer weight is "
            "read once a token (a routed stack: the experts chosen), the KV cache from "
            "attention.*")
