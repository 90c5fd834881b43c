"""Agreement of an engine with the reference along a greedy continuation (docs/contracts.md,
Tolerances): both are fed the reference's greedy tokens; before the first near-tie every top-1
must agree (so the greedy continuations are identical), from it on the comparison is
teacher-forced: top-1 agreement and mean KL(reference || engine) per position.

The bounds follow the path (`PATHS`; docs/contracts.md, Tolerances): an engine against the NumPy reference
keeps top-1 >= 99% and mean KL < 1e-3, with the final logits within 1e-3 normwise on fp32 paths
and 5e-2 on the named fp16 path (tensor-core GEMMs on fp16 panels); the int8 path (8-bit
activations: llama.cpp's own CPU arithmetic) keeps the bounds the reference keeps to llama.cpp,
top-1 >= 98% and mean KL < 5e-3, its normwise error printed, not bounded.

`judge` is what `refengine diff` holds a plan to: teacher-forced top-1 (near-ties excused) and mean
KL over every position, the normwise error printed beside but not judged — a plan that meets its
path's contract does not "diverge".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PathBounds:
    """docs/contracts.md's bounds of a named path."""

    path: str
    top1: float  # least teacher-forced top-1 agreement
    kl: float  # mean KL(reference || engine) stays below this
    normwise: float  # the end-to-end logits tolerance; also sets the near-tie gap
    normwise_bounded: bool = True  # the int8 path's is printed, not judged

    def describe(self) -> str:
        return (f"{self.path} path: top-1 >= {self.top1:.0%}, mean KL < {self.kl:g} "
                f"(normwise logits tolerance {self.normwise:g}, printed)")  # fmt: skip


PATHS = {
    "fp32": PathBounds("fp32", 0.99, 1e-3, 1e-3),  # every matmul exact fp32
    "fp16": PathBounds("fp16", 0.99, 1e-3, 5e-2),  # tensor-core GEMMs on fp16 panels
    "int8": PathBounds("int8", 0.98, 5e-3, 5e-2, False),  # 8-bit activation dot products
}


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
    path: str = "fp32"  # the engine's named path, whose bounds judge it (`PATHS`)
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
    def ok(self) -> bool:
        b = PATHS[self.path]
        return (
            self.greedy_identical
            and self.forced_top1 >= b.top1
            and self.mean_kl < b.kl
            and (self.errors[-1] <= self.tolerance or not b.normwise_bounded)
        )

    def summary(self) -> str:
        tie = self.first_near_tie
        return (
            f"{len(self.tokens)} tokens: greedy {'identical' if self.greedy_identical else 'DIFFERS'}"
            f" up to the first near-tie ({'none' if tie is None else f'position {tie}'}), "
            f"teacher-forced top-1 {self.forced_top1:.1%} (top-1 equal at "
            f"{sum(self.top1_equal)}/{len(self.top1_equal)} positions), mean KL {self.mean_kl:.2e}, "
            f"final logits error {self.errors[-1]:.2e} (tolerance {self.tolerance:g})"
            + self.worst()
        )

    def worst(self) -> str:
        """Where a mean KL comes from: one position far off (a stale row) or all a little."""
        if len(self.kl) < 2:
            return ""
        at = int(np.argmax(self.kl))
        return f"; largest KL {self.kl[at]:.2e} at position {at}, logits error {self.errors[at]:.2e}"

    @property
    def excused(self) -> list[int]:
        """Positions whose top-1 differs at a near-tie of the reference."""
        return [i for i, (eq, near) in enumerate(zip(self.top1_equal, self.near_tie))
                if near and not eq]  # fmt: skip

    @property
    def teacher_forced_top1(self) -> float:
        """Top-1 agreement over every position, a near-tie agreeing either way."""
        return float(np.mean([eq or near for eq, near in zip(self.top1_equal, self.near_tie)]))

    def add(self, ours: np.ndarray, ref: np.ndarray) -> int:
        self.near_tie.append(near_tie(ref, self.tolerance))
        token = int(np.argmax(ref))
        self.tokens.append(token)
        self.top1_equal.append(int(np.argmax(ours)) == token)
        lp, lq = log_softmax(ref), log_softmax(ours)
        self.kl.append(float(np.sum(np.exp(lp) * (lp - lq))))
        self.errors.append(normwise(ours, ref))
        return token


def near_tie(ref: np.ndarray, tolerance: float) -> bool:
    """The reference's top two logits differ by less than max(0.01, 2 * tolerance * max|logit|)."""
    top2 = np.partition(ref, -2)[-2:]
    return float(top2[1] - top2[0]) < max(0.01, 2 * tolerance * float(np.abs(ref).max()))


@dataclass
class Judgement:
    """A teacher-forced agreement held to its path's bounds."""

    bounds: PathBounds
    agreement: Agreement

    @property
    def top1(self) -> float:
        return self.agreement.teacher_forced_top1

    @property
    def mean_kl(self) -> float:
        return self.agreement.mean_kl

    @property
    def normwise(self) -> float:
        """The largest logits error of any position (printed, not judged)."""
        return max(self.agreement.errors)

    @property
    def failed(self) -> list[str]:
        """Each bound the agreement misses, in words."""
        b, out = self.bounds, []
        if self.top1 < b.top1:
            out.append(f"teacher-forced top-1 {self.top1:.1%} < {b.top1:.0%}")
        if not self.mean_kl < b.kl:  # a NaN fails
            out.append(f"mean KL {self.mean_kl:.2e} >= {b.kl:g}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failed

    def lines(self) -> list[str]:
        a, b = self.agreement, self.bounds
        n = len(a.top1_equal)
        excused = ", ".join(map(str, a.excused)) or "none"
        beside = "within" if self.normwise <= b.normwise else "above"
        return [
            f"teacher-forced over {n} positions: top-1 {self.top1:.1%} ({sum(a.top1_equal)}/{n} "
            f"positions equal; differing at a near-tie, so excused: {excused}), mean KL "
            f"{self.mean_kl:.2e}",
            f"bounds of the {b.describe()}",
            f"normwise logits error at the worst position {self.normwise:.2e}, {beside} the "
            f"path's {b.normwise:g}",
            "verdict: meets its path's bounds" if self.ok
            else "verdict: FAILS " + "; ".join(self.failed),
        ]  # fmt: skip


def judge(engine_rows, reference_rows, bounds: PathBounds) -> Judgement:
    """Hold an engine's logits to the reference's, position by position (both fed the same
    tokens), by the bounds of its path."""
    agreement = Agreement(bounds.normwise)
    for ours, ref in zip(engine_rows, reference_rows, strict=True):
        agreement.add(np.asarray(ours), np.asarray(ref))
    return Judgement(bounds, agreement)


def reference_run(reference, prompt, n_predict: int) -> list[np.ndarray]:
    """The reference's logits along its own greedy continuation: prompt, then n_predict - 1
    tokens."""
    reference.reset()
    rows = [reference.prefill(prompt)]
    for _ in range(n_predict - 1):
        rows.append(reference.decode(int(np.argmax(rows[-1]))))
    return rows


def agreement_along(engine, prompt, reference_rows, tolerance: float) -> Agreement:
    """Feed the engine the prompt and the reference's greedy tokens; compare at every step, by
    the bounds of the engine's named path."""
    agreement = Agreement(tolerance, getattr(engine, "path", "fp32"))
    engine.reset()
    token = agreement.add(engine.prefill(prompt), reference_rows[0])
    for row in reference_rows[1:]:
        token = agreement.add(engine.decode(token), row)
    return agreement
