"""The expert cache of a routed layer: a few of its experts resident on the device across
ubatches, so a ubatch copies only the chosen experts it misses (`solver.routing` prices it).

Least recently used, with the experts the ubatch chose never evicted while it runs: a miss takes
a free slot, else the slot of the least recently used expert not chosen now; when every slot
holds a chosen expert the rest overflow into the ring slot of the routed copy, packed in expert
order as without a cache. A prefetch (`admit(predicted, prefetch=True)`) places the experts the
layer's router predicts before it routes; they count as used then. The engines keep one cache
per layer, which places the experts of every routed stack of the layer alike, and
`profile-routing` replays the measured routing through the same class.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Admission:
    """Where a ubatch's chosen experts are: `resident` expert -> cache slot (a hit, or a miss
    copied there now: `inserted`), and the `overflow` experts, in the routed copy's order."""

    resident: dict[int, int] = field(default_factory=dict)
    inserted: dict[int, int] = field(default_factory=dict)
    overflow: list[int] = field(default_factory=list)

    def place(self, expert: int, slots: int) -> int:
        """The expert's place as the expert kernels read it: a cache slot, or the cache's size
        plus its place in the routed copy."""
        if expert in self.resident:
            return self.resident[expert]
        return slots + self.overflow.index(expert)


class ExpertCache:
    def __init__(self, slots: int):
        self.slots = slots
        self.where: dict[int, int] = {}  # resident expert -> its slot
        self.used: dict[int, int] = {}  # resident expert -> when last chosen
        self.free = list(range(slots - 1, -1, -1))
        self.clock = 0

    def admit(self, experts: list[int]) -> Admission:
        """Place a ubatch's chosen experts (ascending), copying misses into the cache."""
        self.clock += 1
        out = Admission()
        chosen = set(experts)
        victims = sorted((e for e in self.where if e not in chosen), key=self.used.__getitem__)
        victims.reverse()  # pop() takes the least recently used
        for e in experts:
            if e not in self.where:
                if self.free:
                    slot = self.free.pop()
                elif victims:
                    old = victims.pop()
                    slot = self.where.pop(old)
                    del self.used[old]
                else:
                    out.overflow.append(e)
                    continue
                self.where[e] = out.inserted[e] = slot
            out.resident[e] = self.where[e]
            self.used[e] = self.clock
        return out

    def clear(self) -> None:
        self.__init__(self.slots)
