"""What a tier switch does to the device arena: from one tier's memory map to the next's.

Regions (solver.regions.Region: id, offset_bytes, nbytes) of pinned weights and KV hold content
that must survive a switch (`regions.KEPT`); the ring's and the workspace do not. Between two
maps:
- a region in both at a new offset moves on the device (D2D);
- a KV region only in the old map is downloaded to host memory (the KV moves to the host); a
  weights one is simply dropped (its pinned host copy exists);
- a region only in the new map is uploaded from the host (weights, or KV coming back).

`switch_steps` orders them so nothing is read after being overwritten: downloads first, then the
moves, each after every move whose source its destination overlaps (a cycle is broken by sending
one region through the host), then the uploads. `apply_steps` carries them out on a byte array,
which the tests (and the stand-in device) use to prove the order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from solver.regions import KEPT, RegionId, RegionKind


@dataclass(frozen=True)
class Step:
    kind: str  # "download", "move", "upload"
    region: RegionId
    src: int  # arena offset (download, move); -1 for an upload from the host
    dst: int  # arena offset (move, upload); -1 for a download to the host
    nbytes: int


def _overlap(a0: int, n_a: int, b0: int, n_b: int) -> bool:
    return a0 < b0 + n_b and b0 < a0 + n_a


def switch_steps(before, after) -> list[Step]:
    old = {r.id: r for r in before if r.kind in KEPT}
    new = {r.id: r for r in after if r.kind in KEPT}
    downloads = [
        Step("download", n, r.offset_bytes, -1, r.nbytes)
        for n, r in old.items()
        if n not in new and n.kind is RegionKind.KV
    ]
    uploads = [
        Step("upload", n, -1, r.offset_bytes, r.nbytes) for n, r in new.items() if n not in old
    ]
    pending = {
        n: Step("move", n, old[n].offset_bytes, new[n].offset_bytes, new[n].nbytes)
        for n in new
        if n in old and old[n].offset_bytes != new[n].offset_bytes
    }
    moves = []
    while pending:
        # a move is safe once no other pending move still has to read what it would overwrite
        ready = [
            m
            for m in pending.values()
            if not any(
                o.region != m.region and _overlap(m.dst, m.nbytes, o.src, o.nbytes)
                for o in pending.values()
            )
        ]
        if ready:
            for m in sorted(ready, key=lambda s: str(s.region)):
                moves.append(m)
                del pending[m.region]
            continue
        # a cycle: the first pending region goes through the host
        rid = min(pending, key=str)
        m = pending.pop(rid)
        downloads.append(Step("download", rid, m.src, -1, m.nbytes))
        uploads.append(Step("upload", rid, -1, m.dst, m.nbytes))
    return downloads + moves + uploads


def apply_steps(arena: np.ndarray, steps: list[Step], host: dict[RegionId, np.ndarray]) -> None:
    """Carry the steps out on a uint8 arena; downloads land in `host`, uploads come from it."""
    for s in steps:
        if s.kind == "download":
            host[s.region] = arena[s.src : s.src + s.nbytes].copy()
        elif s.kind == "move":
            arena[s.dst : s.dst + s.nbytes] = arena[s.src : s.src + s.nbytes].copy()
        else:
            arena[s.dst : s.dst + s.nbytes] = host[s.region]
