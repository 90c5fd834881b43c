"""`refengine bench --engine cpu` beside llama.cpp's `llama-bench` on the same files, threads and
tests, rounds alternated (the host is shared and noisy), medians and their ratio.

    python scripts/cpu_engine_vs_llamacpp.py MODEL [MODEL ...] [--rounds 3] [--threads 2]
        [--llama-bin DIR] [--out docs/measured/DATE-cpu-engine-vs-llamacpp.txt]

MODEL is what `refengine` takes (a .gguf path or a known name). llama.cpp comes from
`scripts/build_llamacpp.sh` (built once into the cache) unless --llama-bin is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama_bin(given: str | None) -> Path:
    if given:
        return Path(given)
    out = subprocess.run([str(ROOT / "scripts" / "build_llamacpp.sh")], capture_output=True,
                         text=True, check=True)  # fmt: skip
    return Path(out.stdout.strip().splitlines()[-1])


def model_path(name: str) -> str:
    sys.path.insert(0, str(ROOT))
    from refengine.models import resolve_model

    return str(resolve_model(name))


def ours(model: str, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-m", "refengine", "bench", model, "--engine", "cpu", "--threads",
         str(threads), "-p", str(n_prompt), "-n", str(n_gen), "-o", "json"],
        capture_output=True, text=True, check=True, cwd=ROOT,
    )  # fmt: skip
    return _rates(json.loads(out.stdout))


def theirs(bin_dir: Path, model: str, threads: int, n_prompt: int, n_gen: int) -> dict[str, float]:
    out = subprocess.run(
        [str(bin_dir / "llama-bench"), "-m", model, "-t", str(threads), "-p", str(n_prompt), "-n",
         str(n_gen), "-r", "1", "-o", "json"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return _rates(json.loads(out.stdout))


def read_once(path: str) -> None:
    """Every page of the file into the page cache before the first round, so that neither side's
    first run reads it from disk (a MoE's warm-up touches most experts' pages, not all)."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def _rates(records: list[dict]) -> dict[str, float]:
    return {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in records}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=32)
    ap.add_argument("--llama-bin")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    bins = llama_bin(a.llama_bin)
    paths = {m: model_path(m) for m in a.models}
    for path in paths.values():
        read_once(path)
    lines = [f"refengine bench --engine cpu vs llama-bench, -t {a.threads} -p {a.p} -n {a.n}, "
             f"{a.rounds} rounds alternated",
             f"{'round':>5}  {'model':<32} {'test':<6} {'ours t/s':>9} {'llama.cpp t/s':>13} "
             f"{'ratio':>6}"]  # fmt: skip
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rnd in range(a.rounds):
        for m in a.models:
            # alternate who goes first, so neither always runs on a warmer or quieter host
            runs = [lambda: ours(paths[m], a.threads, a.p, a.n),
                    lambda: theirs(bins, paths[m], a.threads, a.p, a.n)]  # fmt: skip
            first, second = (runs if rnd % 2 == 0 else runs[::-1])
            r1, r2 = first(), second()
            us, them = (r1, r2) if rnd % 2 == 0 else (r2, r1)
            for test in ("pp", "tg"):
                got.setdefault((m, test), []).append((us[test], them[test]))
                lines.append(f"{rnd:>5}  {Path(m).name:<32} {test:<6} {us[test]:>9.1f} "
                             f"{them[test]:>13.1f} {us[test] / them[test]:>6.2f}")  # fmt: skip
            print(lines[-2], lines[-1], sep="\n", flush=True)
    lines.append("median ratio (ours / llama.cpp) and the rounds' ratios:")
    for (m, test), pairs in got.items():
        ratios = [u / t for u, t in pairs]
        lines.append(f"  {Path(m).name:<32} {test}{a.p if test == 'pp' else a.n}: "
                     f"{statistics.median(ratios):.2f}  (ours median "
                     f"{statistics.median(u for u, _ in pairs):.1f} t/s, llama.cpp "
                     f"{statistics.median(t for _, t in pairs):.1f}; rounds: "
                     f"{', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print("\n".join(lines[-len(got) - 1 :]))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
