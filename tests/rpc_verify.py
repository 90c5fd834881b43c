"""A plan solved over llama.cpp RPC servers and checked in real llama.cpp: what each family's
verify test does with its own synthetic file."""

from __future__ import annotations

from refengine.spec import load_spec

from .conftest import refengine


def verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, budget: str, ctx: int) -> str:
    """`refengine verify`'s report on `path` solved (--strategy fit, tiers 1 and 512) over two
    RPC servers of budgets `budget`; each step must succeed and every tensor land as planned."""
    rpc = ",".join(rpc_servers[:2])
    profile, plan = tmp_path / "rpc-prof.json", tmp_path / "plan.json"
    r = refengine("profile", "--rpc", rpc, "--cpu-from", "h100", "--quick", "-o", profile)
    assert r.returncode == 0, r.stderr
    r = refengine("solve", path, "--target", "llamacpp", "--rpc", rpc, "--budget", budget,
                  "--profile", profile, "--ctx", str(ctx), "--tiers", "1,512", "--strategy",
                  "fit", "-o", plan)  # fmt: skip
    assert r.returncode == 0, r.stderr
    r = refengine("verify", plan, "--llama-bin", llama_bin)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(load_spec(path).tensors)
    assert f"tensors placed as planned: {n}/{n}" in r.stdout, r.stdout
    return r.stdout
