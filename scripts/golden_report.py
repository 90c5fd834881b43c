"""Print how the NumPy reference engine agrees with the recorded llama.cpp runs, one row a model.

    .venv/bin/python scripts/golden_report.py

Columns: the long prompt's positions, top-1 agreement and mean KL(llama.cpp || ours); for the three
greedy cases, how many of the 3x32 continuation tokens our engine (fed llama.cpp's tokens) picks
differently, and how many of those were not near-ties. tests/test_golden.py asserts on the same
figures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from refengine.engine import NumpyEngine  # noqa: E402
from tests.golden import FIXTURE_DIR, compare, load_fixture  # noqa: E402
from tests.test_golden import model_file  # noqa: E402


def main() -> None:
    print(
        "| model | long prompt tokens | top-1 | mean KL | greedy tokens differing | off a near-tie |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for fixture in sorted(FIXTURE_DIR.glob("*.npz")):
        name = fixture.stem
        meta, arrays = load_fixture(name)
        engine = NumpyEngine(str(model_file(name, meta)), n_ctx=2048)
        long = compare(arrays, "long", engine.prefill(meta["long_ids"], all_logits=True))
        differ = off_tie = 0
        for i, g in enumerate(meta["greedy"]):
            engine.reset()
            a = compare(
                arrays,
                f"greedy{i}",
                engine.prefill(g["prompt_ids"] + g["continuation"], all_logits=True),
            )
            n_prompt = len(g["prompt_ids"])
            cont = [
                m
                for m in a.mismatches
                if n_prompt - 1 <= m[0] < n_prompt - 1 + len(g["continuation"])
            ]
            differ += len(cont)
            off_tie += sum(not near for _, _, near in cont)
        engine.reset()
        print(
            f"| {name} | {long.n} | {long.top1:.4f} | {long.mean_kl:.2e} | {differ} of 96 | {off_tie} |"
        )


if __name__ == "__main__":
    main()
