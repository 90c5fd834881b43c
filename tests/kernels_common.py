"""Helpers shared by the kernel tests: random GGUF blocks, the normwise error, poisoned outputs."""

import numpy as np
from gguf import GGMLQuantizationType as Q

from cudarun.blocks import DECODERS, layout
from refengine.agreement import normwise  # noqa: F401  (the kernel tests' error measure)
from refengine.quants import quantize
from refengine.synthetic import random_kquant_blocks

TYPES = sorted(DECODERS, key=lambda t: t.name)


def weights(rng, qtype, n_rows, n_cols):
    """Random blocks of `qtype` (gguf-py cannot quantize the K-quants: random valid blocks)."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_kquant_blocks(rng, (n_rows, n_cols), qtype, 1.0).reshape(-1)
    return quantize(rng.standard_normal((n_rows, n_cols)).astype(np.float32), qtype).reshape(-1)


def cols(qtype, at_least):
    """A row length of whole blocks."""
    per_block = layout(qtype)[1]
    return max(at_least, per_block)


def poisoned(shape):
    from numba import cuda

    return cuda.to_device(np.full(shape, np.nan, np.float32))
