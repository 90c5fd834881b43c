"""ModelSpec: what a GGUF model is — architecture, hyperparameters and a tensor inventory — read
from the file's metadata without reading any weight (the file is memory-mapped).

Shapes are in numpy order: the last dimension is the contiguous one (a weight that maps n_in to
n_out is `(n_out, n_in)`; a stack of experts is `(n_expert, n_out, n_in)`), the reverse of ggml's
`ne`. `spec_from_hparams` builds the same structure from hyperparameters alone, for planning at
sizes nobody downloads here.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from .arch import ArchTraits, arch_traits, require_engines
from .errors import UserError
from .generic import generic_hparams
from .gguf_file import read_gguf
from .hparams import (HParams, attention_scale, check_hparams, expert_rows, recurrent_layers,
                      shared_expert_rows, swa_base, swa_layers)
from .layout import check_tensors
from .quants import qtype, require, tensor_nbytes

# Tensor roles (the planner places tensors by role; `info` totals bytes per role).
ATTENTION, FFN, EXPERT, ROUTER, NORM, EMBEDDING, OUTPUT, NEXTN = (
    "attention",
    "ffn",
    "moe_expert",
    "router",
    "norm",
    "embedding",
    "output",
    "nextn",
)
ROLES = (EMBEDDING, ATTENTION, NORM, FFN, ROUTER, EXPERT, OUTPUT)

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def layer_of(name: str) -> int | None:
    """The block index of a tensor (`blk.12.ffn_up.weight` -> 12), None for global tensors."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def _base(name: str) -> str:
    """A tensor's name without its layer prefix and its suffix (blk.3.attn_q.weight -> attn_q)."""
    return _BLK.sub(r"\2", name).rsplit(".", 1)[0]


def tensor_role(name: str) -> str:
    """The role of a GGUF tensor from its name (llama.cpp's naming)."""
    base = _base(name)
    if base == "token_embd":
        return EMBEDDING
    if base == "output":
        return OUTPUT
    if base.startswith("nextn."):
        return NEXTN
    if base == "rope_freqs":  # RoPE's factors, read with the first layer's attention
        return ATTENTION
    if "norm" in base:
        return NORM
    if base in ("ffn_gate_inp", "exp_probs_b", "ffn_gate_inp_shexp"):
        return ROUTER
    if base.startswith("ssm_"):  # a recurrent layer's mixer, in place of attention
        return ATTENTION
    if base.endswith("_exps"):
        return EXPERT
    if base.startswith("ffn_"):
        return FFN
    if base.startswith("attn_"):
        return ATTENTION
    raise UserError(f"tensor {name!r} has no known role; the file is not a supported layout")


_INPUT_LAYER = ("token_embd.", "position_embd.", "token_types.", "per_layer_token_embd.")


def generic_role(name: str) -> str:
    """A tensor's role under the generic rule, by llama.cpp's layer of it: the input layer's
    tensors are embeddings, the other global ones the output layer's but RoPE factors (read
    with the first layer); in a block, what is not an FFN, a router or a norm is the attention
    side, whatever it computes."""
    if layer_of(name) is None:
        if name.startswith(_INPUT_LAYER):
            return EMBEDDING
        if name.startswith("rope_"):
            return ATTENTION
        return NORM if "norm" in name else OUTPUT
    base = _base(name)
    if base.endswith("_exps"):
        return EXPERT
    if base.startswith(("ffn_gate_inp", "exp_probs_b")):
        return ROUTER
    if "norm" in base:
        return NORM
    return FFN if base.startswith("ffn_") else ATTENTION


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order, contiguous dimension last
    qtype: GGMLQuantizationType
    nbytes: int
    layer: int | None  # None for token_embd, output_norm, output
    role: str
    offset: int | None = None  # absolute byte offset in the GGUF file (None: spec-only)


@dataclass(frozen=True)
class ModelSpec:
    arch: ArchTraits
    hparams: HParams
    tensors: tuple[TensorInfo, ...]
    path: Path | None = None  # None for a spec-only model
    file_nbytes: int = 0
    name: str = ""
    # in the file, and loaded by nobody: the NextN blocks' tensors (llama.cpp's TENSOR_SKIP)
    unloaded: tuple[TensorInfo, ...] = ()

    @cached_property
    def by_name(self) -> dict[str, TensorInfo]:
        return {t.name: t for t in self.tensors}

    def layer_tensors(self, il: int | None) -> list[TensorInfo]:
        return [t for t in self.tensors if t.layer == il]

    @property
    def weights_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def n_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def qtypes(self) -> set:
        """The types its tensors are stored in."""
        return {t.qtype for t in self.tensors}

    @property
    def tied_output(self) -> bool:
        return "output.weight" not in self.by_name

    def is_swa(self, il: int) -> bool:
        return bool(self.hparams.swa_layers and self.hparams.swa_layers[il])


