"""A region of a device's memory map (docs/contracts.md, Plan): what the solver lays out and the
runtime's arena allocates, at the offset the solver chose."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Region:
    name: str
    offset_bytes: int
    nbytes: int
