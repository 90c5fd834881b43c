"""`refengine diff` and `refengine bench`: the plan engines checked against the NumPy engine
(`refengine.diffing`), and timed against the plan's prediction, the physical bound and a baseline
plan (`cudarun.bench_plan`)."""

from __future__ import annotations

from pathlib import Path

import click

from .. import defaults
from ..errors import UserError
from ..arch import require_engines
from ..models import load_model
from .base import PLAN_ENGINES, cli, parse_tokens, plan_engine, plan_options


def _prompt_ids(spec, prompt, tokens) -> list[int]:
    from ..tokenizer import Tokenizer

    if (prompt is None) == (tokens is None):
        raise UserError("give a prompt with -p TEXT or token ids with --tokens 1,2,3")
    ids = (
        parse_tokens(tokens)
        if tokens is not None
        else Tokenizer.from_gguf(spec.path).encode(prompt)
    )
    if not ids:
        raise UserError("the prompt has no tokens")
    return ids


@cli.command()
@click.argument("model")
@click.option("-p", "--prompt", help="Prompt text.")
@click.option("--tokens", help="Prompt as comma-separated token ids, instead of text.")
@click.option("-n", "--n-predict", default=4, show_default=True, help="Greedy decode steps too.")
@click.option("-c", "--ctx-size", default=defaults.N_CTX, show_default=True)
@click.option("--engine", "engine_name", type=click.Choice(PLAN_ENGINES), default="cuda",
              show_default=True)  # fmt: skip
@plan_options
def diff(model, prompt, tokens, n_predict, ctx_size, engine_name, **plan_args) -> None:
    """The plan engine against the NumPy engine, both fed the prompt and n greedy steps of the
    NumPy engine: each block's largest normwise error, then the logits judged by the bounds of
    the plan's named path (fp32, fp16 GEMM or int8: teacher-forced top-1 with near-ties excused,
    and mean KL; docs/contracts.md, Tolerances). Exits 1 only when a bound fails."""
    from rich.console import Console
    from rich.table import Table

    from ..agreement import PATHS
    from ..diffing import diff_engines
    from ..engine import NumpyEngine

    spec = load_model(model)
    require_engines(spec.arch)  # before any engine or GPU is asked for
    ids = _prompt_ids(spec, prompt, tokens)
    engine, plan = plan_engine(engine_name, spec, ctx_size, plan_args, len(ids), n_predict)
    reference = NumpyEngine(spec, n_ctx=engine.n_ctx)
    bounds = PATHS[engine.path]
    result = diff_engines(engine, reference, spec.hparams.n_layer, ids, n_predict, bounds)
    click.echo(f"{engine_name} vs numpy: {plan['strategy']} plan on the {bounds.path} path, "
               f"{len(ids)} prompt tokens + {n_predict} greedy steps of numpy, teacher-forced")  # fmt: skip
    table = Table()
    for col in ("activation", "max normwise error", ""):
        table.add_column(col)
    first = result.first_above(bounds.normwise)
    for name, err in result.worst.items():
        mark = f"first above {bounds.normwise:g}" if name == first else ""
        table.add_row(name, f"{err:.2e}", mark)
    Console().print(table)
    for line in result.judgement.lines():
        click.echo(line)
    if not result.ok:
        raise SystemExit(1)


@cli.command()
@click.argument("model")
@click.option("-p", "--n-prompt", default=512, show_default=True, help="Prompt tokens (pp).")
@click.option("-n", "--n-gen", default=128, show_default=True, help="Generated tokens (tg).")
@click.option("--depth", default="0", show_default=True, help="Context depths, e.g. 0,4096.")
@click.option("-c", "--ctx-size", type=int, help="Context (default: what the tests need).")
@click.option("--baseline", help="A named placement to compare with on the same engine (fit).")
@click.option("--engine", "engine_name", type=click.Choice(PLAN_ENGINES), default="cuda",
              show_default=True)  # fmt: skip
@click.option("--trace", type=click.Path(dir_okay=False, path_type=Path),
              help="Chrome trace of the plan's runs, and a Gantt PNG next to it.")  # fmt: skip
@click.option("-r", "--repetitions", default=1, show_default=True, help="Runs of each test.")
@click.option("-o", "--output", "output_format", type=click.Choice(("md", "json")), default="md",
              show_default=True, help="json: llama-bench's records (n_prompt, n_gen, avg_ts, "
              "stddev_ts), one list on stdout.")  # fmt: skip
