"""`refengine batched-bench --engine cpu` beside llama.cpp's `llama-batched-bench` on the same files,
threads, context and rows, per-sequence KV streams and the unified cache each (llama.cpp's
-no-kvu / -kvu), rounds alternated (the host is shared and noisy), medians and their ratios.

    python scripts/batched_vs_llamacpp.py MODEL [MODEL ...] [--rounds 3] [--threads 2]
        [-npp 128,512] [-ntg 32] [-npl 1,8] [-c 4608] [--llama-bin DIR] [--out FILE]

MODEL is what `refengine` takes (a .gguf path or a known name).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_engine_vs_llamacpp import ROOT, llama_bin, model_path  # noqa: E402

MODES = ("streams", "unified")


def ours(model: str, a, mode: str) -> dict:
    cmd = [sys.executable, "-m", "refengine", "batched-bench", model, "--engine", "cpu",
           "--threads", str(a.threads), "-npp", a.npp, "-ntg", a.ntg, "-npl", a.npl, "-c",
           str(a.c), "-o", "json"] + (["--unified"] if mode == "unified" else [])  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return _rows(out.stdout)


def theirs(bin_dir: Path, model: str, a, mode: str) -> dict:
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", model, "-t", str(a.threads), "-npp", a.npp,
           "-ntg", a.ntg, "-npl", a.npl, "-c", str(a.c), "--output-format", "jsonl",
           "-kvu" if mode == "unified" else "-no-kvu"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return _rows(out.stdout + out.stderr)


def _rows(text: str) -> dict:
    """(pp, tg, pl) -> record, from JSONL lines among other output."""
    rows = {}
    for line in text.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            r = json.loads(line)
            rows[(r["pp"], r["tg"], r["pl"])] = r
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-npp", default="128,512")
    ap.add_argument("-ntg", default="32")
    ap.add_argument("-npl", default="1,8")
    ap.add_argument("-c", type=int, default=4608)
    ap.add_argument("--llama-bin")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    bins = llama_bin(a.llama_bin)
    paths = {m: model_path(m) for m in a.models}
    got: dict = {}  # (model, mode, who) -> [rows of each round]
    for rnd in range(a.rounds):
        for m in a.models:
            for mode in MODES:
                runs = [("ours", lambda: ours(paths[m], a, mode)),
                        ("llama.cpp", lambda: theirs(bins, paths[m], a, mode))]  # fmt: skip
                for who, run in runs[:: 1 if rnd % 2 == 0 else -1]:
                    got.setdefault((m, mode, who), []).append(run())
                print(f"round {rnd} {m} {mode} done", file=sys.stderr)
    lines = [f"refengine batched-bench --engine cpu vs llama-batched-bench, -t {a.threads} -npp "
             f"{a.npp} -ntg {a.ntg} -npl {a.npl} -c {a.c}, {a.rounds} rounds alternated, "
             "medians (per-sequence KV streams: ours by default, llama.cpp -no-kvu; unified: "
             "--unified, -kvu)", ""]  # fmt: skip
    for m in a.models:
        lines.append(f"## {m}")
        lines.append("| KV | PP | TG | B | ours S_PP | llama.cpp S_PP | ratio | ours S_TG | "
                     "llama.cpp S_TG | ratio |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|---|---|---|---|")
        for mode in MODES:
            for key in sorted(got[(m, mode, "ours")][0]):
                med = {who: {k: statistics.median(r[key][k] for r in got[(m, mode, who)])
                             for k in ("speed_pp", "speed_tg")}
                       for who in ("ours", "llama.cpp")}  # fmt: skip
                o, t = med["ours"], med["llama.cpp"]
                lines.append(f"| {mode} | {key[0]} | {key[1]} | {key[2]} | {o['speed_pp']:.1f} | "
                             f"{t['speed_pp']:.1f} | {o['speed_pp'] / t['speed_pp']:.2f} | "
                             f"{o['speed_tg']:.1f} | {t['speed_tg']:.1f} | "
                             f"{o['speed_tg'] / t['speed_tg']:.2f} |")  # fmt: skip
        lines.append("")
        lines.append("S_TG(B) / S_TG(1), medians:")
        for mode in MODES:
            for who in ("ours", "llama.cpp"):
                rows = got[(m, mode, who)]
                for pp in sorted({k[0] for k in rows[0]}):
                    tg = {k[2]: statistics.median(r[k]["speed_tg"] for r in rows)
                          for k in rows[0] if k[0] == pp}  # fmt: skip
                    one = tg.get(1)
                    if one and len(tg) > 1:  # -npl has 1 and more
                        ratios = ", ".join(f"B={b}: {v / one:.2f}x" for b, v in sorted(tg.items())
                                           if b > 1)  # fmt: skip
                        lines.append(f"  {mode:<8} {who:<10} PP {pp}: {ratios}")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
