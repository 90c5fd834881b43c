"""The expert cache's table (issue 21): bytes a decode token copies, counted by the stand-in
engine, beside the cost model's prediction, for caches of 0, k, 2k and E/2 slots a layer (and
2k, E/2 with prefetch), on synthetic qwen3moe models with E = 64 and 128, k = 8.

The plan is the acceptance test's (tests/test_expert_cache.py): the prompt's tier streams the
stacks whole, tier 1 routes them with the cache. Predictions: from `profile-routing`'s replay of
the same prompt and generation ("this prompt", what the test holds to 5%), of another prompt (how
well a profile carries over), and under uniform routing (no profile).

    .venv/bin/python -m examples.expert_cache
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from cudarun.standin_engine import StandInEngine
from cudarun.routing_profile import profile_routing
from refengine.spec import load_spec
from refengine.synthetic import write_synthetic
from tests.test_expert_cache import DECODE, PROMPT, cache_plan
from tests.test_routed import MOE


def measure(spec, prompt, slots, prefetch, routing):
    engine = StandInEngine(spec, cache_plan(spec, slots, prefetch, routing)[0], seed=0)
    logits = engine.prefill(prompt)
    before = engine.expert_copied_nbytes
    for _ in range(DECODE):
        logits = engine.decode(int(np.argmax(logits)))
    return (engine.expert_copied_nbytes - before) / DECODE, engine.expert_lookups


def main() -> None:
    con = Console(width=140)
    k = MOE.n_expert_used
    for n_expert in (64, 128):
        config = dataclasses.replace(MOE, n_expert=n_expert, n_layer=4)
        spec = load_spec(str(write_synthetic(Path(tempfile.mkdtemp()) / "m.gguf", config)))
        rng = np.random.default_rng(7)
        prompt, other = ([int(t) for t in rng.integers(0, spec.hparams.n_vocab, PROMPT)]
                         for _ in range(2))  # fmt: skip
        this, elsewhere = (profile_routing(spec, [p], DECODE) for p in (prompt, other))
        t = Table(title=f"synthetic qwen3moe, E={n_expert}, k={k}, 4 layers: expert KiB a decode "
                        f"token copies ({DECODE} greedy tokens after a {PROMPT}-token prompt)")  # fmt: skip
        for col in ("cache slots", "counted", "pred: this prompt", "counted/pred",
                    "pred: other prompt", "pred: uniform", "resident", "prefetch named"):  # fmt: skip
            t.add_column(col, justify="right")
        caches = [(0, False), (k, False), (2 * k, False), (n_expert // 2, False), (2 * k, True),
                  (n_expert // 2, True)]  # fmt: skip
        for slots, prefetch in caches:
            counted, looked = measure(spec, prompt, slots, prefetch, this)
            pred = cache_plan(spec, slots, prefetch, this)[1]
            pred_other = cache_plan(spec, slots, prefetch, elsewhere)[1]
            uniform = "-" if prefetch else f"{cache_plan(spec, slots)[1] / 1024:.1f}"
            chosen = looked["chosen"] or 1
            t.add_row(f"{slots}{'p' if prefetch else ''}", f"{counted / 1024:.1f}",
                      f"{pred / 1024:.1f}", f"{counted / pred:.3f}", f"{pred_other / 1024:.1f}",
                      uniform, f"{looked['resident'] / chosen:.1%}",
                      f"{looked['predicted'] / chosen:.1%}" if prefetch else "-")  # fmt: skip
        con.print(t)


if __name__ == "__main__":
    main()
