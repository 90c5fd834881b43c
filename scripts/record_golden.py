"""Record llama.cpp's tokens and logits as small committed fixtures (tests/fixtures/golden/).

Run once, in an environment with llama-cpp-python (it builds llama.cpp from source, ~8 min on two
cores), not in CI:

    python -m venv /tmp/llama && /tmp/llama/bin/pip install llama-cpp-python==0.3.36 gguf numpy
    /tmp/llama/bin/python scripts/record_golden.py

For each model (the two real ones and one synthetic file per architecture) it records:
- tokenizer: llama.cpp's ids of a set of test strings (add_special=True, parse_special=False);
- three greedy cases: the prompt's ids and llama.cpp's 32-token greedy continuation, with llama.cpp's
  float32 logits at every position along prompt + continuation;
- one long prompt (>= 64 tokens; past the sliding window for both gemma3 files) with the logits
  of every position.
Logits are stored whole for small vocabularies, else as the top 64 (ids, values) plus the
log-sum-exp of the full row, which is enough for top-1 agreement and a KL bound
(tests/golden.py). llama.cpp runs with its defaults (f16 KV cache) on 2 threads.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llama_cpp import Llama, __version__ as llama_cpp_version  # noqa: E402

from refengine.models import resolve_model  # noqa: E402
from refengine.synthetic import write_synthetic  # noqa: E402
from tests.golden import (  # noqa: E402
    FIXTURE_DIR,
    GREEDY_PROMPTS,
    LONG_TEXT,
    N_CONTINUE,
    SYNTHETIC_CASES,
    SYNTHETIC_LONG_CHARS,
    TOKENIZER_STRINGS,
    TOP_K,
    synthetic_path,
)


def logit_record(rows: np.ndarray, full: bool) -> dict:
    rows = rows.astype(np.float32)
    m = rows.max(axis=1, keepdims=True)
    lse = (m[:, 0] + np.log(np.exp(rows - m).sum(axis=1))).astype(np.float32)
    if full:
        return {"logits": rows}
    ids = np.argsort(-rows, axis=1, kind="stable")[:, :TOP_K].astype(np.int32)
    return {
        "top_ids": ids,
        "top_logits": np.take_along_axis(rows, ids, axis=1),
        "lse": lse,
        "absmax": np.abs(rows).max(axis=1),
    }


def run_greedy(llm: Llama, prompt_ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    llm.reset()
    llm.eval(prompt_ids)
    out = []
    for _ in range(n):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        out.append(nxt)
        llm.eval([nxt])
    # logits at every position of prompt + continuation (the last one predicts past the end)
    return out, np.array(llm.scores[: llm.n_tokens], dtype=np.float32)


def record(name: str, path: Path, long_text: str, extra: dict) -> None:
    t0 = time.time()
    n_ctx = 2048
    llm = Llama(
        model_path=str(path),
        n_ctx=n_ctx,
        n_batch=512,
        n_threads=2,
        logits_all=True,
        seed=0,
        verbose=False,
    )
    n_vocab = llm.n_vocab()
    full = n_vocab <= 4096
    tok = lambda s: llm.tokenize(s.encode("utf-8"), add_bos=True, special=False)  # noqa: E731
    arrays, meta = (
        {},
        {
            "model": name,
            "n_vocab": n_vocab,
            "llama_cpp_version": llama_cpp_version,
            "full_logits": full,
            **extra,
        },
    )
    meta["tokenizer"] = [{"text": s, "ids": tok(s)} for s in TOKENIZER_STRINGS]
    meta["greedy"] = []
    for i, prompt in enumerate(GREEDY_PROMPTS):
        ids = tok(prompt)
        cont, logits = run_greedy(llm, ids, N_CONTINUE)
        meta["greedy"].append({"prompt": prompt, "prompt_ids": ids, "continuation": cont})
        for k, v in logit_record(logits, full).items():
            arrays[f"greedy{i}_{k}"] = v
    long_ids = tok(long_text)
    llm.reset()
    llm.eval(long_ids)
    meta["long_ids"] = long_ids
    for k, v in logit_record(np.array(llm.scores[: len(long_ids)]), full).items():
        arrays[f"long_{k}"] = v
    FIXTURE_DIR.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(FIXTURE_DIR / f"{name}.npz", meta=np.array(json.dumps(meta)), **arrays)
    print(f"{name}: {len(long_ids)}-token long prompt, {time.time() - t0:.0f} s")


def write_f32_copy(src: Path, dst: Path) -> Path:
    """The same model with every tensor dequantized to F32 (metadata copied as it is)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    from refengine.quants import dequantize

    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    dst.parent.mkdir(parents=True, exist_ok=True)
    w = GGUFWriter(dst, arch)
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        value = 0 if key == "general.file_type" else f.contents()  # 0: all F32
        w.add_key_value(key, value, f.types[0], sub)
    for t in r.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type, shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def main() -> None:
    only = set(sys.argv[1:])
    # gemma3-270m's window is 512 tokens: the long prompt (~580 tokens) runs past it
    for name in ("smollm2-135m", "gemma3-270m"):
        if not only or name in only:
            record(name, resolve_model(name), LONG_TEXT, {})
        # The control: llama.cpp on an F32 copy of the same (dequantized) weights computes without
        # 8-bit activations, so it shows how much of the gap is llama.cpp's quantization noise.
        if not only or f"{name}-f32" in only:
            f32 = write_f32_copy(resolve_model(name), synthetic_path(f"{name}-f32"))
            record(f"{name}-f32", f32, LONG_TEXT, {"f32_copy_of": name})
    for name, cfg in SYNTHETIC_CASES.items():
        if not only or name in only:
            p = write_synthetic(synthetic_path(name), cfg)
            sha = hashlib.sha256(p.read_bytes()).hexdigest()
            record(name, p, LONG_TEXT[:SYNTHETIC_LONG_CHARS], {"synthetic_sha256": sha})


if __name__ == "__main__":
    main()
