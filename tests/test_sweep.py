"""`refengine sweep`: the range parser, what a sweep's rows must obey, the PNG, the command."""

import pytest
from click.testing import CliRunner

from refengine.commands import cli
from refengine.errors import UserError
from refengine.models import load_model_or_shape
from solver.solve import load_profile, request_workload
from solver.sweep import GIB, SWEEP_SOLVER_SECONDS, Axis, gains, parse_range, sweep, with_pcie
from solver.sweep import write_png

from .conftest import refengine

pytestmark = pytest.mark.xdist_group("sweep")  # one worker sweeps, once

MIB = 2**20
SHAPE = "smollm2-135m:Q8_0"  # spec-only: 30 layers, about 140 MiB of weights
PROFILE = "rtx4090-epyc-7742"
BUDGETS = "10MiB..330MiB:80MiB"  # from almost nothing on the GPU to every weight pinned
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_ranges_include_both_ends_in_the_axis_unit():
    assert parse_range("budget", "4GiB..24GiB:2GiB").values == tuple(
        g * GIB for g in range(4, 25, 2)
    )
    assert parse_range("budget", "1.5GiB..2.5GiB:0.5GiB").values == (
        int(1.5 * GIB), 2 * GIB, int(2.5 * GIB)
    )  # fmt: skip
    assert parse_range("budget", "1024..2048:512").values == (1024 * MIB, 1536 * MIB, 2048 * MIB)
    assert parse_range("budget", "4GiB..9GiB:2GiB").values == (4 * GIB, 6 * GIB, 8 * GIB)
    assert parse_range("ctx", "2048..16384:2048").values == tuple(range(2048, 16385, 2048))
    assert parse_range("pcie", "8..32:8").values == (8.0, 16.0, 24.0, 32.0)
    assert parse_range("pcie", " 8 .. 9 : 0.5 ").values == (8.0, 8.5, 9.0)
    assert parse_range("budget", "3GiB..3GiB:1GiB").values == (3 * GIB,)


@pytest.mark.parametrize(
    "axis, text, says",
    [
        ("budget", "4GiB..2GiB:1GiB", "the end is below the start"),
        ("budget", "4GiB..8GiB:0GiB", "the step must be above zero"),
        ("budget", "4TiB..8TiB:1TiB", "unknown unit 'TiB'"),
        ("budget", "0..8GiB:2GiB", "must start above zero"),
        ("budget", "4GiB..24GiB:2", "10241 values, more than 64"),  # 2 MiB steps
        ("budget", "4GiB-24GiB", "LO..HI:STEP"),
        ("budget", "4GiB...8GiB:1GiB", "cannot read '.8GiB'"),
        ("ctx", "2048..4096:1.5", "whole number of tokens"),
        ("ctx", "2k..4k:1k", "unknown unit 'k'"),
        ("pcie", "8..32:8GBps", "unknown unit 'GBps'"),
    ],
)
def test_a_bad_range_is_refused_naming_what_is_wrong(axis, text, says):
    with pytest.raises(UserError, match=says.replace(".", r"\.")):
        parse_range(axis, text)


@pytest.fixture(scope="module")
def request_():
    spec = load_model_or_shape(SHAPE)
    prof = load_profile(PROFILE)
    return spec, prof, request_workload(prof, 4096, 1, None, 200, "f16", True, 0)


@pytest.fixture(scope="module")
def budget_rows(request_):
    axis = parse_range("budget", BUDGETS)
    return axis, sweep(*request_, axis)


def test_more_budget_never_makes_the_optimizer_slower_end_to_end(budget_rows):
    axis, rows = budget_rows
    assert [r.value for r in rows] == list(axis.values) and all(r.optimal for r in rows)
    for smaller, larger in zip(rows, rows[1:]):
        # the larger budget admits every placement of the smaller, so its optimum is no slower;
        # its solution is within the solver's reported gap of its optimum
        gap = larger.gap or 0.0
        assert larger.optimal.e2e_seconds <= smaller.optimal.e2e_seconds * (1 + gap / (1 - gap))
    # and the budget buys something here: 330 MiB is far faster than 10 MiB
    assert rows[-1].optimal.e2e_seconds < rows[0].optimal.e2e_seconds / 3
    assert gains(axis, rows)[0] is None and all(g > -1e-3 for g in gains(axis, rows)[1:])


def test_the_optimizer_is_never_slower_than_fit_or_pshards_best_in_a_row(budget_rows):
    _, rows = budget_rows
    for r in rows:
        assert r.fit.name == "fit" and r.pshard.name not in ("fit", "optimal")
        assert r.optimal.e2e_seconds <= r.named_best.e2e_seconds * (1 + 1e-3), r


