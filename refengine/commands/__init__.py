"""The `refengine` command: `main`, and the commands (the group and shared options: `base`).
Each command lives in a module of this package by what it does, and is a thin shell over a library
call: it parses its options, calls the library, prints.

User mistakes raise `UserError`; `main` prints them on one line and exits with status 2.
"""

from __future__ import annotations

import sys

import click

from ..errors import UserError
from .base import cli

# each module registers its commands on `cli`
from . import batched, info, kernels, plan_engines, profile, routing, run, solve, sweep, synth, verify  # noqa: E402,F401,I001


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except UserError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
