"""What `refengine diff` computes: an engine beside the reference engine, both fed the prompt and
then the reference's own greedy tokens (teacher-forced, so both see the same tokens at every
position), with every block's output, the final norm and the logits recorded at each call.

Each activation's largest normwise error over the calls locates where an engine drifts; the
verdict is the logits held to the bounds of the engine's named path (`agreement.judge`), since a
path that rounds activations to 8 bits or multiplies in fp16 is not wrong for being 5e-2 off in
normwise terms when its top-1 and KL keep the contract. Any engine of the Engine API works.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .agreement import Judgement, PathBounds, judge, normwise


@dataclass
class Diff:
    n_prompt: int
    n_decode: int
    worst: dict[str, float]  # activation -> largest normwise error over the calls
    judgement: Judgement

    @property
    def ok(self) -> bool:
        return self.judgement.ok

    def first_above(self, tolerance: float) -> str | None:
        """The first activation, in forward order, whose error exceeds `tolerance`."""
        return next((n for n, e in self.worst.items() if e > tolerance), None)


def activation_names(n_layer: int) -> list[str]:
    return [f"blk.{il}.out" for il in range(n_layer)] + ["output_norm", "logits"]


def diff_engines(engine, reference, n_layer: int, prompt: list[int], n_decode: int,
                 bounds: PathBounds) -> Diff:  # fmt: skip
    """Run `engine` and `reference` over the prompt (every position's logits) and n_decode
    greedy steps of the reference, and judge the engine's logits by `bounds`."""
    names = activation_names(n_layer)
    record = set(names)
    worst = dict.fromkeys(names, 0.0)
    engine.reset()
    reference.reset()
    want, ref_acts = reference.prefill(prompt, all_logits=True, record=record)
    got, acts = engine.prefill(prompt, all_logits=True, record=record)
    ref_rows, rows = list(want), list(got)
    for step in range(n_decode + 1):
        for name in names:
            worst[name] = max(worst[name], normwise(acts[name], ref_acts[name]))
        if step == n_decode:
            break
        token = int(np.argmax(ref_rows[-1]))
        ref, ref_acts = reference.decode(token, record=record)
        ours, acts = engine.decode(token, record=record)
        ref_rows.append(ref)
        rows.append(ours)
    return Diff(len(prompt), n_decode, worst, judge(rows, ref_rows, bounds))
