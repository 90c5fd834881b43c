"""From the command line's words to a running plan engine: the plan (given, cached next to the
model under its fingerprint, or solved now) and the engine that executes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from refengine import defaults
from refengine.errors import UserError
from refengine.spec import ModelSpec

PLAN_ENGINES = ("cpu", "cuda", "standin")


def default_budget_bytes(engine: str) -> int:
    """CONTRACTS.md: no budget given, free memory minus llama.cpp's 1024 MiB margin."""
    if engine != "cuda":
        raise UserError("the stand-in device has no memory of its own to measure; give --budget")
    from solver.budget import LLAMACPP_MARGIN_BYTES

    from . import driver

    driver.init()
    free, _ = driver.mem_info()
    return free - LLAMACPP_MARGIN_BYTES


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
    say=print,
) -> dict:
    """The plan to run: `plan_path`, or the plan cached under the fingerprint of this request
    (model, context, KV type, threads, profile, budget, tiers), or a new one, solved and cached."""
    from solver import budget as B
    from solver.cost import Workload
    from solver.plan import fingerprint, fingerprint_hash, load_plan
    from solver.solve import load_profile, solve_plan

    if engine == "cuda":
        from .cuda_engine import require_gpu

        require_gpu()
    if plan_path is not None:
        return load_plan(plan_path)
    prof = load_profile(profile_name)
    budgets = B.apply_reserve(
        B.parse_budget(budget) if budget else [default_budget_bytes(engine)], reserve
    )
    n_ctx = min(n_ctx, spec.hparams.n_ctx_train)
    tier_list = B.parse_tiers(tiers) if tiers else B.default_tiers(n_ctx, 1)
    w = Workload(
        n_ctx=n_ctx,
        prompt_tokens=max(1, min(prompt_tokens, n_ctx - gen_tokens)),
        gen_tokens=gen_tokens,
        threads=defaults.THREADS or prof.cpu.threads,
    )
    fp_hash = fingerprint_hash(fingerprint(spec, w, prof.name, budgets, tier_list))
    cached = cache_path(spec, fp_hash + (f".{strategy}" if strategy else ""))
    if cached.is_file():
        say(f"reusing the plan {cached}")
        return load_plan(cached)
    plan = solve_plan(spec, prof, w, tier_list, budgets, strategy)
    cached.write_text(json.dumps(plan, indent=1) + "\n")
    say(f"solved {plan['strategy']} for {budgets[0] / 2**20:.1f} MiB; plan cached at {cached}")
    return plan


def make_engine(name: str, spec: ModelSpec, plan: dict, threads: int = 0, **kw):
    """The plan engine, warmed up: kernels compiled and every tier prepared."""
    if name == "cpu":
        from .cpu_engine import CpuEngine as Engine
    elif name == "standin":
        from .standin_engine import StandInEngine as Engine
    elif name == "cuda":
        from .cuda_engine import CudaEngine as Engine
    else:
        raise UserError(f"unknown engine {name!r} (known: numpy, {', '.join(PLAN_ENGINES)})")
    engine = Engine(spec, plan, threads=threads, progress=True, **kw)
    engine.warm_up()
    return engine
