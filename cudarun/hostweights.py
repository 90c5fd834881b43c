"""Weight groups as contiguous bytes: the layout a group has in a ring slot, an arena region and
pinned host memory, and the host copy loaded from the memory-mapped GGUF.

Inside a group the float tensors (norm weights, biases) come first, so every one of them starts on
a 4-byte boundary whatever the quantized blocks after them measure; then the types whose blocks
measure a multiple of 4 bytes, which the int8 decode kernels read as 32-bit words (Q4_1, Q5_1,
Q4_K, Q5_K: `kernels.int8`), so they start on one too; the group takes exactly its tensors' bytes
(the solver's region and slot sizes), with no padding.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T


from refengine.quants import dequantize, qtype
from refengine.spec import ModelSpec, TensorInfo
from solver.groups import Group, tensor_groups

FLOATS = (T.F32, T.F16, T.BF16)


@dataclass(frozen=True)
class Placed:
    info: TensorInfo
    offset: int  # bytes from the group's start


def _order(t: TensorInfo) -> int:
    """Float tensors first, then those whose every block is a multiple of 4 bytes, then the
    rest (blocks of 2-byte multiples: Q8_0, Q4_0, Q5_0, Q6_K)."""
    if t.qtype in FLOATS:
        return 0
    return 1 if t.nbytes % 4 == 0 and GGML_QUANT_SIZES[t.qtype][1] % 4 == 0 else 2


def group_layout(spec: ModelSpec, group: Group) -> list[Placed]:
    infos = [spec.by_name[n] for n in group.tensors]
    infos.sort(key=_order)  # stable
    out, offset = [], 0
    for t in infos:
        out.append(Placed(t, offset))
        offset += t.nbytes
    assert offset == group.nbytes
    return out


def tensors_of(layout: list[Placed], buf: np.ndarray) -> dict[str, np.ndarray]:
    """The tensors of a group held in `buf` (uint8): F32 as float32 arrays of their shape, the
    others as raw block rows [..., row bytes]."""
    out = {}
    for p in layout:
        t = p.info
        raw = buf[p.offset : p.offset + t.nbytes]
        if t.qtype == T.F32:
            out[t.name] = raw.view(np.float32).reshape(t.shape)
        else:
            out[t.name] = raw.reshape(*t.shape[:-1], qtype(t.qtype).row_nbytes(t.shape[-1]))
    return out


def expert_runs(experts: list[int]) -> list[tuple[int, int]]:
    """(first, count) of each run of consecutive experts: one copy each."""
    runs: list[tuple[int, int]] = []
    for e in experts:
        if runs and runs[-1][0] + runs[-1][1] == e:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


def routed_ranges(layout: list[Placed], experts: list[int]) -> list[tuple[int, int]]:
    """(offset in the group, bytes) of each piece of a routed copy (routed streaming), in the
    order it packs them: the group's tensors in their layout, of its expert stack (the 3-D
    tensor) only the runs of `experts`."""
    out = []
    for p in layout:
        t = p.info
        if len(t.shape) != 3:
            out.append((p.offset, t.nbytes))
            continue
        per = t.nbytes // t.shape[0]
        out += [(p.offset + first * per, count * per) for first, count in expert_runs(experts)]
    return out


def routed_pack(layout: list[Placed], buf: np.ndarray, experts: list[int]) -> np.ndarray:
    """A routed copy's bytes, from the group's bytes `buf` (`routed_ranges`)."""
    pieces = [buf[lo : lo + n] for lo, n in routed_ranges(layout, experts)]
    return np.concatenate(pieces) if pieces else np.empty(0, np.uint8)


def cache_stacks(layout: list[Placed], slots: int) -> list[tuple[Placed, int, int]]:
    """Each expert stack of a group with its range in the group's expert cache of `slots`
    experts, (stack, offset, bytes): the cache holds each stack's `slots` slices in turn."""
    out, at = [], 0
    for p in layout:
        if len(p.info.shape) == 3:
            nbytes = p.info.nbytes // p.info.shape[0] * slots
            out.append((p, at, nbytes))
            at += nbytes
    return out


def cache_ranges(layout: list[Placed], slots: int, expert: int, slot: int):
    """(offset in the group, offset in its expert cache, bytes) of expert `expert`'s slice of
    each stack of the group, held in cache slot `slot`."""
    out = []
    for p, at, _ in cache_stacks(layout, slots):
        per = p.info.nbytes // p.info.shape[0]
        out.append((p.offset + expert * per, at + slot * per, per))
    return out


def _stack_rows(t: TensorInfo, buf: np.ndarray, count: int) -> np.ndarray:
    return buf[: t.nbytes // t.shape[0] * count].reshape(
        count, *t.shape[1:-1], qtype(t.qtype).row_nbytes(t.shape[-1])
    )


