"""Defaults shared by every command, each with its reason, in one place; click options read
them."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where fetched models and converted tokenizers are kept ($REFENGINE_CACHE overrides)."""
    return Path(os.environ.get("REFENGINE_CACHE") or Path.home() / ".cache" / "refengine")


# Context window when the user gives none: llama.cpp's habit for small machines, capped by the
# model's training context.
N_CTX = 4096
# Tokens per executed ubatch of a long prompt (llama.cpp's -ub default); the reference engine also
# chunks prefill by it, which bounds its attention scratch to n_ubatch x n_ctx per head.
N_UBATCH = 512
# Tokens to generate when -n is not given.
N_PREDICT = 64
# Sampling: greedy unless a temperature is given; top-k/top-p as llama.cpp's defaults.
TEMPERATURE = 0.0
TOP_K = 40
TOP_P = 0.95
SEED = 0

# Plan fingerprint inputs (docs/contracts.md), shared by solve, run and bench.
KV_TYPE = "f16"  # llama.cpp's default cache type
FLASH_ATTN = True  # llama.cpp's default (auto) turns it on where supported
THREADS = 0  # 0: the profile's CPU thread count
USERS = 1
GEN_TOKENS = 200  # the seeds' OSL; the prompt fills the rest of the context
# CP-SAT's deterministic time for all tiers of a plan together: about 1.3 s of wall time per unit
# on the two-core machine, so an 80-layer model with 5 tiers solves in under 10 s with the build.
SOLVER_SECONDS = 6.0
