"""`refengine info`: a model's architecture, hyperparameters and bytes per layer, as tables or
JSON (`refengine.info`)."""

from __future__ import annotations

import json

import click

from ..info import info_dict
from ..models import load_model_or_shape
from ..spec import ROLES
from .base import cli


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


@cli.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@click.option("--tensors", is_flag=True, help="Also list every tensor.")
def info(model: str, as_json: bool, tensors: bool) -> None:
    """Architecture, hyperparameters and a per-layer table of tensors, types and bytes (of a
    GGUF file, a known model or a spec-only shape such as glm-4.5-air)."""
    from rich.console import Console
    from rich.table import Table

    from refengine.generic import generic_note

    spec = load_model_or_shape(model)
    d = info_dict(spec)
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    con = Console()
    con.print(f"[bold]{spec.name}[/]  {spec.path or 'spec-only shape (refengine/shapes.json)'}")
    con.print(
        f"architecture {spec.arch.name}, {spec.n_params / 1e6:,.1f} M parameters, "
        f"{_mib(spec.weights_nbytes)} MiB of weights"
        + (", output tied to token_embd" if spec.tied_output else "")
    )
    if spec.arch.generic:
        con.print(generic_note(spec.arch.name), soft_wrap=True)
    hp = Table(title="hyperparameters", show_header=False)
    for k, v in d["hparams"].items():
        if k == "swa_layers":
            v = "".join("s" if b else "G" for b in v) or "-"
        hp.add_row(k, str(v))
    con.print(hp)
    roles = [r for r in ROLES if r in d["nbytes_by_role"]]
    t = Table(title="bytes per layer and role (MiB)")
    short = {"embedding": "embd", "attention": "attn", "moe_expert": "experts"}
    for col in ["layer", *roles, "total", "types"]:
        t.add_column(short.get(col, col), justify="left" if col in ("layer", "types") else "right")
    for row in d["layers"]:
        name = (
            "global" if row["layer"] is None else str(row["layer"]) + (" swa" if row["swa"] else "")
        )
        t.add_row(
            name,
            *[_mib(row["by_role"].get(r, 0)) for r in roles],
            _mib(row["nbytes"]),
            ",".join(row["types"]),
        )
    t.add_row(
        "[bold]total[/]",
        *[_mib(d["nbytes_by_role"][r]) for r in roles],
        _mib(spec.weights_nbytes),
        "",
    )
    con.print(t)
    if spec.unloaded:
        first, last = spec.hparams.n_layer, spec.hparams.n_block - 1
        con.print(f"NextN block {first}{f'-{last}' if last > first else ''}: "
                  f"{_mib(d['unloaded_nbytes'])} MiB in the file that llama.cpp does not load "
                  "(multi-token prediction) and no plan places")  # fmt: skip
    if tensors:
        tt = Table(title="tensors")
        for col in ("name", "shape", "type", "bytes", "role"):
            tt.add_column(col)
        for x in d["tensors"]:
            tt.add_row(
                x["name"], "x".join(map(str, x["shape"])), x["type"], f"{x['nbytes']:,}", x["role"]
            )
        con.print(tt)
