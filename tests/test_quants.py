import numpy as np
import pytest
from gguf import quants as gq

from refengine.errors import UserError
from refengine.quants import QTYPES, SUPPORTED, Q, dequantize, qtype, quantize, tensor_nbytes
from refengine.synthetic import random_kquant_blocks


def test_block_geometry_matches_the_format():
    # (values per block, bytes per block), written as sums of the block's fields (ggml-common.h)
    expected = {
        Q.F32: (1, 4), Q.F16: (1, 2), Q.BF16: (1, 2),
        Q.Q8_0: (32, 2 + 32), Q.Q4_0: (32, 2 + 16), Q.Q4_1: (32, 2 + 2 + 16),
        Q.Q5_0: (32, 2 + 4 + 16), Q.Q5_1: (32, 2 + 2 + 4 + 16),
        Q.Q4_K: (256, 2 + 2 + 12 + 128), Q.Q5_K: (256, 2 + 2 + 12 + 32 + 128),
        Q.Q6_K: (256, 128 + 64 + 16 + 2),
    }
    assert set(QTYPES) == set(expected) == set(SUPPORTED)
    for t, (elems, nbytes) in expected.items():
        assert (QTYPES[t].block_elems, QTYPES[t].block_nbytes) == (elems, nbytes)
    assert QTYPES[Q.Q4_K].bits_per_weight == 4.5
    assert tensor_nbytes((4096, 4096), Q.Q8_0) == 4096 * 4096 // 32 * 34


def test_hand_worked_q8_0_block():
    # d = 0.5 (fp16 0x3800), quants 0..31 -> values 0, 0.5, 1, ..., 15.5
    block = np.concatenate([np.frombuffer(np.float16(0.5).tobytes(), np.uint8),
                            np.arange(32, dtype=np.int8).view(np.uint8)])
    np.testing.assert_array_equal(dequantize(block[None], Q.Q8_0, (1, 32))[0], np.arange(32) * 0.5)


@pytest.mark.parametrize("t", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantize_then_dequantize_is_close_and_matches_gguf(t):
    rng = np.random.default_rng(int(t))
    x = rng.normal(size=(8, 64)).astype(np.float32)
    raw = quantize(x, t)
    assert raw.dtype == np.uint8 and raw.shape == (8, qtype(t).row_nbytes(64))
    y = dequantize(raw, t, x.shape)
    tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}.get(t, 0.3)
    assert np.max(np.abs(y - x)) <= tol * np.max(np.abs(x))
    if t not in (Q.F32, Q.F16):
        np.testing.assert_array_equal(y, gq.dequantize(raw, t).reshape(x.shape))


@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_random_kquant_blocks_are_valid_and_scaled(t):
    rng = np.random.default_rng(0)
    raw = random_kquant_blocks(rng, (64, 512), t, std=0.05)
    y = dequantize(raw, t, (64, 512))
    assert np.isfinite(y).all()
    assert 0.04 < y.std() < 0.06
    assert abs(y.mean()) < 0.01
    np.testing.assert_array_equal(y, gq.dequantize(raw, t).reshape(64, 512))


def test_unsupported_and_unknown_types_are_user_errors():
    with pytest.raises(UserError, match="Q2_K is not supported"):
        qtype(Q.Q2_K)
    with pytest.raises(UserError, match="unknown"):
        qtype(999)
    with pytest.raises(UserError, match="not a whole number"):
        qtype(Q.Q4_K).row_nbytes(100)
