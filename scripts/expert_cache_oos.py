"""The expert cache's prediction out of sample (issue 33): a routing profile measured by
`refengine profile-routing` on prompt set A prices the cache (the cost model's bytes a decode
token copies, as `solve --routing FILE` prices it) for prompts it never saw — A' (other prompts of
the same domain) and B (another domain) — held against the bytes the stand-in engine counts on
them, beside the uniform-routing price (no profile).

The models are synthetic qwen3moe files with planted routing skew (`SyntheticConfig`'s
`routing_domains`): the token ids split into 4 domains, each preferring its own E/4 experts in
every layer. Prompts are PROMPT random ids of one domain, each followed by DECODE greedy tokens;
the plan is tests/test_expert_cache.py's (the prompt's tier streams the stacks whole, tier 1
routes them through a cache of each size, empty at the switch).

    .venv/bin/python scripts/expert_cache_oos.py [--prompts 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from cudarun.routing_profile import profile_routing  # noqa: E402
from refengine.spec import load_spec  # noqa: E402
from refengine.synthetic import domain_experts, write_synthetic  # noqa: E402
from solver.routing import load_routing  # noqa: E402
from tests.test_expert_cache import (  # noqa: E402
    DECODE, PLANTED, PROMPT, cache_plan, counted_nbytes, domain_prompts,
)  # fmt: skip


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def profile_with_the_command(model: Path, prompts: list[list[int]], work: Path):
    """`refengine profile-routing MODEL -p A.txt --ids -n DECODE -o A.routing.json`, read back as
    `solve --routing` reads it; (its stats, the table the command printed)."""
    lines = work / "A.txt"
    lines.write_text("".join(",".join(map(str, p)) + "\n" for p in prompts))
    out = work / "A.routing.json"
    cmd = [str(ROOT / ".venv/bin/refengine"), "profile-routing", str(model), "-p", str(lines),
           "--ids", "-n", str(DECODE), "-o", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, check=True,
                         env={**os.environ, "COLUMNS": "120"})  # fmt: skip
    return load_routing(out, load_spec(str(model))), run.stdout


def error(predicted: float, counted: float) -> str:
    return f"{predicted / counted - 1:+.1%}" if counted else "-"


def measure(con: Console, n_expert: int, n_prompts: int) -> None:
    cfg = dataclasses.replace(PLANTED, n_expert=n_expert, n_layer=4)
    work = Path(tempfile.mkdtemp())
    model = write_synthetic(work / f"planted-e{n_expert}.gguf", cfg)
    spec = load_spec(str(model))
    a, a2 = domain_prompts(cfg, 0, n_prompts, seed=1), domain_prompts(cfg, 0, n_prompts, seed=2)
    b = domain_prompts(cfg, 1, n_prompts, seed=3)
    assert not {tuple(p) for p in a} & {tuple(p) for p in a2}, "A' must be other prompts"
    stats, printed = profile_with_the_command(model, a, work)
    con.print(f"$ refengine profile-routing planted-e{n_expert}.gguf -p A.txt --ids -n {DECODE}")
    con.print(printed.rstrip())
    # the skew, as each set's own profile sees it: share of the choices on each domain's experts
    own = {"A": stats, "A'": profile_routing(spec, a2, DECODE),
           "B": profile_routing(spec, b, DECODE)}  # fmt: skip
    each = len(domain_experts(cfg, 0))
    shares = Table(title=f"E={n_expert}: per layer, share of the routers' choices on domain 0's / "
                         f"domain 1's experts ({each} each; no skew: 25%)")  # fmt: skip
    shares.add_column("prompt set", justify="left")
    for il in range(cfg.n_layer):
        shares.add_column(f"layer {il}", justify="right")
    for name, s in own.items():
        freq = np.array(s.frequency)
        row = [f"{freq[il, domain_experts(cfg, 0)].sum():.0%} / "
               f"{freq[il, domain_experts(cfg, 1)].sum():.0%}"
               for il in range(cfg.n_layer)]  # fmt: skip
        shares.add_row(name, *row)
    con.print(shares)

    k = cfg.n_expert_used
    t = Table(title=f"synthetic qwen3moe with planted skew, E={n_expert}, k={k}, 4 layers: expert "
                    f"KiB a decode token copies, predicted from A's profile, counted on A' and B "
                    f"({n_prompts} prompts a set, {PROMPT} ids + {DECODE} greedy tokens each); "
                    "error = predicted / counted - 1")  # fmt: skip
    for col in ("cache slots", "pred: A's profile", "pred: uniform", "A' counted", "A' error",
                "A' uniform err", "B counted", "B error", "B uniform err"):  # fmt: skip
        t.add_column(col, justify="right")
    caches = [(0, False), (n_expert // 8, False), (n_expert // 4, False), (n_expert // 2, False),
              (n_expert // 8, True), (n_expert // 4, True), (n_expert // 2, True)]  # fmt: skip
    for slots, prefetch in caches:
        predicted = cache_plan(spec, slots, prefetch, stats)[1]
        # uniform routing prices no prefetch (solve asks for a profile before it plans one)
        uniform = None if prefetch else cache_plan(spec, slots)[1]
        on_a2 = counted_nbytes(spec, a2, slots, prefetch, stats)
        on_b = counted_nbytes(spec, b, slots, prefetch, stats)
        t.add_row(f"{slots}{'p' if prefetch else ''}", f"{predicted / 1024:.1f}",
                  "-" if uniform is None else f"{uniform / 1024:.1f}",
                  f"{on_a2 / 1024:.1f}", error(predicted, on_a2),
                  "-" if uniform is None else error(uniform, on_a2),
                  f"{on_b / 1024:.1f}", error(predicted, on_b),
                  "-" if uniform is None else error(uniform, on_b))  # fmt: skip
    con.print(t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="prompts in each of A, A' and B")
    ap.add_argument("--out", type=Path, help="also write the output here")
    args = ap.parse_args()
    buf = io.StringIO()
    con = Console(width=150, record=True, file=buf if args.out else None)
    con.print(f"$ .venv/bin/python scripts/expert_cache_oos.py --prompts {args.prompts}   "
              f"# {date.today()}, stand-in engine (host), {cpu_name()}, "
              f"{len(os.sched_getaffinity(0))} cores")  # fmt: skip
    for n_expert in (64, 128):
        measure(con, n_expert, args.prompts)
    if args.out:
        args.out.write_text(buf.getvalue())
        print(buf.getvalue(), end="")


if __name__ == "__main__":
    main()
