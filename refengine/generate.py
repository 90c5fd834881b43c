"""A prompt through an engine and tokens sampled after it, streamed as text as they come: what
`refengine run` does between loading an engine and printing its timings. It leaves out how the
engine is chosen and how the prompt was written on the command line."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import BinaryIO, TextIO

import numpy as np

from .engine import check_context
from .errors import UserError
from .sampling import Sampler
from .spec import ModelSpec
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    tokenizer: Tokenizer | None  # None: the model has none, and the ids were given
    text: str | None  # the prompt as written, echoed before the generated text


def prompt_for(spec: ModelSpec, text: str | None, ids: list[int] | None, n_predict: int,
               n_ctx: int) -> Prompt:  # fmt: skip
    """The prompt as text or as token ids (one of them), checked against the vocabulary and the
    context; the tokenizer is read when text is given or tokens are to be decoded."""
    tok = None
    if text is not None or n_predict > 0:
        try:
            tok = Tokenizer.from_gguf(spec.path)
        except UserError:
            if text is not None:
                raise
    ids = ids if ids is not None else tok.encode(text)
    if not ids:
        raise UserError("the prompt has no tokens")
    bad = [i for i in ids if not 0 <= i < spec.hparams.n_vocab]
    if bad:
        raise UserError(
            f"token ids {bad[:5]} are outside the vocabulary (0..{spec.hparams.n_vocab - 1})"
        )
    # the last generated token is printed, never fed back
    check_context(
        len(ids) + max(n_predict - 1, 0),
        min(n_ctx, spec.hparams.n_ctx_train),
        spec.hparams.n_ctx_train,
    )
    return Prompt(ids, tok, text)


@dataclass(frozen=True)
class Generation:
    tokens: list[int]
    prompt_seconds: float
    gen_seconds: float


def generate(engine, prompt: Prompt, n_predict: int, sampler: Sampler, out: TextIO,
             dump: BinaryIO | None = None) -> Generation:  # fmt: skip
    """Prefill (its logits of every position saved to `dump` as .npy), echo the prompt text, then
    up to `n_predict` tokens written to `out` as they come (text held back while it ends in an
    incomplete UTF-8 sequence; ids as `7,` without a tokenizer), stopping at end of generation."""
    tok = prompt.tokenizer
    prompt_seconds = time.perf_counter()
    logits = engine.prefill(prompt.ids, all_logits=dump is not None)
    prompt_seconds = time.perf_counter() - prompt_seconds
    if dump is not None:
        with dump:
            np.save(dump, logits.astype(np.float32))
        logits = logits[-1]
    if tok is not None and prompt.text is not None:
        out.write(prompt.text)
    generated, shown = [], ""
    gen_seconds = time.perf_counter()
    for i in range(n_predict):
        nxt = sampler(logits)
        if tok is not None and nxt in tok.eog_ids:
            break
        generated.append(nxt)
        if tok is not None:
            text = tok.decode(generated)
            if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
                out.write(text[len(shown) :])
                shown = text
        else:
            out.write(f"{nxt},")
        out.flush()
        if i + 1 < n_predict:
            logits = engine.decode(nxt)
    gen_seconds = time.perf_counter() - gen_seconds
    out.write("\n")
    return Generation(generated, prompt_seconds, gen_seconds)



@dataclass(frozen=True)
class Together:
    tokens: list[list[int]]  # each prompt's generated tokens
    prompt_seconds: float
    gen_seconds: float
    steps: int  # decode steps, each over the sequences still generating


def generate_together(engine, prompts: list[Prompt], n_predict: int, samplers: list) -> Together:
    """Several prompts continued together on one engine of as many sequences (docs/sequences.md):
    their prompts in one call, then decode steps over every sequence still generating; a sequence
    leaves the steps (its cells freed) at its end of generation or after n_predict tokens."""
    seqs = [0] + [engine.add_sequence() for _ in prompts[1:]]  # prompt i is sequence seqs[i]
    prompt_seconds = time.perf_counter()
    logits = list(engine.process([(s, p.ids) for s, p in zip(seqs, prompts)]))
    prompt_seconds = time.perf_counter() - prompt_seconds
    out: list[list[int]] = [[] for _ in prompts]
    active, steps = list(range(len(prompts))), 0
    gen_seconds = time.perf_counter()
    while active and n_predict:
        going = []
        for i in active:
            nxt = samplers[i](logits[i])
            tok = prompts[i].tokenizer
            if tok is not None and nxt in tok.eog_ids:
                continue
            out[i].append(nxt)
            if len(out[i]) < n_predict:
                going.append(i)
        for i in set(active) - set(going):
            if seqs[i]:  # sequence 0 stays: it is the single-sequence API's
                engine.remove_sequence(seqs[i])
        active = going
        if going:
            rows = engine.decode_batch([(seqs[i], out[i][-1]) for i in going])
            for i, row in zip(going, rows):
                logits[i] = row
            steps += 1
    gen_seconds = time.perf_counter() - gen_seconds
    return Together(out, prompt_seconds, gen_seconds, steps)
