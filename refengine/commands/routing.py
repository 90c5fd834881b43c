"""`refengine profile-routing`: a MoE model's routing measured on a user's prompts
(`cudarun.routing_profile`), for `solve --routing`."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..errors import UserError
from .base import cli, open_for_writing


@cli.command("profile-routing")
@click.argument("model")
@click.option("-p", "--prompts", "prompts_path", required=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="The prompts, one a line (with --ids: comma-separated token ids).")  # fmt: skip
@click.option("--ids", is_flag=True, help="The lines are token ids, not text.")
@click.option("-n", "--n-predict", default=32, show_default=True,
              help="Tokens generated greedily after each prompt, measured too.")  # fmt: skip
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the routing profile (default: MODEL.routing.json here).")  # fmt: skip
def profile_routing(model: str, prompts_path: Path, ids: bool, n_predict: int,
                    output: Path | None) -> None:  # fmt: skip
    """Measure which experts MODEL's routers choose on your prompts and what an expert cache of
    each size would miss; `solve --routing FILE` then prices expert caches by it."""
    from rich.console import Console
    from rich.table import Table

    from refengine.generate import prompt_for
    from refengine.models import load_model
    from cudarun.routing_profile import profile_routing as measure

    spec = load_model(model)
    if not spec.arch.moe:
        raise UserError(f"{spec.name} has no routed experts ({spec.arch.name}): nothing to profile")
    lines = [line for line in prompts_path.read_text().splitlines() if line.strip()]
    if not lines:
        raise UserError(f"{prompts_path} has no prompt (one a line)")
    prompts = []
    for line in lines:
        try:
            given = [int(t) for t in line.split(",")] if ids else None
        except ValueError:
            raise UserError(f"{prompts_path}: {line[:40]!r} is not comma-separated token ids")
        text = None if ids else line
        prompts.append(prompt_for(spec, text, given, n_predict, spec.hparams.n_ctx_train).ids)
    con = Console()
    with con.status(f"routing {len(prompts)} prompt(s) through {spec.hparams.n_layer} layers"):
        stats = measure(spec, prompts, n_predict)
    t = Table(title=f"{spec.name}: of a decode token's {stats.n_used} experts, missed by a cache "
                    f"of (mean over layers; uniform routing in brackets)")  # fmt: skip
    for col in ("slots", "missed", "uniform", "prefetch: copied before", "missed after"):
        t.add_column(col, justify="right")
    for c, m, e, lt in zip(stats.slots, stats.miss, stats.early, stats.late):
        t.add_row(str(c), f"{m:.3f}", f"({1 - c / stats.n_expert:.3f})", f"{e:.3f}", f"{lt:.3f}")
    con.print(t)
    con.print(f"{stats.tokens} tokens; the router predicted from the layer's input named "
              f"{stats.prefetch_hit:.1%} of the experts it chose")  # fmt: skip
    output = output or Path(f"{spec.name}.routing.json")
    with open_for_writing(output) as out:
        out.write((json.dumps({"model": spec.name, **stats.to_json()}) + "\n").encode())
    con.print(f"wrote {output}; plan with it: refengine solve {model} --routing {output}")
