"""The KV cache of the runtime: fp16 keys and values, in host memory by position for every layer,
and on the device (an arena region or a ring slot) as a ring of cells.

- The host mirror holds every layer's K and V at their positions. It is the cache of a layer whose
  KV is on the CPU, the source of a streamed layer's copy, and what a tier switch lays the device
  regions out from; a layer whose KV is on the device writes its new rows through to it.
- A device KV buffer of `cells` cells holds position p in cell p % cells: K of all cells, then V.
  A sliding-window layer has fewer cells than the context (solver.memory.kv_cells), and a ring of
  n_swa + n_ubatch cells keeps every key a query of the ubatch can see.
- With several sequences (`KVCells`), the host cache's rows are cells: a per-sequence stream of
  each sequence's positions, or one unified pool; a single sequence's cell is its position.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class CellMap:
    """Where one ubatch's tokens write their K/V in the host cache and which cells each reads:
    token t writes cell `write[t]` and attends over cells [lo[t], hi[t]) (`lo_swa` on a
    sliding-window layer), masked to the cells of its own sequence at positions up to its own
    (`cell_seq`, `cell_pos`: the tables after this ubatch's writes)."""

    write: np.ndarray  # [T] int64
    lo: np.ndarray  # [T] int64
    lo_swa: np.ndarray  # [T] int64
    hi: np.ndarray  # [T] int64
    seq: np.ndarray  # [T] int64
    segments: tuple[tuple[int, int, int], ...]  # (seq, first token, count)
    cell_pos: np.ndarray  # [n_cells] int64
    cell_seq: np.ndarray  # [n_cells] int64

    def key_positions(self, seq: int, lo: int, hi: int) -> np.ndarray:
        """The positions of cells [lo, hi) as sequence `seq` sees them: another sequence's cell,
        or one never written, is EMPTY (always masked)."""
        return np.where(self.cell_seq[lo:hi] == seq, self.cell_pos[lo:hi], EMPTY)


class KVCells:
    """The cells of the host KV cache (`KVMirror`'s rows) for the engine's sequences
    (`refengine.sequences.Sequences`). Per-sequence streams: sequence s holds position p in cell
    s * n_ctx_seq + p and reads only its own stream. Unified (llama.cpp's -kvu): each new token
    takes the lowest free cell, and every token scans all cells up to the highest one in use,
    masked by sequence — the cross-sequence work seed 003 removes."""

    def __init__(self, seqs, n_swa: int = 0):
        self.seqs, self.n_swa = seqs, n_swa
        self.cell_pos = np.full(seqs.n_ctx, EMPTY, np.int64)
        self.cell_seq = np.full(seqs.n_ctx, -1, np.int64)
        self.reset()

    def reset(self) -> None:
        self.cell_pos[:] = EMPTY
        self.cell_seq[:] = -1
        self.n_used = 0  # one past the highest cell in use

    def free(self, seq: int) -> None:
        mine = self.cell_seq == seq
        self.cell_pos[mine], self.cell_seq[mine] = EMPTY, -1
        used = np.flatnonzero(self.cell_seq >= 0)
        self.n_used = int(used[-1]) + 1 if used.size else 0

    def place(self, ub) -> CellMap:
        """Cells for a ubatch's tokens (`refengine.sequences.Ubatch`), written into the tables."""
        if self.seqs.unified:
            write = np.flatnonzero(self.cell_seq < 0)[: ub.size]
        else:
            write = ub.seq * self.seqs.n_ctx_seq + ub.pos
        self.cell_pos[write], self.cell_seq[write] = ub.pos, ub.seq
        self.n_used = max(self.n_used, int(write.max()) + 1)
        if self.seqs.unified:
            lo = lo_swa = np.zeros(ub.size, np.int64)
            hi = np.full(ub.size, self.n_used, np.int64)
        else:
            lo = ub.seq * self.seqs.n_ctx_seq
            hi = write + 1
            lo_swa = np.maximum(lo, hi - self.n_swa) if self.n_swa else lo
        return CellMap(write, lo, lo_swa, hi, ub.seq, ub.segments, self.cell_pos, self.cell_seq)
