"""Helpers shared by the kernel tests: random GGUF blocks, the normwise error, poisoned outputs."""

import numpy as np
from gguf import GGMLQuantizationType as Q

from cudarun.blocks import DECODERS, layout
from cudarun.kernels import int8
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


def quantize_host(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What `int8.quantize_gpu` writes, in NumPy: (xq, xds) as uint64 words."""
    n_tokens, n_cols = x.shape
    groups = x.reshape(n_tokens, -1, int8.GROUP)
    d = np.abs(groups).max(axis=2) / np.float32(127.0)
    inv = np.divide(np.float32(1.0), d, out=np.zeros_like(d), where=d > 0)
    scaled = groups * inv[:, :, None]
    q = (np.sign(scaled) * np.floor(np.abs(scaled) + np.float32(0.5))).astype(np.int32)
    s = q.sum(axis=2).astype(np.float32) * d
    xq = q.astype(np.int8).reshape(-1).view(np.uint64)
    xds = np.stack([d, s], axis=2).astype(np.float32).reshape(-1).view(np.uint64)
    return xq, xds
