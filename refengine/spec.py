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
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from .arch import ArchTraits, arch_traits
from .errors import UserError
from .gguf_file import read_gguf
from .quants import qtype, tensor_nbytes

# Tensor roles (the planner places tensors by role; `info` totals bytes per role).
ATTENTION, FFN, EXPERT, ROUTER, NORM, EMBEDDING, OUTPUT = (
    "attention", "ffn", "moe_expert", "router", "norm", "embedding", "output",
)
ROLES = (EMBEDDING, ATTENTION, NORM, FFN, ROUTER, EXPERT, OUTPUT)

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


def tensor_role(name: str) -> str:
    """The role of a GGUF tensor from its name (llama.cpp's naming)."""
    base = _BLK.sub(r"\2", name).rsplit(".", 1)[0]
    if base == "token_embd":
        return EMBEDDING
    if base == "output":
        return OUTPUT
    if "norm" in base:
        return NORM
    if base == "ffn_gate_inp":
        return ROUTER
    if base.endswith("_exps"):
        return EXPERT
    if base.startswith("ffn_"):
        return FFN
    if base.startswith("attn_"):
        return ATTENTION
    raise UserError(f"tensor {name!r} has no known role; the file is not a supported layout")


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
class HParams:
    n_vocab: int
    n_ctx_train: int
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
    n_swa: int = 0  # sliding window in tokens; 0: none
    swa_layers: tuple[bool, ...] = ()  # per layer: uses the sliding window
    n_expert: int = 0
    n_expert_used: int = 0
    n_ff_exp: int = 0


@dataclass(frozen=True)
class ModelSpec:
    arch: ArchTraits
    hparams: HParams
    tensors: tuple[TensorInfo, ...]
    path: Path | None = None  # None for a spec-only model
    file_nbytes: int = 0
    file_mtime_ns: int = 0
    name: str = ""
    file_type: str = ""
    metadata: dict = field(default_factory=dict, compare=False, repr=False)

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
    def tied_output(self) -> bool:
        return "output.weight" not in self.by_name

    def is_swa(self, il: int) -> bool:
        return bool(self.hparams.swa_layers and self.hparams.swa_layers[il])

    def identity(self) -> dict:
        """What fingerprints the model file (plans, caches)."""
        return {"path": str(self.path), "nbytes": self.file_nbytes, "mtime_ns": self.file_mtime_ns}


def swa_layers(traits: ArchTraits, n_layer: int, pattern: int | None = None) -> tuple[bool, ...]:
    p = pattern if pattern is not None else traits.swa_pattern
    if not p:
        return ()
    return tuple(il % p < p - 1 for il in range(n_layer))


class _Meta:
    """`{arch}.*` metadata: `need` for keys llama.cpp requires (one clear error when missing),
    `get` with llama.cpp's default for the others."""

    def __init__(self, fields: dict, arch: str, path: Path):
        self.fields, self.arch, self.path = fields, arch, path

    def need(self, key: str):
        full = f"{self.arch}.{key}"
        if full not in self.fields:
            raise UserError(f"{self.path}: metadata key {full!r} is missing; the file is incomplete")
        return self.fields[full]

    def get(self, key: str, default):
        return self.fields.get(f"{self.arch}.{key}", default)


def load_spec(path: str | os.PathLike) -> ModelSpec:
    """ModelSpec of a GGUF file (no weights read)."""
    g = read_gguf(path)
    p, fields = g.path, g.fields
    arch_name = fields.get("general.architecture")
    if arch_name is None:
        raise UserError(f"{p}: no general.architecture in metadata; not a model file")
    traits = arch_traits(arch_name)
    m = _Meta(fields, arch_name, p)

    tensors = []
    for t in g.tensors:
        q = qtype(t.ggml_type)  # refuses unsupported types
        shape = tuple(int(d) for d in reversed(t.ne))
        nbytes = tensor_nbytes(shape, q.ggml)
        if t.offset + nbytes > g.file_nbytes:
            raise UserError(
                f"{p}: tensor {t.name} ends at byte {t.offset + nbytes} but the file has "
                f"{g.file_nbytes} bytes; the file is truncated — download it again"
            )
        mt = _BLK.match(t.name)
        tensors.append(TensorInfo(
            name=t.name, shape=shape, qtype=q.ggml, nbytes=nbytes,
            layer=int(mt.group(1)) if mt else None, role=tensor_role(t.name), offset=t.offset,
        ))

    n_embd = int(m.need("embedding_length"))
    n_head = int(m.need("attention.head_count"))
    head_dim = int(m.get("attention.key_length", n_embd // n_head))
    n_layer = int(m.need("block_count"))
    embd = next((t for t in tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise UserError(f"{p}: no token_embd.weight tensor; not a supported model file")
    scaling = m.get("rope.scaling.type", "none")
    factor = float(m.get("rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0
    n_swa = int(m.get("attention.sliding_window", 0)) if traits.swa_pattern else 0
    pattern = m.get("attention.sliding_window_pattern", None)
    if n_swa == 0:
        swa = ()
    elif isinstance(pattern, np.ndarray):
        swa = tuple(bool(b) for b in pattern)
    else:
        swa = swa_layers(traits, n_layer, int(pattern) if pattern is not None else None)
    hp = HParams(
        n_vocab=int(embd.shape[0]),
        n_ctx_train=int(m.need("context_length")),
        n_embd=n_embd,
        n_layer=n_layer,
        n_ff=int(m.get("feed_forward_length", 0)),
        n_head=n_head,
        n_head_kv=int(m.get("attention.head_count_kv", n_head)),
        head_dim=head_dim,
        head_dim_v=int(m.get("attention.value_length", head_dim)),
        n_rot=int(m.get("rope.dimension_count", head_dim)),
        rope_base=float(m.get("rope.freq_base", 10000.0)),
        rope_base_swa=float(m.get("rope.freq_base_swa", traits.rope_base_swa)),
        rope_scale=1.0 / factor,
        rms_eps=float(m.need("attention.layer_norm_rms_epsilon")),
        n_swa=n_swa,
        swa_layers=swa,
        n_expert=int(m.get("expert_count", 0)),
        n_expert_used=int(m.get("expert_used_count", 0)),
        n_ff_exp=int(m.get("expert_feed_forward_length", 0)),
    )
    if traits.moe and not (hp.n_expert and hp.n_expert_used):
        raise UserError(f"{p}: MoE architecture without expert_count/expert_used_count metadata")
    if traits.moe and not hp.n_ff_exp:  # llama.cpp's fallback when the key is absent
        hp = replace(hp, n_ff_exp=hp.n_ff // hp.n_expert_used)
    st = p.stat()
    return ModelSpec(
        arch=traits, hparams=hp, tensors=tuple(tensors), path=p.resolve(),
        file_nbytes=st.st_size, file_mtime_ns=st.st_mtime_ns,
        name=str(fields.get("general.name", p.stem)),
        file_type=str(fields.get("general.file_type", "")),
        metadata={k: v for k, v in fields.items() if not isinstance(v, (list, np.ndarray))},
    )


def with_hparams(spec: ModelSpec, **changes) -> ModelSpec:
    return replace(spec, hparams=replace(spec.hparams, **changes))
