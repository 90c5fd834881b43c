"""A region of a device's memory map (docs/contracts.md, Plan): what the solver lays out and the
runtime's arena allocates, at the offset the solver chose.

A region is named by a `RegionId` (its kind, its key, its device). The plan's JSON writes a map
per device, each region as `[name, offset_bytes, nbytes]` with the name `kind:key` (`weights:
blk.0.attn`, `cache:blk.3.ffn_up_exps`, `scratch:1`, `kv:7`, or `workspace`); `RegionId.parse`
is the one place such a name is read."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RegionKind(str, Enum):
    WEIGHTS = "weights"  # a group pinned on the device (key: the group's name)
    CACHE = "cache"  # a routed stack's expert cache (key: the stack's group)
    SCRATCH = "scratch"  # a slot of the streaming ring (key: its index)
    WORKSPACE = "workspace"  # the runtime's activations and kernels' scratch (no key)
    KV = "kv"  # a layer's KV held on the device (key: the layer)


KEYED_BY_INT = (RegionKind.SCRATCH, RegionKind.KV)
# what a tier switch carries over (moved on the device, or through the host); the rest is laid
# out again
KEPT = (RegionKind.WEIGHTS, RegionKind.KV)


@dataclass(frozen=True)
class RegionId:
    kind: RegionKind
    key: str | int | None = None
    device: int = 0

    def __str__(self) -> str:
        """The name the plan's JSON writes (its device is the map it is in)."""
        return self.kind.value if self.key is None else f"{self.kind.value}:{self.key}"

    @classmethod
    def parse(cls, name: str, device: int = 0) -> RegionId:
        kind, _, key = name.partition(":")
        k = RegionKind(kind)
        return cls(k, int(key) if k in KEYED_BY_INT else (key or None), device)


def weights(group: str, device: int = 0) -> RegionId:
    return RegionId(RegionKind.WEIGHTS, group, device)


def cache(group: str, device: int = 0) -> RegionId:
    return RegionId(RegionKind.CACHE, group, device)


def kv(layer: int, device: int = 0) -> RegionId:
    return RegionId(RegionKind.KV, layer, device)


def workspace(device: int = 0) -> RegionId:
    return RegionId(RegionKind.WORKSPACE, None, device)


@dataclass(frozen=True)
class Region:
    id: RegionId
    offset_bytes: int
    nbytes: int

    @property
    def kind(self) -> RegionKind:
        return self.id.kind

    def to_json(self) -> list:
        return [str(self.id), self.offset_bytes, self.nbytes]

    @classmethod
    def from_json(cls, entry: list, device: int) -> Region:
        name, offset_bytes, nbytes = entry
        return cls(RegionId.parse(name, device), int(offset_bytes), int(nbytes))
