"""`refengine batched-bench`: llama-batched-bench on our engines (`refengine.batched_bench`)."""

from __future__ import annotations

import json

import click

from ..errors import UserError
from ..models import load_model
from .base import ENGINES, cli, plan_options


@cli.command("batched-bench")
@click.argument("model")
@click.option("--engine", "engine_name", type=click.Choice(ENGINES), default="cpu",
              show_default=True)  # fmt: skip
@click.option("-npp", "npp", default="128,512", show_default=True, help="Prompt tokens per sequence.")
@click.option("-ntg", "ntg", default="32", show_default=True, help="Generated tokens per sequence.")
@click.option("-npl", "npl", default="1,2,4,8,16,32", show_default=True,
              help="Parallel sequences (B).")  # fmt: skip
@click.option("-c", "--ctx-size", type=int,
              help="Context: the total over all sequences, as llama.cpp's -c (default: what the "
              "largest row needs).")  # fmt: skip
@click.option("--unified", is_flag=True,
              help="One KV cache shared by all sequences, attention masked by sequence "
              "(llama.cpp's -kvu); default: a KV stream per sequence.")  # fmt: skip
@click.option("-o", "--output", "output_format", type=click.Choice(("md", "json")), default="md",
              show_default=True,
              help="json: one llama-batched-bench JSONL record per row on stdout.")  # fmt: skip
@plan_options
def batched_bench(model, engine_name, npp, ntg, npl, ctx_size, unified, output_format,
                  **plan_args) -> None:  # fmt: skip
    """llama-batched-bench's table for one of our engines: B sequences' prompts processed together,
    then decode steps that advance all B at once (each sequence attends over its own KV stream,
    or, with --unified, over one shared cache masked by sequence)."""
    from rich.console import Console
    from rich.progress import Progress

    from ..batched_bench import batched_bench as run_bench
    from ..batched_bench import markdown, parse_counts

    n_pp, n_tg, n_pl = (parse_counts(v, o) for v, o in ((npp, "-npp"), (ntg, "-ntg"),
                                                         (npl, "-npl")))  # fmt: skip
    if min(n_pl) < 1:
        raise UserError("-npl takes 1 or more sequences")
    spec = load_model(model)
    n_seq = max(n_pl)
    n_ctx = ctx_size or n_seq * (max(n_pp) + max(n_tg))
    engine = _engine(engine_name, spec, n_ctx, n_seq, unified, max(n_pp), max(n_tg), plan_args)
    err = Console(stderr=True)
    with Progress(console=err, transient=True) as bar:
        task = bar.add_task("batched-bench", total=len(n_pp) * len(n_tg) * len(n_pl))
        rows, skipped = run_bench(engine, n_pp, n_tg, n_pl,
                                  progress=lambda done, _: bar.update(task, completed=done))  # fmt: skip
    for pp, tg, pl in skipped:
        err.print(f"skipped PP {pp}, TG {tg}, B {pl}: {pl} x {pp + tg} cells do not fit -c "
                  f"{engine.seqs.n_ctx} ({engine.seqs.n_ctx_seq} a sequence)", markup=False)  # fmt: skip
    if output_format == "json":
        for r in rows:
            click.echo(json.dumps(r.record()))
        return
    mode = "unified KV" if unified else "a KV stream per sequence"
    click.echo(f"{spec.name}: {engine_name} engine, n_kv_max = {engine.seqs.n_ctx}, "
               f"n_seq_max = {n_seq}, {mode}, ubatch {engine_ubatch(engine)}")  # fmt: skip
    click.echo()
    for line in markdown(rows):
        click.echo(line)


def engine_ubatch(engine) -> int:
    return engine.tier_sizes[-1] if hasattr(engine, "tier_sizes") else engine.n_ubatch


def _engine(name: str, spec, n_ctx: int, n_seq: int, unified: bool, n_prompt: int, n_gen: int,
            plan_args: dict):  # fmt: skip
    if name == "numpy":
        if any(plan_args[k] for k in ("budget", "plan_path")):
            raise UserError("--budget and --plan are for the plan engines: add --engine cuda")
        from ..engine import NumpyEngine

        return NumpyEngine(spec, n_ctx=n_ctx, n_seq=n_seq, unified=unified)
    from .base import plan_engine

    engine, _ = plan_engine(name, spec, n_ctx, dict(plan_args, n_seq=n_seq, unified=unified),
                            n_prompt, n_gen)  # fmt: skip
    return engine
