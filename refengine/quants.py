"""The quant-type table: the single source of GGUF block geometry for the whole project.

One row per type: values and bytes per block, the block's fields in order (ggml-common.h), which
engines support the type, which sides a profile measures it on, and whether gguf-py can quantize
it. The solver's byte counts, the kernels' strides and field offsets, the synthetic writer and the
supported-type lists all read `QTYPES`; the CUDA, CPU and synthetic code only map a type to its
decoder. The reference dequantizes through `gguf.quants` (never hand-rolled). Block sizes come
from gguf-py's `GGML_QUANT_SIZES`, and each row's fields must add up to them. Types outside
`QTYPES` are refused with a `UserError` when a model is opened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .errors import UserError

Q = GGMLQuantizationType

# the engines (and the planner, which needs a type's bytes only)
PLANNER, NUMPY, CPU, CUDA = "planner", "numpy", "cpu", "cuda"
EVERY_ENGINE = frozenset({PLANNER, NUMPY, CPU, CUDA})
# the sides a profile measures a type's rates on (others are priced at a measured type's)
HOST, GPU = "host", "gpu"


@dataclass(frozen=True)
class QType:
    """Geometry of one ggml type: `block_elems` values are stored in `block_nbytes` bytes, laid out
    as `fields` ((name, bytes) in order; d, m and dmin are fp16 scales and minimums)."""

    ggml: GGMLQuantizationType
    block_elems: int
    block_nbytes: int
    fields: tuple[tuple[str, int], ...]
    engines: frozenset[str] = EVERY_ENGINE
    measured: frozenset[str] = frozenset()
    quantizable: bool = True  # by gguf-py; the K-quants are dequantize-only

    @property
    def name(self) -> str:
        return self.ggml.name

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_nbytes / self.block_elems

    def offset(self, field: str) -> int:
        """Byte offset of `field` in a block (KeyError for a field the type does not have)."""
        at = 0
        for name, nbytes in self.fields:
            if name == field:
                return at
            at += nbytes
        raise KeyError(f"{self.name} blocks have no field {field!r}")

    def has(self, field: str) -> bool:
        return any(name == field for name, _ in self.fields)

    @property
    def scale_offsets(self) -> tuple[int, ...]:
        """Offsets of the block's fp16 scale and minimum fields."""
        return tuple(self.offset(f) for f in ("d", "m", "dmin") if self.has(f))

    def row_nbytes(self, n_elems: int) -> int:
        """Bytes of one row of `n_elems` values (rows are whole blocks in GGUF)."""
        if n_elems % self.block_elems:
            raise UserError(
                f"a row of {n_elems} values is not a whole number of {self.name} blocks "
                f"({self.block_elems} values each)"
            )
        return n_elems // self.block_elems * self.block_nbytes


def _row(t: GGMLQuantizationType, *fields: tuple[str, int], measured=(), quantizable=True,
         engines=EVERY_ENGINE) -> QType:  # fmt: skip
    elems, nbytes = GGML_QUANT_SIZES[t]
    if sum(n for _, n in fields) != nbytes:
        raise AssertionError(f"{t.name}'s fields do not add up to its {nbytes}-byte block")
    return QType(t, elems, nbytes, fields, frozenset(engines), frozenset(measured), quantizable)


