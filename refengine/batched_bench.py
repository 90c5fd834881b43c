"""llama-batched-bench for our engines: for each prompt length PP, generation length TG and number
of parallel sequences B, the B prompts are processed together (ubatches that may mix sequences),
then TG decode steps each advance all B sequences by one token. The columns and JSONL keys are
llama-batched-bench's (tools/batched-bench): PP, TG, B, N_KV = B (PP + TG), T_PP, S_PP = B PP /
T_PP, T_TG, S_TG = B TG / T_TG, T = T_PP + T_TG, S = N_KV / T. A combination whose cells do not
fit the context (the total over all sequences; with per-sequence streams each sequence's share)
is skipped, as llama-batched-bench skips it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import product

import numpy as np

from .errors import UserError

COLUMNS = ("PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "T s", "S t/s")


@dataclass(frozen=True)
class Row:
    pp: int
    tg: int
    pl: int
    t_pp: float  # seconds
    t_tg: float  # seconds

    @property
    def n_kv(self) -> int:
        return self.pl * (self.pp + self.tg)

    @property
    def speed_pp(self) -> float:
        return self.pl * self.pp / self.t_pp if self.t_pp else 0.0

    @property
    def speed_tg(self) -> float:
        return self.pl * self.tg / self.t_tg if self.t_tg else 0.0

    @property
    def t(self) -> float:
        return self.t_pp + self.t_tg

    @property
    def speed(self) -> float:
        return self.n_kv / self.t

    def record(self) -> dict:
        """llama-batched-bench's JSONL keys."""
        return {"pp": self.pp, "tg": self.tg, "pl": self.pl, "n_kv": self.n_kv,
                "t_pp": self.t_pp, "speed_pp": self.speed_pp, "t_tg": self.t_tg,
                "speed_tg": self.speed_tg, "t": self.t, "speed": self.speed}  # fmt: skip

    def cells(self) -> list[str]:
        """The row as llama-batched-bench prints it."""
        return [str(self.pp), str(self.tg), str(self.pl), str(self.n_kv), f"{self.t_pp:.3f}",
                f"{self.speed_pp:.2f}", f"{self.t_tg:.3f}", f"{self.speed_tg:.2f}",
                f"{self.t:.3f}", f"{self.speed:.2f}"]  # fmt: skip


def parse_counts(text: str, option: str) -> list[int]:
    """'128,512' -> [128, 512]; one line for anything else."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or any(v < 0 for v in values):
        raise UserError(f"{option} takes comma-separated token counts, e.g. 128,512, not {text!r}")
    return values


def fits(seqs, pp: int, tg: int, pl: int) -> bool:
    """Whether pl sequences of pp + tg tokens fit the engine's cache (`Sequences`)."""
    if pl > seqs.n_seq:
        return False
    return pl * (pp + tg) <= seqs.n_ctx and pp + tg <= seqs.n_ctx_seq


def batched_bench(engine, n_pp: list[int], n_tg: list[int], n_pl: list[int], seed: int = 0,
                  progress=None) -> tuple[list[Row], list[tuple[int, int, int]]]:  # fmt: skip
    """(rows, skipped (pp, tg, pl)) over every combination, in llama-batched-bench's order.
    `progress(done, total)` is called after each row. The engine holds max(n_pl) sequences."""
    rng = np.random.default_rng(seed)
    vocab = engine.spec.hparams.n_vocab
    combos = list(product(n_pp, n_tg, n_pl))
    runnable = [c for c in combos if fits(engine.seqs, *c)]
    skipped = [c for c in combos if c not in runnable]
    # untimed first: every kernel a row calls compiled (a prompt ubatch, a decode step of each B)
    for pl in sorted({pl for _, _, pl in runnable}):
        _run(engine, rng, vocab, 1, 1, pl)
    rows = []
    for i, (pp, tg, pl) in enumerate(runnable):
        rows.append(_run(engine, rng, vocab, pp, tg, pl))
        if progress is not None:
            progress(i + 1, len(runnable))
    engine.reset()
    return rows, skipped


def _run(engine, rng, vocab: int, pp: int, tg: int, pl: int) -> Row:
    engine.reset()
    seqs = [0] + [engine.add_sequence() for _ in range(pl - 1)]
    prompts = [rng.integers(0, vocab, pp) for _ in seqs]
    steps = rng.integers(0, vocab, (tg, pl))
    start = time.perf_counter()
    if pp:
        engine.process(list(zip(seqs, prompts)))
    t_pp = time.perf_counter() - start
    start = time.perf_counter()
    for tokens in steps:
        engine.decode_batch(list(zip(seqs, tokens.tolist())))
    t_tg = time.perf_counter() - start
    return Row(pp, tg, pl, t_pp, t_tg)


def markdown(rows: list[Row]) -> list[str]:
    """llama-batched-bench's table, line by line."""
    widths = [6, 6, 4, 6] + [8] * 6
    head = "|" + "|".join(f" {c:>{w}} " for c, w in zip(COLUMNS, widths)) + "|"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["|" + "|".join(f" {c:>{w}} " for c, w in zip(r.cells(), widths)) + "|" for r in rows]
    return [head, rule, *body]