def require_runnable(spec: ModelSpec, engine: str) -> None:
    """One line when `engine` (an engine's name) cannot run `spec`: its architecture is planned
    only, or its kernels lack one of its types."""
    require_engines(spec.arch)
    require(spec.qtypes, engine)


class _Meta:
    """`{arch}.*` metadata, typed: `need_*` for keys llama.cpp requires, `get_*` with llama.cpp's
    default for the others; a value of the wrong type is one clear error either way."""

    def __init__(self, fields: dict, arch: str, path: Path):
        self.fields, self.arch, self.path = fields, arch, path

    def _typed(self, key: str, value, kind):
        ok = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(
            value, bool
        )
        if kind is str:
            ok = isinstance(value, str)
        if not ok:
            raise UserError(
                f"{self.path}: metadata {self.arch}.{key} = {value!r:.60} is not a single "
                f"{kind.__name__}; per-layer or odd values are not supported"
            )
        return kind(value)

    def require(self, key: str) -> None:
        if f"{self.arch}.{key}" not in self.fields:
            raise UserError(
                f"{self.path}: metadata key '{self.arch}.{key}' is missing; the file is incomplete"
            )

    def need(self, key: str, kind=int):
        self.require(key)
        return self._typed(key, self.fields[f"{self.arch}.{key}"], kind)

    def get(self, key: str, default, kind=int):
        full = f"{self.arch}.{key}"
        return self._typed(key, self.fields[full], kind) if full in self.fields else default


def _rope_scale(m: _Meta) -> float:
    """llama.cpp: linear scaling by 1/factor unless the type is "none"; a factor of 0 means none."""
    kind = m.get("rope.scaling.type", "linear", str)
    if kind not in ("none", "linear"):
        raise UserError(f"{m.path}: RoPE scaling {kind!r} is not supported (none and linear are)")
    factor = m.get("rope.scaling.factor", m.get("rope.scale_linear", 0.0, float), float)
    return 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor


