"""Token sampling, outside the engines (docs/contracts.md): greedy, or seeded sampling with top-k,
then top-p, then temperature, in llama.cpp's order (its default chain also has a min-p step, which
we leave out)."""

from __future__ import annotations

import numpy as np

from . import defaults


class Sampler:
    def __init__(
        self,
        temperature: float = defaults.TEMPERATURE,
        top_k: int = defaults.TOP_K,
        top_p: float = defaults.TOP_P,
        seed: int = defaults.SEED,
    ):
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        logits = logits.astype(np.float64)
        order = np.argsort(-logits, kind="stable")
        if self.top_k > 0:
            order = order[: self.top_k]
        z = logits[order]
        p = np.exp(z - z[0])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)  # smallest set reaching top_p
            order, z = order[:keep], z[:keep]
        p = np.exp((z - z[0]) / self.temperature)
        p /= p.sum()
        return int(order[self.rng.choice(len(order), p=p)])