@plan_options
def bench(model, n_prompt, n_gen, depth, ctx_size, baseline, engine_name, trace, repetitions,
          output_format, **plan_args):  # fmt: skip
    """llama-bench for a plan: t/s of each test next to the plan's prediction and the physical
    bound, and the speedup over a --baseline plan run on the same engine and budget."""
    from rich.console import Console
    from rich.table import Table

    from cudarun.bench_plan import run_bench
    from solver.profile import for_devices
    from solver.solve import load_profile

    try:
        depths = sorted({int(d) for d in depth.split(",") if d.strip()})
    except ValueError:
        raise UserError(f"--depth takes comma-separated token counts, not {depth!r}") from None
    spec = load_model(model)
    require_engines(spec.arch)  # before any engine or GPU is asked for
    n_ctx = ctx_size or max(depths) + max(n_prompt, n_gen + 1)
    engine, plan = plan_engine(engine_name, spec, n_ctx, plan_args, n_prompt, n_gen)
    # the stand-in's devices take the profile's GPU, one a budget
    profile = for_devices(load_profile(plan_args["profile_name"]), len(getattr(engine, "budgets", ())))
    if trace:
        engine.trace_events = []
    if repetitions < 1:
        raise UserError("-r takes 1 or more runs")
    rows = run_bench(engine, profile, n_prompt, n_gen, depths, repetitions=repetitions)
    base_rows = None
    if baseline:
        base_args = dict(plan_args, strategy=baseline, plan_path=None, split_mode="layer")
        base_engine, _ = plan_engine(engine_name, spec, n_ctx, base_args, n_prompt, n_gen)
        base_rows = run_bench(base_engine, profile, n_prompt, n_gen, depths,
                              repetitions=repetitions)  # fmt: skip
    if output_format == "json":
        import json

        click.echo(json.dumps([dict(r.llama_bench_record(), engine=engine.name,
                                    model=spec.name, strategy=plan["strategy"]) for r in rows],
                              indent=1))  # fmt: skip
        return
    con = Console()
    where = ("every part on the host" if engine.name == "cpu"
             else "budget " + " + ".join(f"{b / 2**20:.1f}" for b in engine.budgets) + " MiB"
             + (", split by tensors" if engine.shares is not None else ""))  # fmt: skip
    con.print(f"{spec.name}: {plan['strategy']} plan on {engine.name}, {where}")
    table = Table()
    # the ratio of rates, as every other table of measured beside predicted prints it
    cols = ["test", "t/s", "pred t/s", "bound t/s", "meas/pred t/s"]
    moe = spec.arch.moe and engine.name != "cpu"  # the expert bytes each token copied up
    cols += ["expert MiB/token", "pred MiB/token"] if moe else []
    cols += [f"{baseline} t/s", "speedup"] if baseline else []
    for col in cols:
        table.add_column(col, justify="right")
    for i, r in enumerate(rows):
        cells = [r.test, f"{r.tps:.2f}", f"{r.tokens / r.predicted_seconds:.2f}",
                 f"{r.tokens / r.bound_seconds:.2f}", f"{r.predicted_seconds / r.measured_seconds:.2f}"]  # fmt: skip
        if moe:
            cells += [f"{r.expert_nbytes / 2**20:.3f}", f"{r.predicted_expert_nbytes / 2**20:.3f}"]
        if base_rows:
            cells += [f"{base_rows[i].tps:.2f}", f"{r.tps / base_rows[i].tps:.2f}x"]
        table.add_row(*cells)
    con.print(table)
    looked = getattr(engine, "expert_lookups", {})
    if looked.get("chosen"):  # counted over every run above
        con.print(f"expert caches: {looked['resident'] / looked['chosen']:.1%} of the experts "
                  f"chosen were resident when routed; the prefetch had named "
                  f"{looked['predicted'] / looked['chosen']:.1%}")  # fmt: skip
    for line in engine.memory_report() + engine.launch_report(profile.gpus[0].launch_seconds.value):
        con.print(line)
    from cudarun.bench_plan import operation_lines
    from cudarun.counts import report_lines

    for line in report_lines(engine):  # launches and syncs per token, counted and scheduled
        con.print(line)
    for line in operation_lines(engine, profile):  # copies, all-reduces, hops: and predicted
        con.print(line)
    if engine.name == "standin":
        con.print("stand-in device: the times are of the host simulation, not of a GPU")
    if trace:
        from cudarun.trace import overlap_fraction, write_trace

        png = write_trace(engine.trace_events, trace)
        con.print(f"wrote {trace} and {png}; copies under compute: "
                  f"{overlap_fraction(engine.trace_events):.0%} of copy time")  # fmt: skip
