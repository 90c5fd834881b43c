"""`refengine run`: generate text from a prompt on the NumPy engine or a plan engine
(`refengine.generate`), its timings on stderr."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from .. import defaults
from ..errors import UserError
from ..arch import require_engines
from ..models import load_model
from .base import ENGINES, cli, open_for_writing, parse_tokens, plan_engine, plan_options


@cli.command()
@click.argument("model")
@click.option("-p", "--prompt", multiple=True,
              help="Prompt text; repeat it to continue several prompts together.")  # fmt: skip
@click.option("--prompts", "prompts_file", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="A file of prompts, one a line, continued together.")  # fmt: skip
@click.option("--tokens", help="Prompt as comma-separated token ids, instead of text.")
@click.option(
    "-n",
    "--n-predict",
    default=defaults.N_PREDICT,
    show_default=True,
    help="Tokens to generate (0: only the prompt).",
)
@click.option(
    "-c",
    "--ctx-size",
    default=defaults.N_CTX,
    show_default=True,
    help="Context size in tokens (capped by the model's training context).",
)
@click.option(
    "--engine", "engine_name", type=click.Choice(ENGINES), default=ENGINES[0], show_default=True
)
@click.option("--temp", default=defaults.TEMPERATURE, show_default=True, help="0: greedy.")
@click.option("--top-k", default=defaults.TOP_K, show_default=True)
@click.option("--top-p", default=defaults.TOP_P, show_default=True)
@click.option("--seed", default=defaults.SEED, show_default=True)
@click.option(
    "--dump-logits",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Save float32 logits of every prompt position, [n_prompt, n_vocab], as .npy.",
)
@plan_options
@click.option(
    "--trace", type=click.Path(dir_okay=False, path_type=Path),
    help="Write a Chrome trace of the plan engine's lanes, and a Gantt PNG next to it.",
)  # fmt: skip
def run(
    model, prompt, prompts_file, tokens, n_predict, ctx_size, engine_name, temp, top_k, top_p, seed, dump_logits,
    trace, **plan_args,
) -> None:  # fmt: skip
    """Generate text from a prompt, streaming it as it comes. With --engine cuda (or standin, the
    stand-in device that runs the same executor on the host) it runs a plan: --plan, or the one
    solved for --budget (cached next to the model)."""
    from ..generate import generate, prompt_for
    from ..sampling import Sampler

    texts = list(prompt)
    if prompts_file is not None:
        texts += [line for line in prompts_file.read_text().splitlines() if line.strip()]
    if (not texts) == (tokens is None):
        raise UserError("give a prompt with -p TEXT (or several, or --prompts FILE) or token ids "
                        "with --tokens 1,2,3")  # fmt: skip
    if n_predict < 0:
        raise UserError("-n must be 0 or more")
    spec = load_model(model)
    require_engines(spec.arch)  # before any engine or GPU is asked for
    if len(texts) > 1:
        return _run_together(spec, texts, n_predict, ctx_size, engine_name, temp, top_k, top_p,
                             seed, dump_logits, trace, plan_args)  # fmt: skip
    prompt = texts[0] if texts else None
    ids = parse_tokens(tokens) if tokens is not None else None
    request = prompt_for(spec, prompt, ids, n_predict, ctx_size)
    dump = open_for_writing(dump_logits) if dump_logits is not None else None

    if engine_name == "numpy" and (trace or any(plan_args[k] for k in ("budget", "plan_path"))):
        raise UserError("--budget, --plan and --trace are for the plan engines: add --engine cuda")
    load_seconds = time.perf_counter()
    if engine_name == "numpy":
        from ..engine import NumpyEngine

        engine = NumpyEngine(spec, n_ctx=ctx_size)
    else:
        n_prompt = len(request.ids)
        engine, _ = plan_engine(engine_name, spec, ctx_size, plan_args, n_prompt, n_predict)
    load_seconds = time.perf_counter() - load_seconds
    if trace:
        engine.trace_events = []
    sampler = Sampler(temp, top_k, top_p, seed)
    g = generate(engine, request, n_predict, sampler, sys.stdout, dump)
    n_ids, n_gen = len(request.ids), len(g.tokens)
    click.echo(
        f"[{engine_name}] loaded in {load_seconds:.1f} s; prompt {n_ids} tokens in "
        f"{g.prompt_seconds:.2f} s ({n_ids / g.prompt_seconds:.1f} t/s); generated "
        f"{n_gen} tokens in {g.gen_seconds:.2f} s "
        f"({n_gen / max(g.gen_seconds, 1e-9):.1f} t/s); TTFT {g.prompt_seconds:.3f} s, "
        f"TPS {max(n_gen - 1, 0) / max(g.gen_seconds, 1e-9):.2f}",
        err=True,
    )
    if trace:
        from cudarun.trace import write_trace

        png = write_trace(engine.trace_events, trace)
        click.echo(f"wrote {trace} and {png}", err=True)


def _run_together(spec, texts, n_predict, ctx_size, engine_name, temp, top_k, top_p, seed,
                  dump_logits, trace, plan_args) -> None:  # fmt: skip
    """Several prompts as several sequences of one engine, decoded together; each continuation
    printed after its prompt once all are done. -c is the context of each prompt."""
    from ..generate import generate_together, prompt_for
    from ..sampling import Sampler

    if dump_logits or trace:
        raise UserError("--dump-logits and --trace take one prompt")
    requests = [prompt_for(spec, t, None, n_predict, ctx_size) for t in texts]
    n = len(requests)
    n_ctx = n * min(ctx_size, spec.hparams.n_ctx_train)  # the total, each sequence its share
    load_seconds = time.perf_counter()
    if engine_name == "numpy":
        if any(plan_args[k] for k in ("budget", "plan_path")):
            raise UserError("--budget and --plan are for the plan engines: add --engine cuda")
        from ..engine import NumpyEngine

        engine = NumpyEngine(spec, n_ctx=n_ctx, n_seq=n)
    else:
        longest = max(len(r.ids) for r in requests)
        engine, _ = plan_engine(engine_name, spec, n_ctx, dict(plan_args, n_seq=n), longest,
                                n_predict)  # fmt: skip
    load_seconds = time.perf_counter() - load_seconds
    samplers = [Sampler(temp, top_k, top_p, seed + i) for i in range(n)]
    g = generate_together(engine, requests, n_predict, samplers)
    for i, (r, toks) in enumerate(zip(requests, g.tokens)):
        click.echo(f"[{i}] {r.text}{r.tokenizer.decode(toks) if r.tokenizer else toks}")
    n_ids = sum(len(r.ids) for r in requests)
    n_gen = sum(len(t) for t in g.tokens)
    click.echo(
        f"[{engine_name}] {n} sequences: loaded in {load_seconds:.1f} s; prompts {n_ids} tokens "
        f"in {g.prompt_seconds:.2f} s ({n_ids / g.prompt_seconds:.1f} t/s); generated {n_gen} "
        f"tokens in {g.steps} steps, {g.gen_seconds:.2f} s "
        f"({n_gen / max(g.gen_seconds, 1e-9):.1f} t/s)",
        err=True,
    )
