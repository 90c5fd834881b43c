"""`refengine profile-routing`: which experts a MoE model's routers choose on a user's prompts, and
what that makes an expert cache miss (`solver.routing` prices plans by it).

The NumPy engine runs each prompt and then generates greedily from it, recording every layer's
input and its router's choice token by token. Each layer's choices of the generated tokens are
then replayed in order, one token a ubatch as decode runs them, through the runtime's own cache
(`cudarun.expert_cache`) at a few cache sizes, from empty at the first generated token as the
runtime's is after the switch from the prompt's tier (its caches start empty at each switch);
with prefetch, the replay first places what the layer's router makes of the layer's input
(normed by the FFN norm, as the runtime's `predict`), then the choice. Generate about as many
tokens as your requests do: a short generation misses more of its experts while the cache fills.
"""

from __future__ import annotations

import numpy as np

from refengine import reference as ref
from refengine.engine import NumpyEngine
from refengine.spec import ModelSpec

from .expert_cache import ExpertCache


def cache_sizes(n_expert: int, n_used: int) -> list[int]:
    """The sizes replayed: around k, where a decode token's experts start to fit, and up to E."""
    k, e = n_used, n_expert
    sizes = {0, k // 2, k, 3 * k // 2, 2 * k, 3 * k, 4 * k, e // 8, e // 4, e // 2, 3 * e // 4, e}
    return sorted(c for c in sizes if 0 <= c <= e)


def record_routing(engine: NumpyEngine, prompts: list[list[int]], n_predict: int):
    """Per prompt, per layer: (the layer's inputs [T, d], its router's choices [T, k]) over the
    prompt and `n_predict` greedy tokens."""
    n_layer = engine.spec.hparams.n_layer
    names = {f"blk.{il}.{what}" for il in range(n_layer) for what in ("inp", "ffn_moe_ids")}
    out = []
    for ids in prompts:
        engine.reset()
        logits, rec = engine.prefill(ids, record=names)
        parts = {name: [x] for name, x in rec.items()}
        for _ in range(n_predict):
            logits, step = engine.decode(int(np.argmax(logits)), record=names)
            for name, x in step.items():
                parts[name].append(x)
        rec = {name: np.concatenate(xs) for name, xs in parts.items()}
        out.append([(rec[f"blk.{il}.inp"], rec[f"blk.{il}.ffn_moe_ids"]) for il in range(n_layer)])
    return out


def predicted_choices(engine: NumpyEngine, il: int, x: np.ndarray) -> np.ndarray:
    """What layer il's router makes of the layer's input x [T, d] (the runtime's `predict`)."""
    spec, w, hp = engine.spec, engine.w, engine.spec.hparams
    h = ref.rms_norm(x, w.dense(f"blk.{il}.ffn_norm.weight"), hp.rms_eps)
    logits = engine._linear(h, f"blk.{il}.ffn_gate_inp")
    return ref.moe_route(logits, hp.n_expert_used, spec.arch.expert_weights_norm)[0]


def replay(choices: list[np.ndarray], slots: int, starts: list[int],
           predictions=None) -> tuple[int, int, int, int]:  # fmt: skip
    """(chosen, missed, copied before routing, predicted right) over sequences of per-token
    choices [T, k], each replayed from token `starts[s]` on (the generated tokens) through a cache
    of `slots`, empty at the first."""
    chosen = missed = early = right = 0
    for s, ids in enumerate(choices):
        cache = ExpertCache(slots)
        for t in range(starts[s], ids.shape[0]):
            counted = 1
            experts = sorted({int(e) for e in ids[t]})
            if predictions is not None:
                guess = sorted({int(e) for e in predictions[s][t]})
                right += counted * len(set(guess) & set(experts))
                early += counted * len(cache.admit(guess).inserted)
            got = cache.admit(experts)
            chosen += counted * len(experts)
            missed += counted * (len(got.inserted) + len(got.overflow))
    return chosen, missed, early, right


def profile_routing(spec: ModelSpec, prompts: list[list[int]], n_predict: int, progress=None):
    """The model's RoutingStats on these prompts (token ids each)."""
    from solver.routing import RoutingStats

    hp = spec.hparams
    engine = NumpyEngine(spec, n_ctx=max(len(p) for p in prompts) + n_predict)
    runs = record_routing(engine, prompts, n_predict)
    starts = [len(p) for p in prompts]
    sizes = cache_sizes(hp.n_expert, hp.n_expert_used)
    miss, early, late, freq, by_layer = [], [], [], [], []
    right = chosen_all = 0
    for il in range(hp.n_layer):
        choices = [run[il][1] for run in runs]
        guesses = [predicted_choices(engine, il, run[il][0]) for run in runs]
        counts = np.bincount(np.concatenate([c.ravel() for c in choices]), minlength=hp.n_expert)
        freq.append(tuple(float(c) for c in counts / counts.sum()))
        row, row_early, row_late = [], [], []
        for c in sizes:
            chosen, missed, _, _ = replay(choices, c, starts)
            row.append(missed / chosen)
            chosen, missed, before, hit = replay(choices, c, starts, guesses)
            row_early.append(before / chosen)
            row_late.append(missed / chosen)
        right, chosen_all = right + hit, chosen_all + chosen
        miss.append(row)
        early.append(row_early)
        late.append(row_late)
        by_layer.append(tuple(row))
        if progress:
            progress(il)
    mean = lambda rows: tuple(float(x) for x in np.mean(rows, axis=0))  # noqa: E731
    return RoutingStats(
        n_expert=hp.n_expert,
        n_used=hp.n_expert_used,
        tokens=n_predict * len(prompts),
        slots=tuple(sizes),
        miss=mean(miss),
        early=mean(early),
        late=mean(late),
        prefetch_hit=right / chosen_all,
        frequency=tuple(freq),
        miss_by_layer=tuple(by_layer),
    )
