"""Several sequences in one engine (llama.cpp #14363's high-throughput mode): which sequences exist,
how far each has come, the room the KV cache has for them, and how a call's tokens are laid out in
ubatches. Every engine keeps one `Sequences` and builds its ubatches with `ubatches`; the API it
serves is written in docs/sequences.md.

The context `n_ctx` is the total over all sequences, as llama.cpp's `-c`. With per-sequence KV
streams (the default) each of the `n_seq` sequences owns `n_ctx // n_seq` cells, and attention runs
over its own stream only; with `unified` (llama.cpp's `-kvu`) the sequences share one cache of
`n_ctx` cells, and a sequence may grow as long as the cache has cells free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import UserError


class Sequences:
    def __init__(self, n_ctx: int, n_seq: int = 1, unified: bool = False):
        if n_seq < 1:
            raise UserError(f"the number of sequences must be 1 or more, not {n_seq}")
        if n_ctx < n_seq:
            raise UserError(
                f"a context of {n_ctx} tokens cannot hold {n_seq} sequences; raise -c (it is the "
                "total over all sequences)"
            )
        self.n_ctx, self.n_seq, self.unified = n_ctx, n_seq, unified
        self.n_ctx_seq = n_ctx if unified else n_ctx // n_seq  # cells one sequence may fill
        self.n_past: dict[int, int] = {}
        self.reset()

    def reset(self) -> None:
        """Every sequence removed but sequence 0, which is empty: the single-sequence API's."""
        self.n_past = {0: 0}

    def add(self) -> int:
        """A new empty sequence: the lowest free id (ids are 0 .. n_seq - 1, one KV stream each)."""
        free = [s for s in range(self.n_seq) if s not in self.n_past]
        if not free:
            raise UserError(
                f"all {self.n_seq} sequences are in use; remove one first or make the engine "
                "with more sequences"
            )
        self.n_past[free[0]] = 0
        return free[0]

    def remove(self, seq: int) -> None:
        self.check_exists(seq)
        del self.n_past[seq]

    def check_exists(self, seq: int) -> None:
        if seq not in self.n_past:
            raise UserError(f"there is no sequence {seq}; the sequences are {sorted(self.n_past)}")

    def room(self, seq: int) -> int:
        """Tokens sequence `seq` may still add."""
        if self.unified:
            return min(self.n_ctx_seq - self.n_past[seq], self.n_ctx - sum(self.n_past.values()))
        return self.n_ctx_seq - self.n_past[seq]

    def check_room(self, counts: dict[int, int]) -> None:
        """UserError when the tokens of this call (seq -> count) do not fit the cache."""
        for seq, n in counts.items():
            self.check_exists(seq)
            if n > self.room(seq):
                if self.n_seq == 1:
                    where = ""
                elif self.unified:
                    where = f" for sequence {seq} (the total over all sequences)"
                else:
                    where = f" for sequence {seq} ({self.n_ctx_seq} for each of {self.n_seq})"
                raise UserError(
                    f"{self.n_past[seq] + n} tokens do not fit the context of {self.n_ctx}{where}; "
                    "pass a larger context (-c) or a shorter prompt"
                )
        if self.unified and sum(counts.values()) > self.n_ctx - sum(self.n_past.values()):
            raise UserError(
                f"the unified cache of {self.n_ctx} cells has "
                f"{self.n_ctx - sum(self.n_past.values())} free; pass a larger context (-c)"
            )


@dataclass(frozen=True)
class Ubatch:
    """One executed ubatch: its tokens, each with its sequence and position, and the runs of
    consecutive tokens of one sequence (`segments`: (seq, first token, count))."""

    tokens: np.ndarray  # [T] int64
    seq: np.ndarray  # [T] int64
    pos: np.ndarray  # [T] int64
    segments: tuple[tuple[int, int, int], ...]
    logit_rows: np.ndarray  # [R] int64: the tokens whose logits the call returns, in order

    @property
    def size(self) -> int:
        return int(self.tokens.size)


def one_sequence(ids: np.ndarray, pos: np.ndarray) -> Ubatch:
    """A ubatch of sequence 0 alone, at the given positions, its last token's logits wanted."""
    return Ubatch(ids, np.zeros(ids.size, np.int64), pos, ((0, 0, int(ids.size)),),
                  np.array([ids.size - 1]))  # fmt: skip


def ubatches(seqs: Sequences, entries, n_ubatch: int, all_logits: bool) -> list[Ubatch]:
    """The ubatches of one call: each entry's (seq, token ids) in order, cut into ubatches of at
    most n_ubatch tokens (an entry may span several). A ubatch returns the logits of every token
    of its entries with `all_logits`, else of each entry's last token. Positions are the sequences'
    n_past at the call; the caller advances them as the ubatches run."""
    flat_tok, flat_seq, flat_pos, want = [], [], [], []
    past = {}
    for seq, ids in entries:
        start = past.get(seq, seqs.n_past[seq])
        flat_tok.append(ids)
        flat_seq.append(np.full(ids.size, seq, np.int64))
        flat_pos.append(np.arange(start, start + ids.size, dtype=np.int64))
        keep = np.ones(ids.size, bool) if all_logits else np.arange(ids.size) == ids.size - 1
        want.append(keep)
        past[seq] = start + ids.size
    tok, seq, pos, want = (np.concatenate(a) for a in (flat_tok, flat_seq, flat_pos, want))
    out = []
    for first in range(0, tok.size, n_ubatch):
        sl = slice(first, first + n_ubatch)
        s = seq[sl]
        cuts = np.flatnonzero(np.diff(s)) + 1
        starts = np.concatenate([[0], cuts])
        ends = np.concatenate([cuts, [s.size]])
        segments = tuple((int(s[a]), int(a), int(b - a)) for a, b in zip(starts, ends))
        out.append(Ubatch(tok[sl], s, pos[sl], segments, np.flatnonzero(want[sl])))
    return out


def check_entries(seqs: Sequences, entries, n_vocab: int) -> list[tuple[int, np.ndarray]]:
    """The entries of a call as (seq, int64 ids), or UserError: an unknown sequence, a sequence
    twice, no tokens, ids outside the vocabulary, or more tokens than the cache has room for."""
    out, seen = [], set()
    for seq, tokens in entries:
        seq = int(seq)
        seqs.check_exists(seq)
        if seq in seen:
            raise UserError(f"sequence {seq} appears twice in one call; give its tokens once")
        seen.add(seq)
        ids = np.asarray(tokens).reshape(-1)
        if ids.size == 0:
            raise UserError("the prompt is empty; give at least one token")
        if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= n_vocab:
            raise UserError(f"token ids must be integers in 0..{n_vocab - 1}")
        out.append((seq, ids.astype(np.int64)))
    if not out:
        raise UserError("a call needs at least one sequence's tokens")
    seqs.check_room({s: ids.size for s, ids in out})
    return out
