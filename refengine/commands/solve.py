"""`refengine solve` and `refengine export`: a plan for a model, a machine and a budget, explained
against every named strategy (`solver.solve.solve_request`); a plan written out as llama.cpp flags
or a pshard registry (`solver.export.export_plan`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import click

from .. import defaults
from ..errors import UserError
from ..models import load_model_or_shape, shape_argument
from .base import THREADS_CHECK, USERS_CHECK, cli, open_for_writing


@cli.command()
@click.argument("model", required=False)
@click.option("--arch", help="Spec-only model: architecture in the shape table (shapes.json).")
@click.option("--params", help="Spec-only model: size in the shape table, e.g. 70B or 30B-A3B.")
@click.option("--qtype", help="Spec-only model: matrix type, e.g. Q4_K_M (llama.cpp's mix), Q8_0.")
@click.option(
    "--budget",
    help="Device memory we may use: 12000 (MiB), 12GiB. Default: the "
    "profile's GPU memory minus 1024 MiB.",
)
@click.option(
    "--reserve",
    default="0",
    show_default=True,
    help="Subtracted from the budget: one size for every device, or one per device.",
)
@click.option("--profile", "profile_name", help="A profile file, or a shipped profile's name.")
@click.option("--ctx", "n_ctx", default=defaults.N_CTX, show_default=True, help="Context, tokens.")
@click.option("--tiers", help="Tokens per ubatch to plan for, e.g. 1,16,512 (default: PSHARD's).")
@click.option("--users", default=defaults.USERS, show_default=True, callback=USERS_CHECK)
@click.option("--kv-unified", "kv_unified", is_flag=True,
              help="The users share one KV cache, attention over all of it masked (llama.cpp's "
              "-kvu; a llamacpp plan always does); default: a KV stream per user.")  # fmt: skip
@click.option("--prompt-tokens", type=int, help="Default: ctx - gen tokens.")
@click.option("--gen-tokens", default=defaults.GEN_TOKENS, show_default=True)
@click.option("--strategy", help="Use a named strategy instead of the optimizer.")
@click.option(
    "--target",
    type=click.Choice(["refengine", "llamacpp"]),
    default="refengine",
    show_default=True,
    help="llamacpp: the best static placement llama.cpp's flags can express, "
    "under llama.cpp's own execution (op-offload, its KV rules); exportable as flags.",
)
@click.option(
    "--split-mode",
    type=click.Choice(["layer", "tensor"]),
    help="Over several GPUs: split by layers or split every matrix (--target llamacpp: llama.cpp's "
    "-sm layer or -sm tensor, default the faster; --target refengine: layer unless asked).",
)
@click.option(
    "--objective", type=click.Choice(["e2e", "tps", "ttft"]), default="e2e", show_default=True
)
@click.option(
    "--kv-type", type=click.Choice(["f16", "q8_0"]), default=defaults.KV_TYPE, show_default=True
)
@click.option(
    "--fa",
    type=click.Choice(["on", "off"]),
    default="on" if defaults.FLASH_ATTN else "off",
    show_default=True,
)
@click.option(
    "--threads",
    default=defaults.THREADS,
    show_default=True,
    callback=THREADS_CHECK,
    help="0: the profile's.",
)
@click.option(
    "--time-limit",
    default=6.0,
    show_default=True,
    help="Solver effort, in CP-SAT's deterministic seconds.",
)
@click.option(
    "--expert-cache",
    default="auto",
    show_default=True,
    help="MoE, our runtime: experts each routed layer keeps resident, e.g. 16 (16p: prefetched "
    "ahead of the router); auto: the planner's choice.",
)
@click.option(
    "--routing",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="MoE: the routing measured by `refengine profile-routing` (default: uniform routing).",
)
@click.option(
    "--rpc",
    metavar="HOST:PORT,...",
    help="--target llamacpp: plan over these llama.cpp RPC servers, measured into the profile by "
    "`refengine profile --rpc`: the profile's local GPUs first, then these, one budget each.",
)
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path))
def solve(
    model,
    arch,
    params,
    qtype,
    budget,
    reserve,
    profile_name,
    n_ctx,
    tiers,
    users,
    kv_unified,
    prompt_tokens,
    gen_tokens,
    strategy,
    target,
    split_mode,
    objective,
    kv_type,
    fa,
    threads,
    time_limit,
    expert_cache,
    routing,
    rpc,
    output,
) -> None:
    """Place every tensor of MODEL (a GGUF, a known name, or a spec-only shape such as
    llama3-70b or llama3-70b:Q4_K_M; or --arch llama --params 70B --qtype Q4_K_M) for each tier,
    and compare with llama.cpp's --fit and pshard's strategies."""
    from rich.console import Console
    from rich.table import Table

    from solver.budget import excluded_lines
    from solver.groups import tensor_groups
    from solver.plan import plan_json
    from solver.solve import load_profile, request_workload, solve_request, summarize
    from solver.tensor_split import tensor_split_nbytes
    from solver.usage import device_usage

    spec = load_model_or_shape(shape_argument(model, arch, params, qtype))
    prof = load_profile(profile_name)
    if rpc is not None:
        prof, split_mode = _on_rpc(prof, rpc, target, split_mode, budget)
    w = request_workload(prof, n_ctx, users, prompt_tokens, gen_tokens, kv_type, fa == "on",
                         threads, kv_unified)  # fmt: skip
    if routing is not None:
        from solver.routing import load_routing

        w = dataclasses.replace(w, routing=load_routing(routing, spec))
    solved = solve_request(spec, prof, w, tiers, budget, reserve, objective, strategy, time_limit,
                           target, split_mode, expert_cache)  # fmt: skip
    budgets, chosen, facts = solved.budgets.bytes, solved.chosen, solved.facts
    from solver.profile import rpc_endpoints
    from solver.targets import traits

    endpoints = rpc_endpoints(prof, len(budgets))
    if endpoints and not traits(target).llamacpp_flags:
        raise UserError(
            "the plan's devices include llama.cpp RPC servers, which only llama.cpp drives: "
            "solve with --target llamacpp (or budget the local GPUs only)"
        )
    con = Console()
    con.print(
        f"[bold]{spec.name}[/] on {prof.name}: budget "
        f"{' + '.join(f'{b / 2**30:.2f}' for b in budgets)} GiB, "
        f"ctx {n_ctx}, prompt {w.prompt_tokens}, generate {gen_tokens}, users {users}"
    )
    if spec.arch.generic:
        from refengine.generic import generic_note

        con.print(generic_note(spec.arch.name), soft_wrap=True)
    groups = tensor_groups(spec)
    t = Table(title=f"plan: {chosen.name}")
    for col in ("tier", "placement", "ubatch s", "bound"):
        t.add_column(col)
    mem = Table(title="device memory, GiB")
    for col in ("tier", "GPU", "weights", "scratch", "KV", "workspace", "total", "budget"):
        mem.add_column(col)
    for tier, place in sorted(chosen.tiers.items()) if chosen.split_mode == "layer" else ():
        terms = chosen.prediction.per_tier.get(tier, {})
        first = terms[min(terms)] if terms else None
        t.add_row(
            str(tier),
            summarize(spec, place),
            f"{first.total:.4f}" if first else "-",
            first.bound if first else "-",
        )
        for d, b in enumerate(budgets):
            u = device_usage(spec, groups, place, tier, w, chosen.target, d)
            mem.add_row(
                str(tier),
                str(d),
                *(f"{x / 2**30:.2f}" for x in (u.weights, u.scratch, u.kv, u.compute, u.total, b)),
            )
    if chosen.split_mode == "layer":
        con.print(t)
        con.print(mem)
    elif chosen.shares is not None:
        con.print("plan: tensor split, every layer and the head split over the GPUs by shares, "
                  "two sums a layer through host memory")  # fmt: skip
        _print_shares(con, spec, w, chosen.shares, max(chosen.tiers), budgets)
    else:
        need = tensor_split_nbytes(spec, w, max(chosen.tiers), len(budgets))
        con.print(
            f"plan: tensor split (-sm tensor), every matrix and all KV split over "
            f"{len(budgets)} GPUs: {need / 2**30:.2f} GiB on each"
        )
    for line in excluded_lines(facts.get("excluded", {}), chosen.shares is not None):
        con.print(line)
    if solved.budgets.dropped:
        con.print(
            f"not viable (their workspace alone exceeds the budget): tiers {solved.budgets.dropped}"
        )
    c = Table(title="predicted, same cost model")
    for col in ("placement", "TTFT s", "TPS", "end-to-end s", "vs chosen"):
        c.add_column(col)
    for o in [chosen, *solved.baselines]:
        p = o.prediction
        c.add_row(
            o.name,
            f"{p.ttft_seconds:.2f}",
            f"{p.tps:.2f}",
            f"{p.e2e_seconds:.2f}",
            f"{p.e2e_seconds / chosen.prediction.e2e_seconds:.2f}x",
        )
    con.print(c)
    if facts.get("status"):
        con.print(
            f"solver: {facts['status']}, gap {facts['gap']:.1%}, "
            f"{facts['wall_seconds']:.1f} s, warm start {facts['warm_start']}, prompt in "
            f"ubatches of {facts['prefill_ubatch']}"
        )
    if output:
        doc = plan_json(
            spec,
            w,
            prof.name,
            budgets,
            chosen.tiers,
            chosen.prediction,
            chosen.name,
            chosen.target,
            facts,
            facts.get("not_needed", False),
            chosen.split_mode,
            chosen.shares,
            endpoints,
        )
        out = open_for_writing(output)
        with out:
            out.write((json.dumps(doc, indent=1) + "\n").encode())
        con.print(f"wrote {output}")


def _on_rpc(prof, rpc: str, target: str, split_mode: str | None, budget: str | None):
    """(the profile over its local GPUs and the RPC servers `rpc` names, in llama.cpp's order;
    the split mode) for `solve --rpc`, or one line saying what the user got wrong."""
    from cudarun.rpc_client import parse_endpoints
    from solver.budget import parse_budget
    from solver.profile import local_gpus, on_rpc
    from solver.targets import traits

    endpoints = parse_endpoints(rpc)
    if not traits(target).llamacpp_flags:
        raise UserError("--rpc plans for llama.cpp's RPC devices: add --target llamacpp")
    if split_mode == "tensor":
        raise UserError("--rpc plans split by layers (llama.cpp's -sm layer over RPC servers)")
    prof = on_rpc(prof, endpoints)
    n_local = len(local_gpus(prof))
    if budget is not None and len(parse_budget(budget)) != len(prof.gpus):
        raise UserError(
            f"--budget gives {len(parse_budget(budget))} budget(s) for {len(prof.gpus)} "
            f"device(s): one each, the profile's {n_local} local GPU(s) first, then the "
            f"{len(endpoints)} RPC server(s) in --rpc's order"
        )
    return prof, "layer"


def _print_shares(con, spec, w, shares, tier: int, budgets: list[int]) -> None:
    from rich.table import Table

    from solver.tensor_split import device_nbytes

    t = Table(title=f"shares (ubatch {tier}), MiB")
    ffn = "ff_exp" if spec.arch.moe else "ff"
    for col in ("GPU", "query heads", "expert rows" if spec.arch.moe else "FFN rows",
                "vocab rows", "total", "budget"):  # fmt: skip
        t.add_column(col)
    for d, b in enumerate(budgets):
        ranges = (f"{hi - lo} [{lo}, {hi})" for lo, hi in
                  (shares.heads[d], getattr(shares, ffn)[d], shares.vocab[d]))  # fmt: skip
        total = device_nbytes(spec, w, tier, shares, d)
        t.add_row(str(d), *ranges, f"{total / 2**20:.1f}", f"{b / 2**20:.1f}")
    con.print(t)


@cli.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["llamacpp", "llama-bench", "pshard-registry"]),
    default="llamacpp",
    show_default=True,
)
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    help="pshard-registry: where to write (default: next to the model).",
)
def export(plan_path: Path, fmt: str, output: Path | None) -> None:
    """Print a plan as a llama.cpp command (llama-server's, or llama-bench's flags for the same
    placement), or write it as a pshard registry."""
    from solver.export import export_plan, placeholder_note
    from solver.plan import load_plan, plan_model

    d = load_plan(plan_path)
    spec = load_model_or_shape(plan_model(d))
    text = export_plan(d, spec, fmt)
    if fmt != "pshard-registry":
        click.echo(text)
        if note := placeholder_note(spec):
            click.echo(note, err=True)
        return
    if output is None:
        if spec.path is None:
            raise UserError("a spec-only plan has no model file to write next to; pass -o FILE")
        output = Path(str(spec.path) + ".tensor_overrides.pshard_registry")
    with open_for_writing(output) as f:
        f.write(text.encode())
    click.echo(f"wrote {output}")
