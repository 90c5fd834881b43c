"""`--trace FILE`: the operations of a run on their lanes (copy, compute, CPU) as a Chrome trace
(chrome://tracing, Perfetto) and a Gantt chart drawn next to it (FILE with .png)."""

from __future__ import annotations

import json
from pathlib import Path

LANES = ("copy", "compute", "cpu")


def write_trace(events: list[tuple[str, str, float, float]], path: Path) -> Path:
    """events: (lane, name, start s, end s). Writes the JSON and the PNG; returns the PNG's path."""
    t0 = min((e[2] for e in events), default=0.0)
    tids = {lane: i for i, lane in enumerate(LANES)}
    trace = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
        for lane, i in tids.items()
    ]
    for lane, name, start, end in events:
        trace.append({
            "name": name, "ph": "X", "pid": 0, "tid": tids.setdefault(lane, len(tids)),
            "ts": (start - t0) * 1e6, "dur": max(end - start, 0.0) * 1e6,
        })  # fmt: skip
    path = Path(path)
    path.write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
    png = path.with_suffix(".png")
    gantt(events, t0, png)
    return png


def gantt(events, t0: float, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lanes = [lane for lane in LANES if any(e[0] == lane for e in events)]
    colors = {"copy": "tab:orange", "compute": "tab:blue", "cpu": "tab:green"}
    fig, ax = plt.subplots(figsize=(14, 1 + 0.6 * len(lanes)))
    for row, lane in enumerate(lanes):
        bars = [((s - t0) * 1e3, (e - s) * 1e3) for ln, _, s, e in events if ln == lane]
        ax.broken_barh(bars, (row - 0.4, 0.8), color=colors.get(lane, "gray"))
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("ms")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def overlap_fraction(events) -> float:
    """Of the copy lane's busy time, the fraction during which the compute lane was busy too."""
    compute = sorted((s, e) for lane, _, s, e in events if lane == "compute")
    total = covered = 0.0
    for lane, _, s, e in events:
        if lane != "copy":
            continue
        total += e - s
        for cs, ce in compute:
            if cs >= e:
                break
            covered += max(0.0, min(e, ce) - max(s, cs))
    return covered / total if total else 0.0
