"""Greedy generation with the library API: tokenizer, reference engine and sampler.

.venv/bin/python examples/generate.py smollm2-135m "The capital of France is"
"""

import sys

from refengine.engine import NumpyEngine
from refengine.models import resolve_model
from refengine.sampling import Sampler
from refengine.tokenizer import Tokenizer

model, prompt = sys.argv[1], sys.argv[2]
path = resolve_model(model)
tok, engine, sample = Tokenizer.from_gguf(path), NumpyEngine(path), Sampler()

ids = tok.encode(prompt)
logits = engine.prefill(ids)
out = []
for _ in range(32):
    nxt = sample(logits)
    if nxt in tok.eog_ids:
        break
    out.append(nxt)
    logits = engine.decode(nxt)
print(prompt + tok.decode(out))
