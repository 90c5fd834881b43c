"""Where the reference engine's weights come from: the GGUF file, memory-mapped.

`GGUFWeights.raw(name)` is a tensor's quantized bytes straight from the file (rows last, as
`(*rows, row_nbytes)` uint8); `dense(name)` is its float32 value, dequantized once through
gguf-py and cached, because dequantizing per token would cost seconds (docs/toolchain.md).
"""

from __future__ import annotations

import numpy as np

from .quants import dequantize, qtype
from .reference import get_rows
from .spec import ModelSpec


class GGUFWeights:
    def __init__(self, spec: ModelSpec):
        if spec.path is None:
            raise ValueError("a spec-only model has no weights")
        self.spec = spec
        self._map = np.memmap(spec.path, dtype=np.uint8, mode="r")
        self._dense: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self.spec.by_name

    def raw(self, name: str) -> np.ndarray:
        t = self.spec.by_name[name]
        row_nbytes = qtype(t.qtype).row_nbytes(t.shape[-1])
        flat = self._map[t.offset : t.offset + t.nbytes]
        return flat.reshape(*t.shape[:-1], row_nbytes)

    def dense(self, name: str) -> np.ndarray:
        if name not in self._dense:
            t = self.spec.by_name[name]
            self._dense[name] = np.ascontiguousarray(dequantize(self.raw(name), t.qtype, t.shape))
        return self._dense[name]

    def rows(self, name: str, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` of a 2-D tensor as float32, without dequantizing the whole table."""
        if name in self._dense:
            return self._dense[name][ids]
        t = self.spec.by_name[name]
        return get_rows(self.raw(name), t.qtype, t.shape, ids)
