"""What the golden fixtures hold and how the reference engine is compared with them.

Shared by scripts/record_golden.py (which writes the fixtures with llama.cpp) and
tests/test_golden.py (which replays llama.cpp's tokens through the NumPy engine).

The comparison follows docs/contracts.md: our engine is fed llama.cpp's tokens; its top-1 must equal
llama.cpp's greedy token at every continuation position up to the first near-tie (llama.cpp's top
two logits closer than max(0.01, 2 * TOL * max|logit|), TOL = 1e-2 because llama.cpp quantizes
activations to 8 bits); over every position, top-1 agreement and the mean KL(llama.cpp || ours).
With top-k fixtures the KL is taken over the top-k tokens plus one bucket for the rest of the
vocabulary — a lower bound of the full KL that is tight when the rest carries little mass (its mass
is reported beside it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from refengine.agreement import log_softmax
from refengine.defaults import cache_dir
from refengine.synthetic import SyntheticConfig

FIXTURE_DIR = Path(__file__).parent / "fixtures" / "golden"
TOP_K = 64
N_CONTINUE = 32
TOL = 1e-2

GREEDY_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
)

LONG_TEXT = (
    "The history of computing is a story of people trying to make machines do arithmetic faster "
    "than they could by hand. Early mechanical calculators used gears and levers; later, relays "
    "and vacuum tubes replaced them, and then the transistor made it possible to build machines "
    "that fit on a desk. Memory was always the scarce resource: programmers counted bytes, "
    "packed several values into one word, and moved data between fast and slow storage by hand. "
    "Today the same problem appears again with large language models, whose weights no longer "
    "fit in the memory of the graphics card that computes with them. Some systems keep part of "
    "the model in the host's memory and copy it over the bus when it is needed; others compute "
    "the layers that did not fit on the processor itself. Which choice is faster depends on the "
    "bandwidth of the bus, the speed of the memory, the number of tokens processed at once, and "
    "the size of each layer.\n\n"
    "Consider a small bakery on the corner of a busy street. Every morning at four o'clock the "
    "baker lights the ovens, weighs flour and water, and shapes the first loaves while the city "
    "is still asleep. By seven there is a line of customers: a nurse coming home from the night "
    "shift, two students who have not slept either, a man in a suit who buys the same croissant "
    "every day and never says a word. The baker knows most of them by name. When the rent went "
    "up last spring, the neighbours collected money to keep the shop open, and a local painter "
    "decorated the window with a picture of a loaf of bread wearing a crown.\n\n"
    "In mathematics, a prime number is a natural number greater than one that has no divisors "
    "other than one and itself. Euclid proved more than two thousand years ago that there are "
    "infinitely many of them: if there were only finitely many, multiplying them all together "
    "and adding one would give a number that none of them divides. The distribution of the "
    "primes is irregular in detail but remarkably smooth on average, as the prime number theorem "
    "states, and the Riemann hypothesis, still unproven, would describe the size of the errors.\n\n"
    "The river rises in the mountains, where snow melts slowly through the summer, and flows "
    "west for four hundred kilometres before it reaches the sea. Along the way it turns mills, "
    "fills reservoirs, and carries barges loaded with grain, timber and gravel. In the delta the "
    "water spreads into dozens of channels between islands of reeds, where herons stand "
    "motionless for hours and fishermen set their nets at dawn. Floods used to come every few "
    "years; now a system of dikes and pumping stations keeps the fields dry, at a cost that the "
    "farmers and the birds pay in different ways.\n\n"
)

TOKENIZER_STRINGS = (
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs\tand   runs    of spaces  ",
    "line one\nline two\n\n\nafter blank lines\r\n",
    "Numbers: 0 7 42 123 4567 89012 3.14159 1,000,000 2026-11-22",
    "Unicode: café naïve Zürich — “quotes” 日本語 中文 한국어 Ελληνικά русский 🙂🚀",
    "def f(x):\n    return [i**2 for i in range(x) if i % 3 == 0]  # squares\n",
    "x=1;y=2;if(x<y){return x+y;}else{return x-y;}",
)

SYNTHETIC_CASES = {
    "synthetic-llama": SyntheticConfig(
        "llama", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, qtype="Q5_1", seed=1
    ),
    "synthetic-qwen2": SyntheticConfig(
        "qwen2", n_layer=2, n_embd=128, n_ff=256, n_head=4, n_head_kv=2, qtype="Q4_0", seed=2
    ),
    "synthetic-qwen3": SyntheticConfig(
        "qwen3",
        n_layer=2,
        n_embd=256,
        n_ff=512,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        qtype="Q8_0",
        seed=3,
    ),
    "synthetic-qwen3moe": SyntheticConfig(
        "qwen3moe",
        n_layer=2,
        n_embd=256,
        n_ff=512,
        n_head=4,
        n_head_kv=2,
        head_dim=64,
        qtype="Q5_0",
        n_expert=8,
        n_expert_used=2,
        n_ff_exp=256,
        seed=4,
    ),
    # a llama whose layers route (Mixtral's layout: experts as wide as feed_forward_length)
    "synthetic-llama-moe": SyntheticConfig(
        "llama", n_layer=2, n_embd=256, n_ff=256, n_head=4, n_head_kv=2, qtype="Q4_0",
        n_expert=8, n_expert_used=2, seed=6,
    ),
    "synthetic-gemma3": SyntheticConfig(
        "gemma3",
        n_layer=6,
        n_embd=256,
        n_ff=512,
        n_head=4,
        n_head_kv=1,
        head_dim=64,
        qtype="BF16",
        n_swa=16,
        seed=5,
    ),
}
SYNTHETIC_LONG_CHARS = 400  # the synthetic vocabulary spends ~1 token per 2 characters


def synthetic_path(name: str) -> Path:
    return cache_dir() / "synthetic" / f"{name}.gguf"


def load_fixture(name: str) -> tuple[dict, dict]:
    z = np.load(FIXTURE_DIR / f"{name}.npz")
    meta = json.loads(str(z["meta"]))
    return meta, {k: z[k] for k in z.files if k != "meta"}


@dataclass
class Agreement:
    n: int
    top1: float  # fraction of positions where our argmax equals llama.cpp's
    mean_kl: float
    rest_mass: float  # mean llama.cpp probability outside the stored top-k (0 with full logits)
    mismatches: list[tuple[int, float, bool]]  # (position, llama.cpp's top-2 gap, near-tie?)

    @property
    def all_mismatches_near_ties(self) -> bool:
        return all(near for _, _, near in self.mismatches)


def compare(arrays: dict, prefix: str, ours: np.ndarray) -> Agreement:
    """Compare our logits [n, n_vocab] with llama.cpp's recorded `prefix` rows."""
    lp_ours = log_softmax(ours)
    if f"{prefix}_logits" in arrays:
        ref = arrays[f"{prefix}_logits"].astype(np.float64)
        lp_ref = log_softmax(ref)
        p_ref = np.exp(lp_ref)
        kl = np.sum(p_ref * (lp_ref - lp_ours), axis=-1)
        rest = np.zeros(len(ref))
        top_sorted = -np.sort(-ref, axis=-1)[:, :2]
        absmax = np.abs(ref).max(axis=-1)
        ref_top1 = ref.argmax(axis=-1)
    else:
        ids = arrays[f"{prefix}_top_ids"]
        top = arrays[f"{prefix}_top_logits"].astype(np.float64)
        lp_ref = top - arrays[f"{prefix}_lse"][:, None]
        p_ref = np.exp(lp_ref)
        q = np.take_along_axis(lp_ours, ids, axis=-1)
        rest = np.clip(1.0 - p_ref.sum(-1), 1e-12, 1.0)
        q_rest = np.clip(1.0 - np.exp(q).sum(-1), 1e-12, 1.0)
        kl = np.sum(p_ref * (lp_ref - q), axis=-1) + rest * np.log(rest / q_rest)
        top_sorted = top[:, :2]
        absmax = arrays[f"{prefix}_absmax"]
        ref_top1 = ids[:, 0]
    agree = ours.argmax(axis=-1) == ref_top1
    gaps = top_sorted[:, 0] - top_sorted[:, 1]
    near = gaps < np.maximum(0.01, 2 * TOL * absmax)
    mismatches = [(int(p), float(gaps[p]), bool(near[p])) for p in np.nonzero(~agree)[0]]
    return Agreement(
        len(agree), float(agree.mean()), float(kl.mean()), float(np.mean(rest)), mismatches
    )
