"""Tensor groups: the units the planner places.

Per layer, the attention side (Q/K/V/O with their biases, the norms of the layer, and the MoE
router — pshard's "attention side", docs/pshard.md) is one group, but for the norm applied after the
FFN, which goes with the down matrix (the runtime applies it right after that product); each
FFN matrix (gate, up, down, or their expert stacks) is a group of its own, because llama.cpp's `--fit` and pshard move them one
at a time. Globally, `token_embd` and the output head (with `output_norm`) are groups. The plan
still records a location for every GGUF tensor; a group's tensors share it.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

from refengine.spec import ATTENTION, EMBEDDING, EXPERT, FFN, NORM, OUTPUT, ROUTER, ModelSpec

ATTN_SIDE, FFN_MATRIX, EXPERTS, EMBD, HEAD = "attn", "ffn", "experts", "embd", "output"
POST_FFN_NORM = "post_ffw_norm.weight"  # gemma3's norm after the FFN: read with the down matrix
# a layer's FFN groups in the order they compute (gate and up feed down), whatever the GGUF order
FFN_ORDER = ("ffn_gate", "ffn_up", "ffn_down", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
             "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")  # (glm4moe: after the routed)


def ffn_rank(base: str) -> int:
    """Where an FFN group computes in its layer (FFN_ORDER; products it does not name after,
    in the file's order)."""
    return FFN_ORDER.index(base) if base in FFN_ORDER else len(FFN_ORDER)


@dataclass(frozen=True)
class Group:
    name: str  # "blk.3.attn", "blk.3.ffn_up", "token_embd", "output"
    layer: int | None
    kind: str  # ATTN_SIDE, FFN_MATRIX, EXPERTS, EMBD or HEAD
    tensors: tuple[str, ...]
    nbytes: int
    params: int  # weights (elements); for EXPERTS, of all experts
    qtype: str  # type of the group's largest tensor (what its kernels run at)


def _group(name, layer, kind, infos) -> Group:
    big = max(infos, key=lambda t: t.nbytes)
    return Group(
        name,
        layer,
        kind,
        tuple(t.name for t in infos),
        sum(t.nbytes for t in infos),
        sum(math.prod(t.shape) for t in infos),
        big.qtype.name,
    )


_MEMO: dict[int, tuple[weakref.ref, list[Group]]] = {}


def tensor_groups(spec: ModelSpec) -> list[Group]:
    """All groups in execution order: token_embd, then each layer's attention side and FFN
    matrices, then the output head. Computed once per spec (the solver asks for them in every
    budget check); the list is shared, so callers do not change it."""
    key = id(spec)
    held = _MEMO.get(key)
    if held is None or held[0]() is not spec:
        # the entry leaves with its spec, before another object can take the same id
        held = (weakref.ref(spec, lambda _: _MEMO.pop(key, None)), _tensor_groups(spec))
        _MEMO[key] = held
    return held[1]


def _tensor_groups(spec: ModelSpec) -> list[Group]:
    by = spec.by_name
    per_layer: dict[int | None, list] = {}
    for t in spec.tensors:
        per_layer.setdefault(t.layer, []).append(t)
    glob = per_layer.get(None, [])
    embd = by["token_embd.weight"]
    groups = [_group("token_embd", None, EMBD,
                     [embd, *(t for t in glob if t.role == EMBEDDING and t is not embd)])]
    # a global tensor the layers read (rope_freqs) goes with the first layer, as in llama.cpp
    with_first = [t for t in glob if t.role == ATTENTION]
    for il in range(spec.hparams.n_layer):
        infos = per_layer.get(il, []) + (with_first if il == 0 else [])
        post_ffn = [t for t in infos if t.name == f"blk.{il}.{POST_FFN_NORM}"]
        attn = [t for t in infos if t.role in (ATTENTION, NORM, ROUTER) and t not in post_ffn]
        groups.append(_group(f"blk.{il}.attn", il, ATTN_SIDE, attn))
        matrices: dict[str, list] = {}  # a matrix (or expert stack) with its bias, weight first
        for t in sorted(infos, key=lambda t: t.name.endswith(".bias")):
            if t.role in (FFN, EXPERT):
                matrices.setdefault(t.name.split(".")[2], []).append(t)  # ffn_up, ffn_gate_exps
        for base, members in matrices.items():
            kind = EXPERTS if members[0].role == EXPERT else FFN_MATRIX
            extra = post_ffn if base.startswith("ffn_down") else []
            groups.append(_group(f"blk.{il}.{base}", il, kind, [*members, *extra]))
    # the output layer: its norms, then the head (a tied head reuses token_embd)
    head = [t for t in glob if t.role == NORM] + [t for t in glob if t.role == OUTPUT]
    groups.append(_group("output", None, HEAD, head if "output.weight" in by else [*head, embd]))
    assert {t.role for t in spec.tensors} <= {
        ATTENTION,
        NORM,
        ROUTER,
        FFN,
        EXPERT,
        EMBEDDING,
        OUTPUT,
    }
    return groups


def routed_nbytes(spec: ModelSpec, g: Group, experts: int) -> int:
    """Bytes of a routed copy of an expert group: `experts` of the stack's slices, the group's
    other tensors (a norm read with the down stack) whole."""
    stack = spec.by_name[g.tensors[0]]
    return g.nbytes - stack.nbytes + stack.nbytes // spec.hparams.n_expert * experts


def expert_nbytes(spec: ModelSpec, g: Group) -> int:
    """One expert's slice of an expert group's stack."""
    return spec.by_name[g.tensors[0]].nbytes // spec.hparams.n_expert


def cache_nbytes(spec: ModelSpec, g: Group, experts: int) -> int:
    """An expert cache of `experts` slices of g's stack (its region of the arena)."""
    return expert_nbytes(spec, g) * experts if experts else 0


def routed_slot_nbytes(spec: ModelSpec, g: Group, tokens: int, cache: int = 0) -> int:
    """A routed copy's slot: the most experts a ubatch of `tokens` can route to, less those an
    expert cache of `cache` experts holds (a chosen expert always finds a place there while the
    cache holds any expert the ubatch did not choose)."""
    hp = spec.hparams
    return routed_nbytes(spec, g, max(0, min(hp.n_expert, hp.n_expert_used * tokens) - cache))