def test_a_budget_below_the_minimum_is_a_row_that_says_so(request_):
    axis = Axis("budget", (MIB // 10, 64 * MIB))
    rows = sweep(*request_, axis, tiers="1,512")
    assert rows[0].optimal is None and "below the minimum of" in rows[0].refused
    assert rows[1].optimal is not None and rows[1].budgets == (64 * MIB,)


def test_more_pcie_bandwidth_never_makes_the_optimizer_slower(request_):
    spec, prof, w = request_
    assert with_pcie(prof, 12.5).gpus[0].h2d_gbps.value == 12.5
    assert with_pcie(prof, 12.5).gpus[0].d2h_gbps.value == pytest.approx(
        prof.gpus[0].d2h_gbps.value / 2
    )
    rows = sweep(spec, prof, w, parse_range("pcie", "4..32:14"), budget="60MiB")
    assert [r.value for r in rows] == [4.0, 18.0, 32.0]
    for slower, faster in zip(rows, rows[1:]):
        gap = faster.gap or 0.0
        assert faster.optimal.e2e_seconds <= slower.optimal.e2e_seconds * (1 + gap / (1 - gap))
    assert rows[-1].optimal.e2e_seconds < rows[0].optimal.e2e_seconds  # streaming got cheaper


def test_a_context_sweep_fills_each_context_and_refuses_one_too_small(request_):
    spec, prof, w = request_
    rows = sweep(spec, prof, w, parse_range("ctx", "128..1152:512"), budget="60MiB")
    assert rows[0].optimal is None and "--ctx 128" in rows[0].refused  # 200 tokens to generate
    assert rows[1].optimal and rows[2].optimal
    assert rows[2].optimal.ttft_seconds > rows[1].optimal.ttft_seconds  # a longer prompt


def test_the_png_is_written_and_is_a_png(budget_rows, tmp_path):
    axis, rows = budget_rows
    rows = [*rows[:2], sweep_refused(axis), *rows[2:]]
    out = tmp_path / "sweep.png"
    write_png(axis, rows, out, "smollm2 shape")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    with pytest.raises(UserError, match="cannot write"):
        write_png(axis, rows, tmp_path / "missing" / "sweep.png", "")


def sweep_refused(axis):
    from solver.sweep import Row

    return Row(axis.values[0] + MIB, refused="a budget below the minimum")


def test_the_command_prints_every_value_and_writes_the_png(tmp_path):
    out = tmp_path / "s.png"
    args = ["sweep", SHAPE, "--profile", PROFILE, "--budget", "0.1..80.1:40",
            "--tiers", "1,512", "--png", str(out)]  # fmt: skip
    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 0, r.output
    table = r.stdout
    assert "budget MiB" in table and "saved s/MiB" in table
    values = [line.split("│")[1].strip() for line in table.splitlines() if line.startswith("│")]
    assert [v for v in values if v] == ["0.1", "40.1", "80.1"]
    assert table.count("│ fit ") == 2  # two planned values, one refused
    assert "no plan at 0.1 MiB: a budget of 0.10 MiB is below the minimum" in table
    assert "solver: 1 deterministic s a value" in table
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_sweeping_two_axes_or_none_is_refused():
    r = CliRunner().invoke(cli, ["sweep", SHAPE, "--profile", PROFILE, "--budget",
                                 "1GiB..2GiB:1GiB", "--ctx", "2048..4096:2048"])  # fmt: skip
    assert isinstance(r.exception, UserError) and "one axis at a time" in str(r.exception)
    r = CliRunner().invoke(cli, ["sweep", SHAPE, "--profile", PROFILE, "--budget", "1GiB"])
    assert isinstance(r.exception, UserError) and "nothing to sweep" in str(r.exception)


@pytest.mark.parametrize("budget", ["4GiB..2GiB:1GiB", "4GiB..8GiB:0GiB", "4XB..8XB:1XB"])
def test_a_bad_range_is_one_line_and_exit_2(budget):
    r = refengine("sweep", SHAPE, "--profile", PROFILE, "--budget", budget)
    assert r.returncode == 2 and r.stderr.startswith("error: --budget ")
    assert r.stderr.count("\n") == 1 and r.stdout == ""


def test_the_help_says_one_axis_at_a_time_and_the_sweeps_time_limit():
    text = " ".join(CliRunner().invoke(cli, ["sweep", "--help"]).stdout.split())
    assert "ONE swept axis" in text
    assert f"(default {SWEEP_SOLVER_SECONDS:g}, solver.sweep.SWEEP_SOLVER_SECONDS" in text
