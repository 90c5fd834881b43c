"""The NumPy engine's own consistency: the KV cache, ubatch chunking, recording, errors."""

import numpy as np
import pytest

from refengine.engine import NumpyEngine
from refengine.errors import UserError

from .conftest import SMALL

ARCHES = sorted(SMALL)


@pytest.mark.parametrize("arch", ARCHES)
def test_prefill_decode_and_chunking_agree(small_models, arch):
    tokens = np.random.default_rng(0).integers(2, 300, size=23)
    whole = NumpyEngine(small_models[arch]).prefill(tokens, all_logits=True)
    assert whole.shape == (23, 300) and whole.dtype == np.float32 and np.isfinite(whole).all()

    chunked = NumpyEngine(small_models[arch], n_ubatch=4)
    np.testing.assert_allclose(
        chunked.prefill(tokens, all_logits=True), whole, rtol=1e-4, atol=1e-4
    )

    stepwise = NumpyEngine(small_models[arch])
    first = stepwise.prefill(tokens[:10])
    np.testing.assert_allclose(first, whole[9], rtol=1e-4, atol=1e-4)
    for i in range(10, 23):
        np.testing.assert_allclose(stepwise.decode(tokens[i]), whole[i], rtol=1e-4, atol=1e-4)
    assert stepwise.n_past == 23


def test_reset_forgets_the_sequence(small_models):
    e = NumpyEngine(small_models["llama"])
    a = e.prefill([5, 6, 7])
    e.decode(9)
    e.reset()
    assert e.n_past == 0
    np.testing.assert_array_equal(e.prefill([5, 6, 7]), a)


def test_sliding_window_changes_only_what_it_should(small_models):
    """gemma3 with window 5: logits at position p depend on tokens older than p-4 only through
    the global layer (layer 5), so changing token 0 changes position 12's logits."""
    e = NumpyEngine(small_models["gemma3"])
    hp = e.spec.hparams
    assert hp.n_swa == 5 and hp.swa_layers == (True,) * 5 + (False,)
    t = np.arange(2, 15)
    a = e.prefill(t, all_logits=True, record={"blk.0.out"})
    e.reset()
    t2 = t.copy()
    t2[0] = 200
    b = e.prefill(t2, all_logits=True, record={"blk.0.out"})
    # after the first (sliding) layer, positions >= 5 cannot see token 0
    blk_a, blk_b = a[1]["blk.0.out"], b[1]["blk.0.out"]
    np.testing.assert_array_equal(blk_a[5:], blk_b[5:])
    assert not np.allclose(blk_a[:5], blk_b[:5])
    assert not np.allclose(a[0][12], b[0][12])  # the global layer still sees it


def test_record_returns_named_activations(small_models):
    e = NumpyEngine(small_models["qwen3moe"])
    names = {"blk.0.out", "blk.1.out", "output_norm", "logits"}
    logits, acts = e.prefill([3, 4, 5, 6], record=names)
    assert set(acts) == names
    assert acts["blk.1.out"].shape == (4, 64) and acts["output_norm"].shape == (4, 64)
    np.testing.assert_array_equal(acts["logits"], logits)
    logits, acts = e.decode(7, record={"blk.0.out"})
    assert set(acts) == {"blk.0.out"} and acts["blk.0.out"].shape == (1, 64)


def test_context_overflow_is_a_user_error(small_models):
    e = NumpyEngine(small_models["llama"], n_ctx=8)
    e.prefill(list(range(2, 9)))
    e.decode(3)
    with pytest.raises(UserError, match="context of 8"):
        e.decode(4)
    with pytest.raises(UserError, match="empty"):
        NumpyEngine(small_models["llama"]).prefill([])


def test_recording_spans_ubatches(small_models):
    tokens = list(range(3, 14))
    whole = NumpyEngine(small_models["qwen2"]).prefill(tokens, record={"blk.1.out", "output_norm"})
    chunked = NumpyEngine(small_models["qwen2"], n_ubatch=4).prefill(
        tokens, record={"blk.1.out", "output_norm"}
    )
    for name in ("blk.1.out", "output_norm"):
        assert chunked[1][name].shape == (11, 64)
        np.testing.assert_allclose(chunked[1][name], whole[1][name], rtol=1e-4, atol=1e-5)


def test_bad_token_ids_are_user_errors(small_models):
    e = NumpyEngine(small_models["llama"])
    for bad in ([-1, 3], [300], [3.7]):
        with pytest.raises(UserError, match="token ids"):
            e.prefill(bad)
    with pytest.raises(UserError, match="token ids"):
        e.decode(300)
    assert e.n_past == 0