def _swa(m: _Meta, traits: ArchTraits, n_layer: int) -> tuple[int, tuple[bool, ...]]:
    n_swa = m.get("attention.sliding_window", 0) if traits.swa_pattern else 0
    if traits.attention_chunk:  # llama4: chunked unless the window is given as 0
        n_swa = m.get("attention.sliding_window", traits.attention_chunk) and (
            traits.attention_chunk)  # fmt: skip
    if n_swa == 0:
        return 0, ()
    pattern = m.fields.get(f"{m.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, np.ndarray):  # a per-layer list of booleans, true = sliding
        return n_swa, tuple(bool(b) for b in pattern)
    return n_swa, swa_layers(
        traits, n_layer, None if pattern is None else m.get("attention.sliding_window_pattern", 0)
    )


def _latent(m: _Meta, hp: HParams, n_layer: int) -> HParams:
    """A deepseek2 file's latent attention. Its converter writes the cache's row as the key
    (key_length = kv_lora_rank + RoPE dims, one KV head) and the query and value heads' sizes as
    *_mla; llama.cpp requires q_lora_rank but of its "lite" models (26 or 27 layers, or 48 with
    a vocabulary of 128256)."""
    if not all(f"{m.arch}.attention.{k}_length_mla" in m.fields for k in ("key", "value")):
        raise UserError(f"{m.path}: no attention.key_length_mla / value_length_mla: an older "
                        "conversion (one attn_kv_b per layer) that refengine does not plan; "
                        "convert the model again with a current llama.cpp")  # fmt: skip
    lite = n_layer in (26, 27) or (n_layer == 48 and hp.n_vocab == 128256)
    return replace(hp, kv_lora_rank=m.need("attention.kv_lora_rank"),
                   q_lora_rank=m.get("attention.q_lora_rank", 0) if lite
                   else m.need("attention.q_lora_rank"),
                   head_dim_mla=m.need("attention.key_length_mla"),
                   head_dim_v_mla=m.need("attention.value_length_mla"))  # fmt: skip


def _recurrent(m: _Meta, hp: HParams, n_layer: int) -> HParams:
    """A hybrid file's recurrent layers (its per-layer list, else every full_attention_interval-th
    layer attends) and their state's sizes."""
    listed = m.fields.get(f"{m.arch}.attention.recurrent_layers")
    if isinstance(listed, np.ndarray):
        layers = tuple(bool(b) for b in listed[:n_layer])
    else:
        layers = recurrent_layers(n_layer, m.get("full_attention_interval", 4))
    return replace(hp, recurrent_layers=layers, ssm_conv_kernel=m.need("ssm.conv_kernel"),
                   ssm_inner=m.need("ssm.inner_size"), ssm_state=m.need("ssm.state_size"),
                   ssm_groups=m.need("ssm.group_count"),
                   ssm_v_heads=m.need("ssm.time_step_rank"))  # fmt: skip


def load_spec(path: str | os.PathLike) -> ModelSpec:
    """ModelSpec of a GGUF file (no weights read), checked against its architecture's layout."""
    g = read_gguf(path)
    p = g.path
    name = g.fields.get("general.architecture")
    m = _Meta(g.fields, str(name), p)
    traits = arch_traits(name, m.get("expert_count", 0))  # a llama with experts routes
    role_of = generic_role if traits.generic else tensor_role
    routed_keys = ("expert_count", "expert_used_count") if traits.moe else ()
    for key in (*routed_keys, *traits.required_keys):
        m.require(key)

    tensors = []
    for t in g.tensors:
        if not 1 <= len(t.ne) <= 4:
            raise UserError(f"{p}: tensor {t.name} has {len(t.ne)} dimensions; the file is corrupt")
        q = qtype(t.ggml_type)  # refuses unsupported types
        shape = tuple(int(d) for d in reversed(t.ne))
        nbytes = tensor_nbytes(shape, q.ggml)
        if t.offset + nbytes > g.file_nbytes:
            raise UserError(
                f"{p}: tensor {t.name} ends at byte {t.offset + nbytes} but the file has "
                f"{g.file_nbytes} bytes; the file is truncated — download it again"
            )
        tensors.append(
            TensorInfo(
                name=t.name,
                shape=shape,
                qtype=q.ggml,
                nbytes=nbytes,
                layer=layer_of(t.name),
                role=role_of(t.name),
                offset=t.offset,
            )
        )
    shapes = {t.name: t.shape for t in tensors}
    if len(shapes.get("token_embd.weight", ())) != 2:
        raise UserError(f"{p}: no 2-D token_embd.weight tensor; not a supported model file")
    if traits.generic:  # the file's tensors are llama.cpp's to check
        traits, hp = generic_hparams(m, traits, shapes, shapes["token_embd.weight"][0])
        check_hparams(hp, traits, str(p))
        return ModelSpec(arch=traits, hparams=hp, tensors=tuple(tensors), path=p.resolve(),
                         file_nbytes=g.file_nbytes,
                         name=str(g.fields.get("general.name", p.stem)))  # fmt: skip

    n_embd, n_head, n_block = (
        m.need("embedding_length"),
        m.need("attention.head_count"),
        m.need("block_count"),
    )
    n_nextn = m.get("nextn_predict_layers", 0) if traits.nextn else 0
    n_layer = n_block - n_nextn
    head_dim = m.get("attention.key_length", n_embd // n_head if n_head > 0 else 0)
    n_expert_used = m.get("expert_used_count", 0)
    n_ff = m.get("feed_forward_length", 0)
    n_swa, swa = _swa(m, traits, n_layer)
    hp = HParams(
        n_vocab=shapes["token_embd.weight"][0],
        n_ctx_train=m.need("context_length"),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=n_ff,
        n_head=n_head,
        n_head_kv=m.get("attention.head_count_kv", n_head),
        head_dim=head_dim,
        head_dim_v=m.get("attention.value_length", head_dim),
        n_rot=m.get("rope.dimension_count", head_dim),
        rope_base=m.get("rope.freq_base", 10000.0, float),
        rope_base_swa=m.get("rope.freq_base_swa",
                            swa_base(traits, m.get("rope.freq_base", 10000.0, float)), float),
        rope_scale=_rope_scale(m) if traits.engines else 1.0,  # planned only: llama.cpp's
        rms_eps=m.need("attention.layer_norm_rms_epsilon", float),
        attn_scale=attention_scale(traits, n_layer, n_embd, max(n_head, 1), max(head_dim, 1)),
        n_swa=n_swa,
        swa_layers=swa,
        n_expert=m.get("expert_count", 0),
        n_expert_used=n_expert_used,
        # (llama.cpp's fallback where the key is absent: n_ff over the experts used)
        n_ff_exp=expert_rows(traits, n_ff, m.get("expert_feed_forward_length",
                                                 n_ff // n_expert_used if n_expert_used else 0)),
        n_dense_lead=m.get("leading_dense_block_count", 0) if traits.dense_lead else 0,
        n_nextn=n_nextn,
    )
    hp = replace(hp, n_ff_shexp=shared_expert_rows(
        traits, n_ff, hp.n_ff_exp, m.need("expert_shared_count") if traits.shared_experts else 0,
        m.get("expert_shared_feed_forward_length", 0) if traits.gated_shared_expert else 0))
    if traits.interleaved_moe:
        hp = replace(hp, moe_every=m.need("interleave_moe_layer_step"))
    if traits.mla:
        hp = _latent(m, hp, n_layer)
    if traits.hybrid:
        hp = _recurrent(m, hp, n_layer)
    check_hparams(hp, traits, str(p))
    check_tensors(traits, hp, shapes, str(p))
    return ModelSpec(
        arch=traits,
        hparams=hp,
        tensors=tuple(t for t in tensors if t.layer is None or t.layer < n_layer),
        path=p.resolve(),
        file_nbytes=g.file_nbytes,
        name=str(g.fields.get("general.name", p.stem)),
        unloaded=tuple(t for t in tensors if t.layer is not None and t.layer >= n_layer),
    )
