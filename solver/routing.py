"""How often an expert cache misses: uniform routing, or measured on a user's prompts.

A routed stack with an expert cache of C slots (`cudarun.expert_cache`: least recently used, the
chosen experts of the ubatch never evicted) copies, per chosen expert, `miss(C)` experts: with
every token choosing k of E uniformly and independently, the cache holds C experts unrelated to
the next choice, so miss(C) = 1 - C/E. Real routers repeat themselves from token to token and
favour some experts; `refengine profile-routing` runs the NumPy engine over a user's prompts,
replays each layer's decode-order choices through the same cache at a few sizes, and keeps the
mean over layers (`RoutingStats`): the planner prices every layer by it, so the total over layers
is what the replay counted when every layer has one cache size. With prefetch (the layer's router
applied to the layer's input before its attention, the predicted experts copied into the cache
early) it keeps, per cache size, the copies made before routing and the misses left after it.

Ubatches of T > 1 tokens touch D(T) = E (1 - (1 - k/E)^T) experts; the cache's ratios, measured a
token at a time, are applied to D(T) as they are to k.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

SCHEMA = "refengine.routing"


@dataclass(frozen=True)
class RoutingStats:
    """Per cache size (`slots`, ascending, from 0): of each chosen expert, the fraction the cache
    missed (`miss`); with prefetch, the copies made before routing (`early`) and the misses
    after it (`late`), both per chosen expert. `frequency`: per layer, each expert's share of
    the choices. `tokens`: how many tokens were measured."""

    n_expert: int
    n_used: int
    tokens: int
    slots: tuple[int, ...]
    miss: tuple[float, ...]
    early: tuple[float, ...]
    late: tuple[float, ...]
    prefetch_hit: float  # of the experts chosen, the fraction the prediction had named
    frequency: tuple[tuple[float, ...], ...] = ()
    miss_by_layer: tuple[tuple[float, ...], ...] = ()

    def at(self, curve: tuple[float, ...], cache: int) -> float:
        return float(np.interp(cache, self.slots, curve))

    def to_json(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return {"schema": SCHEMA, **d}

    @classmethod
    def from_json(cls, d: dict) -> "RoutingStats":
        if d.get("schema") != SCHEMA:
            raise ValueError("not a routing profile")
        tup = lambda v: tuple(tup(x) for x in v) if isinstance(v, list) else v  # noqa: E731
        return cls(**{k: tup(d[k]) for k in cls.__dataclass_fields__})

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]


def miss_ratio(stats: RoutingStats | None, n_expert: int, cache: int) -> float:
    """Of a ubatch's chosen experts, the fraction an expert cache of `cache` slots misses."""
    if stats is None:
        return max(0.0, 1.0 - cache / n_expert)
    return stats.at(stats.miss, cache)


def prefetch_ratios(stats: RoutingStats, cache: int) -> tuple[float, float]:
    """Per chosen expert, with prefetch: (copies before routing, misses after it)."""
    return stats.at(stats.early, cache), stats.at(stats.late, cache)


def load_routing(path, spec) -> RoutingStats:
    """A routing profile written by `refengine profile-routing` for this model; one line if not."""
    from pathlib import Path

    from refengine.errors import UserError

    p = Path(path)
    try:
        d = json.loads(p.read_text())
        stats = RoutingStats.from_json(d)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{p}: not a routing profile ({e}); write one with "
                        "refengine profile-routing") from None  # fmt: skip
    hp = spec.hparams
    if d.get("model") != spec.name or (stats.n_expert, stats.n_used) != (hp.n_expert,
                                                                          hp.n_expert_used):
        raise UserError(f"{p} was measured on {d.get('model')}, not {spec.name}; run "
                        f"refengine profile-routing on this model")  # fmt: skip
    return stats
