"""Our decode's attention priced beside the cpu engine's: for each model, one engine decoding at
depth 4 and another at a depth, token about, and the cost model's figures for the same two steps
from a profile; the difference between the depths is the attention's (and the only term of the
cost model that depends on depth). A check of `decode_score_seconds` and the serial threshold
inside real decodes, where the profile measures it on twins.

    python scripts/decode_attention_check.py --profile P.json smollm2-135m:4096 FILE.gguf:2048 ...
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cudarun.cpu_engine import CpuEngine  # noqa: E402
from cudarun.measure_cpu import _median_seconds  # noqa: E402
from refengine.models import load_model, resolve_model  # noqa: E402
from solver.cpu_tests import cpu_cost_model, generation_seconds  # noqa: E402
from solver.solve import load_profile  # noqa: E402

SHALLOW = 4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16, help="decode steps timed at each depth")
    ap.add_argument("models", nargs="+", help="MODEL:DEPTH")
    a = ap.parse_args()
    profile = load_profile(a.profile)
    print(f"decode step, ms: measured (median of {a.tokens}, the depths alternated) and predicted "
          f"({a.profile}), {a.threads} threads")  # fmt: skip
    print(f"{'model':24s} {'depth':>6s} {'measured':>17s} {'predicted':>17s} "
          f"{'attention meas/pred':>20s}")  # fmt: skip
    for arg in a.models:
        name, depth = arg.rsplit(":", 1)
        depth = int(depth)
        spec = load_model(name if name.endswith(".gguf") else str(resolve_model(name)))
        n_ctx = depth + a.tokens + 8
        engines = [CpuEngine(spec, threads=a.threads, n_ctx=n_ctx) for _ in range(2)]
        for engine, fill in zip(engines, (SHALLOW, depth)):
            engine.warm_up()
            engine.prefill(np.arange(fill) % 1000 + 10)
        shallow, deep = _median_seconds([lambda: engines[0].decode(7),
                                         lambda: engines[1].decode(7)], a.tokens)  # fmt: skip
        cm = cpu_cost_model(spec, profile, "refengine", a.threads, n_ctx)
        p_shallow, p_deep = (generation_seconds(cm, 1, d) for d in (SHALLOW, depth))
        print(f"{Path(name).stem:24s} {depth:6d} {1e3 * shallow:7.2f} -> {1e3 * deep:6.2f} "
              f"{1e3 * p_shallow:7.2f} -> {1e3 * p_deep:6.2f} "
              f"{(deep - shallow) / (p_deep - p_shallow):20.2f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
