"""From the command line's words to a running plan engine: the plan (given, cached next to the
model under its fingerprint, or solved now) and the engine that executes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from refengine.errors import UserError
from refengine.spec import ModelSpec

PLAN_ENGINES = ("cpu", "cuda", "standin")


def measure_free(engine: str):
    """How the engine's free device memory is measured (docs/contracts.md: no budget given, free
    memory less llama.cpp's margin; `solver.budget.plan_budgets` takes the margin off)."""
    if engine != "cuda":

        def no_memory() -> int:
            raise UserError(
                "the stand-in device has no memory of its own to measure; give --budget"
            )

        return no_memory

    def free() -> int:
        from . import driver

        driver.init()
        return driver.mem_info()[0]

    return free


def cache_path(spec: ModelSpec, fp_hash: str) -> Path:
    """Next to the model when its folder is writable, else in the user's cache."""
    beside = spec.path.with_name(f"{spec.path.name}.{fp_hash}.plan.json")
    if os.access(beside.parent, os.W_OK):
        return beside
    home = Path.home() / ".cache" / "refengine" / "plans"
    home.mkdir(parents=True, exist_ok=True)
    return home / beside.name


def plan_for_run(
    spec: ModelSpec,
    engine: str,
    plan_path: Path | None,
    budget: str | None,
    reserve: str,
    profile_name: str,
    n_ctx: int,
    tiers: str | None,
    strategy: str | None,
    prompt_tokens: int,
    gen_tokens: int,
    threads: int = 0,
    say=print,
    users: int = 1,
    unified: bool = False,
    split_mode: str = "layer",
) -> dict:
    """The plan to run: `plan_path`, or the plan cached under the fingerprint of this request
    (model, context, KV type, threads, users, profile, budget, tiers, split mode), or a new one,
    solved and cached. `threads` 0: the profile's CPU threads."""
    from solver import budget as B
    from solver.cost import Workload
    from solver.plan import fingerprint, fingerprint_hash, load_plan
    from solver.profile import for_devices
    from solver.solve import load_profile, solve_plan

    if engine == "cuda":
        from .cuda_engine import require_gpu

        require_gpu()
    if plan_path is not None:
        return _told(load_plan(plan_path), say)
    prof = load_profile(profile_name)
    if engine in ("standin", "cuda") and budget:  # the stand-in's devices and the GPU's virtual
        prof = for_devices(prof, len(B.parse_budget(budget)))  # ones: the profile's GPU a budget
    n_ctx = min(n_ctx, spec.hparams.n_ctx_train)
    tier_list = B.parse_tiers(tiers) if tiers else B.default_tiers(n_ctx, users)
    w = Workload(
        n_ctx=n_ctx,
        prompt_tokens=max(1, min(prompt_tokens, n_ctx - gen_tokens)),
        gen_tokens=gen_tokens,
        threads=threads or prof.cpu.threads,
        users=users,
        unified=unified,
    )
    budgets = B.plan_budgets(spec, w, tier_list, budget, reserve, prof,
                             measure_free=measure_free(engine))  # fmt: skip
    fp_hash = fingerprint_hash(
        fingerprint(spec, w, prof.name, budgets.bytes, tier_list, split_mode)
    )
    cached = cache_path(spec, fp_hash + (f".{strategy}" if strategy else ""))
    if cached.is_file():
        say(f"reusing the plan {cached}")
        return _told(load_plan(cached), say)
    # on a GPU, cuBLAS's handle and our kernels' code come out of the budget too
    from .cuda_device import simulated

    runtime = B.CUDA_RUNTIME_NBYTES if engine == "cuda" and not simulated() else 0
    plan = solve_plan(spec, prof, w, budgets.tiers, budgets.bytes, strategy,
                      split_mode=None if split_mode == "layer" else split_mode,
                      runtime_nbytes=runtime)  # fmt: skip
    # written whole, then renamed: another process reading the cache never sees half a plan
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps(plan, indent=1) + "\n")
    partial.replace(cached)
    n = len(budgets.bytes)
    split = f", split by {split_mode}s over {n} devices" if n > 1 else ""
    mib = " + ".join(f"{b / 2**20:.1f}" for b in budgets.bytes)
    say(f"solved {plan['strategy']} for {mib} MiB{split}; plan cached at {cached}")
    return _told(plan, say)


def _told(plan: dict, say) -> dict:
    """The plan, once each device it leaves out is named in a line."""
    from solver.budget import excluded_lines

    for line in excluded_lines(plan.get("solver", {}).get("excluded", {}),
                               bool(plan.get("shares"))):  # fmt: skip
        say(line)
    return plan


def make_engine(name: str, spec: ModelSpec, plan: dict, threads: int = 0, n_seq: int = 1,
                unified: bool = False, **kw):  # fmt: skip
    """The plan engine, warmed up: kernels compiled and every tier prepared."""
    if name == "cpu":
        from .cpu_engine import CpuEngine as Engine
    elif name == "standin":
        from .standin_engine import StandInEngine as Engine
    elif name == "cuda":
        from .cuda_engine import CudaEngine as Engine
    else:
        raise UserError(f"unknown engine {name!r} (known: numpy, {', '.join(PLAN_ENGINES)})")
    engine = Engine(spec, plan, threads=threads, progress=True, n_seq=n_seq, unified=unified, **kw)
    engine.warm_up()
    return engine


def plan_engine(
    name: str,
    spec: ModelSpec,
    n_ctx: int,
    n_prompt: int,
    n_predict: int,
    plan_path: Path | None,
    budget: str | None,
    reserve: str,
    profile_name: str,
    strategy: str | None,
    tiers: str | None,
    threads: int,
    say=print,
    n_seq: int = 1,
    unified: bool = False,
    split_mode: str = "layer",
):
    """(a plan engine, its plan) for the words of `run`, `diff` and `bench`: the cpu engine without
    a plan runs every part on the host; otherwise `plan_for_run`'s plan on `make_engine`'s engine.
    `n_seq` sequences (docs/sequences.md), sharing one cache when `unified`."""
    if name == "cpu" and plan_path is None:
        if budget is not None or split_mode != "layer":
            raise UserError("--engine cpu runs every part on the host: --budget and --split-mode "
                            "do not apply (--plan takes a plan's context and tiers)")  # fmt: skip
        from solver import budget as B

        from .cpu_engine import CpuEngine

        tier_list = B.parse_tiers(tiers) if tiers else None
        engine = CpuEngine(spec, threads=threads, n_ctx=n_ctx, tiers=tier_list, n_seq=n_seq,
                           unified=unified)  # fmt: skip
        engine.warm_up()
        return engine, {"strategy": "all-host"}
    plan = plan_for_run(spec, name, plan_path, budget, reserve, profile_name, n_ctx, tiers,
                        strategy, n_prompt, n_predict, threads, say, n_seq, unified,
                        split_mode)  # fmt: skip
    return make_engine(name, spec, plan, threads, n_seq=n_seq, unified=unified), plan
