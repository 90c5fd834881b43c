"""The program's count of residual hops between layers (optimize._walk_hops) is the fewest any
ordering of the layers needs, checked against a search over orderings."""

from dataclasses import dataclass
from functools import lru_cache

from hypothesis import given, settings
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from solver.optimize import _walk_hops


@dataclass(frozen=True)
class Ends:
    first_on: bool
    last_on: bool


TYPES = [Ends(True, True), Ends(False, False), Ends(True, False), Ends(False, True)]


def fewest_hops(counts: tuple[int, ...], start: bool, end: bool) -> int:
    @lru_cache(None)
    def best(left: tuple[int, ...], at: bool) -> int:
        if not any(left):
            return int(at != end)
        out = 10**9
        for i, n in enumerate(left):
            if n:
                rest = left[:i] + (n - 1,) + left[i + 1 :]
                t = TYPES[i]
                out = min(out, int(at != t.first_on) + best(rest, t.last_on))
        return out

    return best(counts, start)


@settings(max_examples=60, deadline=None)
@given(
    st.tuples(*[st.integers(0, 3)] * 4),
    st.booleans(),
    st.booleans(),
)
def test_walk_hops_are_the_fewest_any_order_needs(counts, start, end):
    m = cp_model.CpModel()
    xs = [(m.NewConstant(n), t) for n, t in zip(counts, TYPES)]
    s, e = m.NewConstant(int(start)), m.NewConstant(int(end))
    hops = m.NewIntVar(0, 100, "hops")
    m.Add(hops == _walk_hops(m, xs, s, e, sum(counts), "w"))
    m.Minimize(hops)
    solver = cp_model.CpSolver()
    assert solver.Solve(m) == cp_model.OPTIMAL
    assert solver.Value(hops) == fewest_hops(counts, start, end)


def test_taking_layers_by_walk_rank_needs_the_fewest_hops():
    from itertools import product

    from solver.optimize import walk_rank

    for counts in product(range(3), repeat=4):
        for start, end in product((False, True), repeat=2):
            left, at, hops = list(counts), start, 0
            while any(left):
                i = min(
                    (i for i in range(4) if left[i]),
                    key=lambda i: walk_rank(TYPES[i].first_on, TYPES[i].last_on, at),
                )
                hops += TYPES[i].first_on != at
                at, left[i] = TYPES[i].last_on, left[i] - 1
            hops += at != end
            assert hops == fewest_hops(counts, start, end), (counts, start, end)
