"""The cost model against measurements no one here made: predict llama.cpp's --fit baseline where
the seeds measured it, and print predicted beside measured.

    .venv/bin/python examples/compare_seeds.py

- Seed 000 (RTX 5080 16 GB + Xeon w5-3425): "Base TTFT" and "Base TPS" of Qwen3-32B-Q4 and
  Llama3-70B-Q4, single user, generation 200 tokens, the prompt filling the rest of the context.
- Seed 001 / issue 8 (RTX 4090 + EPYC 7742): a 35B-A3B Q8_0 MoE, 346-token prompt, 200 generated
  tokens: llama.cpp 525 t/s prompt, 43.1 t/s generation; pshard 213 / 14.8.
The profiles in examples/profiles/ were committed before this script first ran. Model shapes are
the real hyperparameters (refengine/shapes.json); "Q4" is llama.cpp's Q4_K_M mix (refengine/qmix.py),
and Qwen3.5-35B-A3B, a hybrid with linear attention layers and a shared expert, is planned as the
nearest qwen3moe shape (every layer full attention, no shared expert).
"""

from __future__ import annotations

import statistics

from refengine.synthetic import preset, spec_from_hparams
from solver.budget import LLAMACPP_MARGIN_BYTES
from solver.cost import Workload, evaluate
from solver.profile import HardwareProfile
from solver.solve import SHIPPED_PROFILES
from solver.strategies import PSHARD_NAMES, STRATEGIES, Problem

SHAPES = {  # refengine/shapes.json, which names each one's source and simplifications
    "Qwen3-32B-Q4": preset("qwen3-32b", qtype="Q4_K_M"),
    "Llama3-70B-Q4": preset("llama3-70b", qtype="Q4_K_M"),
    "35B-A3B-Q8_0": preset("qwen3moe-35b-a3b", qtype="Q8_0"),
}

SEED_000 = [  # model, context, measured Base TTFT (s), measured Base TPS
    ("Qwen3-32B-Q4", 16384, 34.2, 3.45),
    ("Qwen3-32B-Q4", 65536, 306.1, 0.43),
    ("Qwen3-32B-Q4", 131072, 1044.2, 0.18),
    ("Qwen3-32B-Q4", 262144, 3661.6, 0.08),
    ("Llama3-70B-Q4", 16384, 114.6, 1.27),
    ("Llama3-70B-Q4", 65536, 646.8, 0.26),
    ("Llama3-70B-Q4", 131072, 1806.5, 0.13),
    ("Llama3-70B-Q4", 262144, 5648.6, 0.06),
]
TIERS = (1, 16, 512)  # llama.cpp: decode, and its 512-token ubatch
# The cells that calibrated solver/cost.py's two efficiency constants, left out of the medians.
CALIBRATION = {("Qwen3-32B-Q4", 262144, "TTFT"), ("Qwen3-32B-Q4", 262144, "TPS")}


def predict_fit(shape: str, profile: HardwareProfile, w: Workload):
    spec = spec_from_hparams(SHAPES[shape])
    budget = int(profile.gpus[0].memory_bytes.value) - LLAMACPP_MARGIN_BYTES
    plan = STRATEGIES["fit"](Problem(spec, profile, w, TIERS, budget, "llamacpp"))
    return spec, evaluate(plan, spec, profile, w, "llamacpp")


def main() -> None:
    rtx5080 = HardwareProfile.load(SHIPPED_PROFILES / "rtx5080-xeon-w5-3425.json")
    rtx4090 = HardwareProfile.load(SHIPPED_PROFILES / "rtx4090-epyc-7742.json")
    ttft_ratios, tps_ratios = [], []
    print(
        "| model | context | TTFT predicted s | measured | ratio | TPS predicted | measured | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape, ctx, ttft, tps in SEED_000:
        w = Workload(n_ctx=ctx, prompt_tokens=ctx - 200, gen_tokens=200)
        _, p = predict_fit(shape, rtx5080, w)
        rt, rp = p.ttft_seconds / ttft, p.tps / tps
        marks = []
        for part, ratio, ratios in (("TTFT", rt, ttft_ratios), ("TPS", rp, tps_ratios)):
            if (shape, ctx, part) in CALIBRATION:
                marks.append(f"{ratio:.2f} (calibration)")
            else:
                ratios.append(ratio)
                marks.append(f"{ratio:.2f}")
        print(
            f"| {shape} | {ctx // 1024}K | {p.ttft_seconds:.1f} | {ttft} | {marks[0]} | "
            f"{p.tps:.3f} | {tps} | {marks[1]} |"
        )

    w = Workload(n_ctx=4096, prompt_tokens=346, gen_tokens=200)
    spec, p = predict_fit("35B-A3B-Q8_0", rtx4090, w)
    prompt_tps = 346 / p.ttft_seconds
    ttft_ratios.append(p.ttft_seconds / (346 / 525.0))  # measured TTFT = 346 tokens at 525 t/s
    tps_ratios.append(p.tps / 43.1)
    print(
        f"| 35B-A3B-Q8_0 (RTX 4090) | prompt 346 | {prompt_tps:.0f} t/s | 525 t/s | "
        f"{ttft_ratios[-1]:.2f} (TTFT) | {p.tps:.1f} | 43.1 | {tps_ratios[-1]:.2f} |"
    )

    def worst(r):
        return max(r, key=lambda x: max(x, 1 / x))

    print("\nWithout the calibration cells:")
    print(
        f"TTFT predicted/measured: median {statistics.median(ttft_ratios):.2f}, "
        f"worst {worst(ttft_ratios):.2f} ({len(ttft_ratios)} cells)"
    )
    print(
        f"TPS  predicted/measured: median {statistics.median(tps_ratios):.2f}, "
        f"worst {worst(tps_ratios):.2f} ({len(tps_ratios)} cells)"
    )

    print(
        "\npshard's strategies on the 35B-A3B case (measured: llama.cpp fit 525 / 43.1 t/s, "
        "pshard 213 / 14.8 t/s), prompt / generation t/s on our runtime and on pshard's "
        "(streaming from pageable memory):"
    )
    budget = int(rtx4090.gpus[0].memory_bytes.value) - LLAMACPP_MARGIN_BYTES
    for name in [n for n in PSHARD_NAMES if n != "optimal"]:
        plan = STRATEGIES[name](Problem(spec, rtx4090, w, TIERS, budget, "refengine"))
        cells = []
        for target in ("refengine", "pshard"):
            q = evaluate(plan, spec, rtx4090, w, target)
            slower = [
                part
                for part, worse in (
                    ("prompt", q.ttft_seconds > p.ttft_seconds),
                    ("generation", q.tps < p.tps),
                )
                if worse
            ]
            verdict = "loses " + "+".join(slower) if slower else "wins"
            cells.append(f"{346 / q.ttft_seconds:6.0f} / {q.tps:5.1f} {verdict:22s}")
        print(f"  {PSHARD_NAMES[name]:36s} ours {cells[0]}   pshard's {cells[1]}")


if __name__ == "__main__":
    main()
