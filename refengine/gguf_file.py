"""A fast GGUF header reader: metadata and the tensor directory (weights are not read).

gguf-py's `GGUFReader` builds one numpy view per element of every string array, which takes
28 s for Gemma-3's 262,144-token vocabulary on the development machine; this walks the same
format (little-endian GGUF v2/v3) in a fraction of a second. Its output is checked against
gguf-py's on synthetic files of every architecture (tests/test_spec.py). Every way a file can be
broken is one `UserError`.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import UserError

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (scalars) or numpy dtype (arrays of scalars)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_DTYPES = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ne: tuple[int, ...]  # ggml order: ne[0] is the contiguous dimension
    ggml_type: int
    offset: int  # absolute byte offset in the file


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    fields: dict  # key -> int | float | bool | str | list[str] | np.ndarray
    tensors: tuple[GGUFTensor, ...]
    data_offset: int  # bytes from the file's start to the first tensor
    file_nbytes: int


class _Cursor:
    def __init__(self, buf, path: Path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.buf):
            raise UserError(
                f"{self.path}: file ends at byte {len(self.buf)} while reading the header "
                f"(needed {end}); the file is truncated — download it again"
            )
        view = memoryview(self.buf)[self.pos : end]
        self.pos = end
        return view

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _DTYPES:
                dt = np.dtype(_DTYPES[etype])
                return np.frombuffer(self.take(count * dt.itemsize), dtype=dt).copy()
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            return [self.value(etype) for _ in range(count)]
        raise UserError(
            f"{self.path}: unknown metadata value type {vtype} at byte {self.pos}; "
            "the file is corrupt or from a newer GGUF version"
        )


def read_gguf(path: str | Path) -> GGUFFile:
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: no such model file")
    with open(p, "rb") as f:
        size = p.stat().st_size
        if size < 24:
            raise UserError(f"{p}: {size} bytes is too short for a GGUF file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        c = _Cursor(buf, p)
        if bytes(c.take(4)) != MAGIC:
            raise UserError(f"{p}: not a GGUF file (bad magic); pass a .gguf model")
        version = c.scalar("<I")
        if version not in (2, 3):
            raise UserError(f"{p}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_kv = c.scalar("<Q"), c.scalar("<Q")
        fields = {}
        for _ in range(n_kv):
            key = c.string()
            fields[key] = c.value(c.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = c.string()
            n_dims = c.scalar("<I")
            ne = tuple(c.scalar("<Q") for _ in range(n_dims))
            infos.append((name, ne, c.scalar("<I"), c.scalar("<Q")))
        align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise UserError(
                f"{p}: general.alignment {align!r} is not a power of two; the file is corrupt"
            )
        data_offset = -(-c.pos // align) * align
    finally:
        del c
        buf.close()
    tensors = tuple(GGUFTensor(n, ne, t, data_offset + off) for n, ne, t, off in infos)
    return GGUFFile(p, version, fields, tensors, data_offset, size)
