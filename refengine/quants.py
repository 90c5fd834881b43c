"""The quant-type table: the single source of GGUF block geometry for the whole project.

The solver's byte counts, the kernels' strides and the transfer sizes all read `QTYPES`; the
reference dequantizes through `gguf.quants` (never hand-rolled). Block sizes come from gguf-py's
`GGML_QUANT_SIZES`, so they match the file format by construction. Types outside `QTYPES` are
refused with a `UserError` when a model is opened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from .errors import UserError

Q = GGMLQuantizationType


@dataclass(frozen=True)
class QType:
    """Geometry of one ggml type: `block_elems` values are stored in `block_nbytes` bytes."""

    ggml: GGMLQuantizationType
    block_elems: int
    block_nbytes: int

    @property
    def name(self) -> str:
        return self.ggml.name

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_nbytes / self.block_elems

    def row_nbytes(self, n_elems: int) -> int:
        """Bytes of one row of `n_elems` values (rows are whole blocks in GGUF)."""
        if n_elems % self.block_elems:
            raise UserError(
                f"a row of {n_elems} values is not a whole number of {self.name} blocks "
                f"({self.block_elems} values each)"
            )
        return n_elems // self.block_elems * self.block_nbytes


# The types the reference engine and the kernels support, in the order the issue lists them.
SUPPORTED = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)

QTYPES: dict[GGMLQuantizationType, QType] = {t: QType(t, *GGML_QUANT_SIZES[t]) for t in SUPPORTED}


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
