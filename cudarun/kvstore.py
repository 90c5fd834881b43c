"""The KV cache of the runtime: fp16 keys and values, in host memory by position for every layer,
and on the device (an arena region or a ring slot) as a ring of cells.

- The host mirror holds every layer's K and V at their positions. It is the cache of a layer whose
  KV is on the CPU, the source of a streamed layer's copy, and what a tier switch lays the device
  regions out from; a layer whose KV is on the device writes its new rows through to it.
- A device KV buffer of `cells` cells holds position p in cell p % cells: K of all cells, then V.
  A sliding-window layer has fewer cells than the context (solver.memory.kv_cells), and a ring of
  n_swa + n_ubatch cells keeps every key a query of the ubatch can see.
"""

from __future__ import annotations

import numpy as np

from refengine.spec import ModelSpec

EMPTY = 1 << 40  # the position of a cell never written: after every query, so always masked


class KVMirror:
    def __init__(self, spec: ModelSpec, n_ctx: int, alloc=None):
        hp = spec.hparams
        self.k_shape, self.v_shape = (hp.n_head_kv, hp.head_dim), (hp.n_head_kv, hp.head_dim_v)
        per_layer = n_ctx * (np.prod(self.k_shape) + np.prod(self.v_shape))
        # one allocation (pinned on a GPU), carved per layer
        self.buffer = (alloc or (lambda n: np.empty(n, np.uint8)))(int(2 * per_layer * hp.n_layer))
        flat = self.buffer.view(np.float16).reshape(hp.n_layer, -1)
        k_n = n_ctx * int(np.prod(self.k_shape))
        self.k = [flat[il, :k_n].reshape(n_ctx, *self.k_shape) for il in range(hp.n_layer)]
        self.v = [flat[il, k_n:].reshape(n_ctx, *self.v_shape) for il in range(hp.n_layer)]

    def write(self, il: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        self.k[il][start : start + k.shape[0]] = k
        self.v[il][start : start + v.shape[0]] = v


def ring_views(buf: np.ndarray, cells: int, k_shape, v_shape) -> tuple[np.ndarray, np.ndarray]:
    """K [cells, Hkv, D] and V [cells, Hkv, Dv] fp16 views of a device KV buffer (uint8)."""
    k_n = cells * int(np.prod(k_shape))
    f16 = buf[: 2 * (k_n + cells * int(np.prod(v_shape)))].view(np.float16)
    return f16[:k_n].reshape(cells, *k_shape), f16[k_n:].reshape(cells, *v_shape)


def ring_positions(cells: int, end: int) -> np.ndarray:
    """[cells] int64: the position each cell holds once positions < end are written (EMPTY for a
    cell never written)."""
    c = np.arange(cells, dtype=np.int64)
    held = c + cells * ((end - 1 - c) // cells)
    return np.where(c < end, held, EMPTY)


def ring_chunks(cells: int, start: int, end: int) -> list[tuple[int, int, int]]:
    """(first position, first cell, count) runs that lay positions [start, end) into the ring; at
    most the last `cells` positions are kept."""
    start = max(start, end - cells)
    out = []
    p = start
    while p < end:
        cell = p % cells
        n = min(end - p, cells - cell)
        out.append((p, cell, n))
        p += n
    return out


def fill_ring(mirror: KVMirror, il: int, buf: np.ndarray, cells: int, end: int) -> None:
    """Lay the mirror's positions [0, end) of layer il into a device KV buffer (host-side copy)."""
    k, v = ring_views(buf, cells, mirror.k_shape, mirror.v_shape)
    for p, cell, n in ring_chunks(cells, 0, end):
        k[cell : cell + n] = mirror.k[il][p : p + n]
        v[cell : cell + n] = mirror.v[il][p : p + n]
