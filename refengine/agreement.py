"""Agreement of an engine with the reference along a greedy continuation (CONTRACTS.md,
Tolerances): both are fed the reference's greedy tokens; before the first near-tie every top-1
must agree (so the greedy continuations are identical), from it on the comparison is
teacher-forced: top-1 agreement and mean KL(reference || engine) per position.

The bounds follow the path: fp32 paths (tolerance 1e-3) keep top-1 >= 99% and mean KL < 1e-3; the
named int8 path (tolerance 5e-2: CPU parts with 8-bit activations, llama.cpp's own CPU arithmetic)
keeps the bounds the reference keeps to llama.cpp, top-1 >= 98% and mean KL < 5e-3.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def normwise(a: np.ndarray, b: np.ndarray) -> float:
    """max|a - b| / max|b|."""
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in fp64."""
    rows = rows.astype(np.float64)
    m = rows.max(axis=-1, keepdims=True)
    return rows - m - np.log(np.exp(rows - m).sum(axis=-1, keepdims=True))


@dataclass
class Agreement:
    tolerance: float
    tokens: list[int] = field(default_factory=list)  # the reference's greedy tokens
    top1_equal: list[bool] = field(default_factory=list)
    near_tie: list[bool] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    errors: list[float] = field(default_factory=list)  # normwise, per position

    @property
    def first_near_tie(self) -> int | None:
        return next((i for i, n in enumerate(self.near_tie) if n), None)

    @property
    def greedy_identical(self) -> bool:
        """Every top-1 equal before the first near-tie."""
        stop = self.first_near_tie
        return all(self.top1_equal[: len(self.top1_equal) if stop is None else stop])

    @property
    def forced_top1(self) -> float:
        """Top-1 agreement from the first near-tie on; a position that is itself a near-tie
        agrees either way (the rule the golden comparisons with llama.cpp use)."""
        stop = self.first_near_tie
        if stop is None:
            return 1.0
        rest = [eq or near for eq, near in zip(self.top1_equal[stop:], self.near_tie[stop:])]
        return float(np.mean(rest))

    @property
    def mean_kl(self) -> float:
        return float(np.mean(self.kl))

    @property
    def limits(self) -> tuple[float, float]:
        """(least teacher-forced top-1 agreement, largest mean KL)."""
        return (0.99, 1e-3) if self.tolerance <= 1e-3 else (0.98, 5e-3)

    @property
    def ok(self) -> bool:
        top1, kl = self.limits
        return (
            self.greedy_identical
            and self.forced_top1 >= top1
            and self.mean_kl < kl
            and self.errors[-1] <= self.tolerance
        )

    def summary(self) -> str:
        tie = self.first_near_tie
        return (
            f"{len(self.tokens)} tokens: greedy {'identical' if self.greedy_identical else 'DIFFERS'}"
            f" up to the first near-tie ({'none' if tie is None else f'position {tie}'}), "
            f"teacher-forced top-1 {self.forced_top1:.1%} (top-1 equal at "
            f"{sum(self.top1_equal)}/{len(self.top1_equal)} positions), mean KL {self.mean_kl:.2e}, "
            f"final logits error {self.errors[-1]:.2e} (tolerance {self.tolerance:g})"
        )

    def add(self, ours: np.ndarray, ref: np.ndarray) -> int:
        top2 = np.partition(ref, -2)[-2:]
        gap = float(top2[1] - top2[0])
        self.near_tie.append(gap < max(0.01, 2 * self.tolerance * float(np.abs(ref).max())))
        token = int(np.argmax(ref))
        self.tokens.append(token)
        self.top1_equal.append(int(np.argmax(ours)) == token)
        lp, lq = log_softmax(ref), log_softmax(ours)
        self.kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
        self.errors.append(normwise(ours, ref))
        return token


def reference_run(reference, prompt, n_predict: int) -> list[np.ndarray]:
    """The reference's logits along its own greedy continuation: prompt, then n_predict - 1
    tokens."""
    reference.reset()
    rows = [reference.prefill(prompt)]
    for _ in range(n_predict - 1):
        rows.append(reference.decode(int(np.argmax(rows[-1]))))
    return rows


def agreement_along(engine, prompt, reference_rows, tolerance: float) -> Agreement:
    """Feed the engine the prompt and the reference's greedy tokens; compare at every step."""
    agreement = Agreement(tolerance)
    engine.reset()
    token = agreement.add(engine.prefill(prompt), reference_rows[0])
    for row in reference_rows[1:]:
        token = agreement.add(engine.decode(token), row)
    return agreement
