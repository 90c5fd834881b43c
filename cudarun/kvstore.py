"""The KV cache of the runtime: fp16 keys and values, in host memory for every layer, and on the
device (an arena region or a ring slot) for the layers a tier keeps or streams there.

- The host mirror (`KVMirror`) holds every layer's K and V in its cells (`KVCells`: per-sequence
  streams, or one unified pool; a single sequence's cell is its position). It is the cache of a
  layer whose KV is on the CPU, the source of a streamed layer's copy, and what a tier switch lays
  the device buffers out from; a layer whose KV is on the device writes its new rows through.
- On the device, a full-context layer's buffer holds host cell c in cell c. A sliding-window
  layer's holds fewer cells (solver.memory.kv_cells: n_swa per user and a ubatch), shared out by
  a `SwaPool` to the keys some query can still see.
- Device attention masks with one key per cell (`DeviceCells`): the sequence and the position in
  one integer, so a kernel's causal and window tests also keep each sequence to its own cells.
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

    def views(self, buf, cells: int, heads: tuple[int, int] | None = None):
        """K and V views of a device KV buffer of `cells` cells (`kv_views`) holding every KV
        head, or only KV `heads` [lo, hi) (a tensor split's device)."""
        if heads is None:
            return kv_views(buf, cells, self.k_shape, self.v_shape)
        n = heads[1] - heads[0]
        return kv_views(buf, cells, (n, *self.k_shape[1:]), (n, *self.v_shape[1:]))


def kv_views(buf: np.ndarray, cells: int, k_shape, v_shape) -> tuple[np.ndarray, np.ndarray]:
    """K [cells, Hkv, D] and V [cells, Hkv, Dv] fp16 views of a device KV buffer (uint8)."""
    k_n = cells * int(np.prod(k_shape))
    f16 = buf[: 2 * (k_n + cells * int(np.prod(v_shape)))].view(np.float16)
    return f16[:k_n].reshape(cells, *k_shape), f16[k_n:].reshape(cells, *v_shape)


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
    masked by sequence — the cross-sequence work llama.cpp #14363 removes."""

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


# A device key: sequence * SEQ_STRIDE + position. Against a query's key, another sequence's cell is
# in the future (masked as causal) or SEQ_WINDOW or more in the past, the window a full-context
# layer's kernel is given; a sliding window is far narrower.
SEQ_STRIDE = 1 << 32
SEQ_WINDOW = 1 << 31


def device_keys(cell_seq: np.ndarray, cell_pos: np.ndarray) -> np.ndarray:
    return np.where(cell_seq >= 0, cell_seq * SEQ_STRIDE + cell_pos, EMPTY)


class SwaPool:
    """The device cells of a tier's sliding-window layers, each holding one host cell (`host`,
    -1 for none). A ubatch's new keys take the cells no query will read again: a removed
    sequence's, one the host cache gives a new token, or one the window has passed — a sequence
    whose next query is at position n reads keys from n - n_swa + 1 on. That leaves each sequence
    at most n_swa - 1 cells besides the ubatch's, which is what the memory model reserves."""

    def __init__(self, n_cells: int, kv: KVCells):
        self.kv = kv
        self.host = np.full(n_cells, -1, np.int64)
        self.refill()

    def _readable(self, cells: np.ndarray) -> np.ndarray:
        """Which host cells (>= 0) a query may still read: held, and inside the window of their
        sequence's next query."""
        kv = self.kv
        next_pos = np.zeros(kv.seqs.n_seq, np.int64)
        for s, n in kv.seqs.n_past.items():
            next_pos[s] = n
        seq = kv.cell_seq[cells]
        return (seq >= 0) & (kv.cell_pos[cells] > next_pos[np.maximum(seq, 0)] - kv.n_swa)

    def refill(self) -> None:
        """Take every host cell a query may still read, from cell 0 (a tier's new pool)."""
        live = np.flatnonzero(self.kv.cell_seq >= 0)
        live = live[self._readable(live)]
        if live.size > self.host.size:  # the memory model reserves enough: a bug
            raise AssertionError(f"{live.size} live sliding-window keys in {self.host.size} cells")
        self.host[:] = -1
        self.host[: live.size] = live

    def place(self, write: np.ndarray) -> np.ndarray:
        """Device cells for a ubatch's tokens, which the host cache put in cells `write`."""
        h = self.host
        alive = (h >= 0) & ~np.isin(h, write) & self._readable(np.maximum(h, 0))
        free = np.flatnonzero(~alive)
        if free.size < write.size:  # the memory model reserves enough: a bug, not a user's error
            raise AssertionError(f"{write.size} new keys, {free.size} free sliding-window cells")
        self.host[~alive] = -1
        cells = free[: write.size]
        self.host[cells] = write
        return cells

    def keys(self) -> np.ndarray:
        h = self.host
        return np.where(h >= 0, device_keys(self.kv.cell_seq[h], self.kv.cell_pos[h]), EMPTY)

    @property
    def n_used(self) -> int:
        held = np.flatnonzero(self.host >= 0)
        return int(held[-1]) + 1 if held.size else 0


@dataclass(frozen=True)
class DeviceCells:
    """One ubatch on the device: where its tokens write their K and V, the key each device cell
    holds after, and the tokens' own keys (`device_keys`); full-context layers, then the
    sliding-window pool (`SwaPool`)."""

    q_keys: np.ndarray  # [T]
    write: np.ndarray  # [T] full-context cells (the host cells)
    keys: np.ndarray  # [full cells in use]
    write_swa: np.ndarray  # [T]
    keys_swa: np.ndarray  # [pool cells in use]


def device_cells(kv: KVCells, cmap: CellMap, pool: SwaPool | None) -> DeviceCells:
    """After `kv.place` put the ubatch in `cmap`; `pool` places it on the tier's pool."""
    keys = device_keys(kv.cell_seq[: kv.n_used], kv.cell_pos[: kv.n_used])
    q_keys = device_keys(cmap.seq, kv.cell_pos[cmap.write])
    if pool is None:
        empty = np.zeros(0, np.int64)
        return DeviceCells(q_keys, cmap.write, keys, empty, empty)
    write_swa = pool.place(cmap.write)
    return DeviceCells(q_keys, cmap.write, keys, write_swa, pool.keys()[: pool.n_used])


def host_runs(cells: np.ndarray) -> list[tuple[int, int, int]]:
    """(first index, first cell, count) runs of consecutive cells: the copies that move rows
    between the host cache and a device buffer laid out alike."""
    if cells.size == 0:
        return []
    cuts = np.flatnonzero(np.diff(cells) != 1) + 1
    starts = np.concatenate([[0], cuts])
    ends = np.concatenate([cuts, [cells.size]])
    return [(int(a), int(cells[a]), int(b - a)) for a, b in zip(starts, ends)]
