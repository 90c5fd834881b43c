"""MoE kernels against the reference's routing and expert mix, on the simulator at tiny shapes."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from refengine import reference as ref
from refengine.quants import dequantize

from .kernels_common import normwise, poisoned, weights


@pytest.mark.parametrize("normalize", [False, True])
def test_router_top_k_matches_the_reference(normalize):
    from numba import cuda

    from cudarun.kernels.moe import route_top_k

    logits = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32)
    # ties, the lower id first: within one lane's experts and across two lanes' (a warp of 4 lanes
    # on the simulator, 32 on a GPU)
    logits[3, 2] = logits[3, 6] = logits[3].max() + 1
    logits[4, 1] = logits[4, 7] = logits[4].max() + 1
    ids = cuda.to_device(np.full((5, 3), -7, np.int32))
    w = poisoned((5, 3))
    route_top_k(cuda.to_device(logits), 3, normalize, ids, w)
    want_ids, want_w = ref.moe_route(logits, 3, normalize)
    np.testing.assert_array_equal(ids.copy_to_host(), want_ids)
    assert normwise(w.copy_to_host(), want_w) < 1e-5


@pytest.mark.parametrize("qtype,act", [(Q.Q8_0, "silu"), (Q.Q4_1, "gelu")], ids=["Q8_0", "Q4_1"])
def test_moe_ffn_reads_only_the_chosen_experts(qtype, act):
    from numba import cuda

    from cudarun.kernels.moe import moe_ffn

    rng = np.random.default_rng(2)
    n_tokens, n_experts, k, d, n_ff = 2, 4, 2, 32, 32
    x = rng.standard_normal((n_tokens, d)).astype(np.float32)
    router = rng.standard_normal((n_tokens, n_experts)).astype(np.float32)
    gate, up = (weights(rng, qtype, n_experts * n_ff, d) for _ in range(2))
    down = weights(rng, qtype, n_experts * d, n_ff)
    # an expert no token chooses is poisoned: reading it would turn the output into NaN
    ids, w = ref.moe_route(router, k, True)
    unused = sorted(set(range(n_experts)) - set(ids.ravel().tolist()))
    for e in unused:
        for raw, rows, width in ((gate, n_ff, d), (up, n_ff, d), (down, d, n_ff)):
            nbytes = raw.size // n_experts
            raw[e * nbytes : (e + 1) * nbytes] = 0xFF  # fp16 scales of 0xFFFF: NaN
    assert unused, "the case needs an expert nobody picks"
    dev = [cuda.to_device(a) for a in (x, router, gate, up, down)]
    shapes = ((n_ff, d), (n_ff, d), (d, n_ff))
    got = moe_ffn(*dev, (qtype,) * 3, shapes, k, True, act).copy_to_host()

    def dense(raw, rows, width):
        return dequantize(raw, qtype, (n_experts * rows, width)).reshape(n_experts, rows, width)

    want = ref.moe_ffn(
        x, ids, w, dense(gate, n_ff, d), dense(up, n_ff, d), dense(down, d, n_ff), act
    )
    assert normwise(got, want) < 1e-3