BOTH = (HOST, GPU)
PLANNED = (PLANNER, NUMPY)
# the types, in the order the tables list them, and the engines that compute each
QTYPES: dict[GGMLQuantizationType, QType] = {q.ggml: q for q in (
    _row(Q.F32, ("value", 4)),
    _row(Q.F16, ("value", 2), measured=BOTH),
    _row(Q.BF16, ("value", 2)),
    _row(Q.Q8_0, ("d", 2), ("qs", 32), measured=BOTH),
    _row(Q.Q4_0, ("d", 2), ("qs", 16), measured=BOTH),
    _row(Q.Q4_1, ("d", 2), ("m", 2), ("qs", 16), measured=BOTH),
    _row(Q.Q5_0, ("d", 2), ("qh", 4), ("qs", 16), measured=BOTH),
    _row(Q.Q5_1, ("d", 2), ("m", 2), ("qh", 4), ("qs", 16)),
    _row(Q.Q4_K, ("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128), measured=BOTH,
         quantizable=False),
    _row(Q.Q5_K, ("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128),
         measured=(GPU,), quantizable=False),
    _row(Q.Q6_K, ("ql", 128), ("qh", 64), ("scales", 16), ("d", 2), measured=BOTH,
         quantizable=False),
    # offload quants (gpt-oss's experts are MXFP4): planned, priced at a measured type's rates,
    # and run by the reference alone (gguf-py dequantizes them); llama.cpp computes them
    _row(Q.Q2_K, ("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2), quantizable=False,
         engines=PLANNED),
    _row(Q.Q3_K, ("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2), quantizable=False,
         engines=PLANNED),
    _row(Q.IQ4_NL, ("d", 2), ("qs", 16), quantizable=False, engines=PLANNED),
    _row(Q.IQ4_XS, ("d", 2), ("scales_h", 2), ("scales_l", 4), ("qs", 128), quantizable=False,
         engines=PLANNED),
    _row(Q.MXFP4, ("e", 1), ("qs", 16), engines=PLANNED),
)}  # fmt: skip
SUPPORTED = tuple(QTYPES)


def supported(engine: str) -> tuple[QType, ...]:
    """The types `engine` (PLANNER, NUMPY, CPU or CUDA) supports, in the table's order."""
    return tuple(q for q in QTYPES.values() if engine in q.engines)


# the kernels each engine computes with: the stand-in runs a plan's device parts on the reference
# and its host parts on the cpu kernels, the cuda engine its host parts on the cpu kernels
ENGINE_KERNELS = {"numpy": (NUMPY,), "cpu": (CPU,), "standin": (NUMPY, CPU), "cuda": (CUDA, CPU)}


def require(qtypes, engine: str) -> None:
    """One line when some of `qtypes` is a type the kernels of `engine` (an engine's name) lack."""
    for kernels in ENGINE_KERNELS[engine]:
        missing = sorted({QTYPES[t].name for t in qtypes} - {q.name for q in supported(kernels)})
        if missing:
            raise UserError(f"the {engine} engine cannot compute {', '.join(missing)} tensors yet "
                            f"(its {kernels} kernels lack them); `refengine solve` and `export` "
                            "still plan the model for llama.cpp")  # fmt: skip


def measured_on(side: str) -> tuple[str, ...]:
    """The names of the types a profile measures on `side` (HOST or GPU)."""
    return tuple(q.name for q in QTYPES.values() if side in q.measured)


def qtype(t: GGMLQuantizationType | int | str) -> QType:
    """Look up a supported type by enum, integer id or name ("Q4_K"); UserError otherwise."""
    try:
        if isinstance(t, str):
            key = Q[t.upper()]
        else:
            key = Q(int(t))
    except (KeyError, ValueError):
        raise UserError(f"unknown ggml tensor type {t!r}") from None
    if key not in QTYPES:
        names = ", ".join(q.name for q in SUPPORTED)
        raise UserError(f"tensor type {key.name} is not supported (supported: {names})")
    return QTYPES[key]


def tensor_nbytes(shape: tuple[int, ...], t: GGMLQuantizationType) -> int:
    """Bytes of a tensor of numpy `shape` (rows last dim) stored as type `t`."""
    q = qtype(t)
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    return rows * q.row_nbytes(int(shape[-1]))


def dequantize(raw: np.ndarray, t: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of numpy `shape` from the raw bytes (or typed array) of a GGUF tensor."""
    q = qtype(t)
    if q.ggml == Q.F32:
        out = np.asarray(raw).view(np.float32)
    elif q.ggml == Q.F16:
        out = np.asarray(raw).view(np.float16).astype(np.float32)
    else:
        out = quants.dequantize(np.asarray(raw).view(np.uint8), q.ggml).astype(
            np.float32, copy=False
        )
    return out.reshape(shape)


def quantize(values: np.ndarray, t: GGMLQuantizationType) -> np.ndarray:
    """Raw bytes (uint8, rows last) of `values` in type `t`, via gguf-py where it can quantize.

    gguf-py cannot quantize the K-quants; `synthetic.random_kquant_blocks` makes valid blocks for
    those instead (docs/toolchain.md).
    """
    q = qtype(t)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if q.ggml == Q.F32:
        return values.view(np.uint8).reshape(*values.shape[:-1], -1)
    if q.ggml == Q.F16:
        return values.astype(np.float16).view(np.uint8).reshape(*values.shape[:-1], -1)
    return quants.quantize(values, q.ggml)