class RoutedStack:
    """An expert stack of which a routed copy and an expert cache hold some experts: stack[e]
    is expert e's block rows; an expert neither holds is a KeyError."""

    def __init__(self, rows: dict[int, np.ndarray]):
        self.rows = rows

    def __getitem__(self, e) -> np.ndarray:
        return self.rows[int(e)]


def routed_tensors_of(layout: list[Placed], buf: np.ndarray, experts: list[int],
                      cache: np.ndarray | None = None, resident=None) -> dict:  # fmt: skip
    """The tensors of a routed copy in `buf` (`routed_pack` of `experts`): as `tensors_of`, each
    stack a `RoutedStack`, which finds the `resident` experts (expert -> slot) in `cache`."""
    out, offset = {}, 0
    resident = resident or {}
    stacks = cache_stacks(layout, 1)
    slots = 0 if cache is None else cache.size // sum(n for _, _, n in stacks)
    held = {p.info.name: cache[at:] for p, at, _ in cache_stacks(layout, slots)} if resident else {}
    for p in layout:
        t = p.info
        if len(t.shape) == 3:
            nbytes = t.nbytes // t.shape[0] * len(experts)
            rows = dict(zip(experts, _stack_rows(t, buf[offset:], len(experts))))
            if resident:
                cached = _stack_rows(t, held[t.name], slots)
                rows.update({e: cached[slot] for e, slot in resident.items()})
            out[t.name] = RoutedStack(rows)
        else:
            nbytes = t.nbytes
            out.update(tensors_of([Placed(t, 0)], buf[offset : offset + nbytes]))
        offset += nbytes
    return out


def dense(info: TensorInfo, raw: np.ndarray) -> np.ndarray:
    """A small tensor (norm weight, bias) as float32, whatever its type."""
    if info.qtype == T.F32:
        return raw
    return dequantize(raw, info.qtype, info.shape)


class HostWeights:
    """The groups a plan ever needs from the host — streamed, computed on the CPU, or pinned in
    some tiers only (uploaded at a switch) — in host memory from `alloc(nbytes)` (pinned memory on
    a GPU), each group contiguous in its layout, loaded from the memory-mapped GGUF."""

    def __init__(self, spec: ModelSpec, names: set[str], alloc=None, progress: bool = False):
        self.spec = spec
        self.layouts = {g.name: group_layout(spec, g) for g in tensor_groups(spec)}
        groups = [g for g in tensor_groups(spec) if g.name in names]
        self.offsets, total = {}, 0
        for g in groups:
            self.offsets[g.name] = (total, g.nbytes)
            total += g.nbytes
        self.nbytes = total
        self.buffer = (alloc or (lambda n: np.empty(n, np.uint8)))(max(total, 1))
        source = np.memmap(spec.path, dtype=np.uint8, mode="r")
        for g in _progress(groups, total, progress):
            start = self.offsets[g.name][0]
            for p in self.layouts[g.name]:
                t = p.info
                self.buffer[start + p.offset : start + p.offset + t.nbytes] = source[
                    t.offset : t.offset + t.nbytes
                ]
        del source

    def group(self, name: str) -> np.ndarray:
        start, nbytes = self.offsets[name]
        return self.buffer[start : start + nbytes]

    def tensors(self, name: str) -> dict[str, np.ndarray]:
        return tensors_of(self.layouts[name], self.group(name))


def _progress(groups: list[Group], total: int, show: bool):
    if not show:
        yield from groups
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    columns = (BarColumn(), DownloadColumn(), TransferSpeedColumn())
    console = Console(stderr=True)  # stdout carries the generated text
    with Progress("loading weights into host memory", *columns, transient=True,
                  console=console) as bar:  # fmt: skip
        task = bar.add_task("load", total=total)
        for g in groups:
            yield g
            bar.advance(task, g.nbytes)


def file_in_memory(path) -> np.ndarray:
    """The whole file read into private anonymous memory advised for huge pages. A decode reads
    every matrix each token: read in place from the file's mapping, a qwen2-1.5B-shaped decode took
    69-76 ms a token in a process's first engine (51-55 in later ones, for reasons left unknown),
    from this copy 48-50 in every engine, the cost model's 51.8
    (docs/measured/2026-12-07-cpu-weights-in-memory.txt). llama.cpp's CPU backend multiplies its
    own repacked copies too."""
    nbytes = os.path.getsize(path)
    # private: a shared anonymous mapping is shmem, which takes no transparent huge pages
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        buffer.madvise(mmap.MADV_HUGEPAGE)
    with open(path, "rb") as f:
        if f.readinto(memoryview(buffer)[:nbytes]) != nbytes:
            raise OSError(f"{path}: read fewer than its {nbytes} bytes")
    return np.frombuffer(buffer, np.uint8, nbytes)


def in_file(source: np.ndarray, info) -> np.ndarray:
    """A tensor's bytes in the file (mapped or read into memory), as `tensors_of` gives a
    group's."""
    return tensors_of([Placed(info, 0)], source[info.offset : info.offset + info.nbytes])[info.name]
