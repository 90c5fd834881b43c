import numpy as np

from refengine.sampling import Sampler


def test_greedy_is_argmax():
    logits = np.random.default_rng(0).normal(size=100).astype(np.float32)
    assert Sampler(temperature=0.0)(logits) == int(np.argmax(logits))


def test_seeded_sampling_is_reproducible_and_respects_top_k_top_p():
    logits = np.random.default_rng(1).normal(size=50)
    draw = lambda s: [s(logits) for _ in range(200)]  # noqa: E731
    a, b = draw(Sampler(1.0, 0, 1.0, seed=7)), draw(Sampler(1.0, 0, 1.0, seed=7))
    assert a == b and len(set(a)) > 10
    top3 = set(np.argsort(-logits)[:3])
    assert set(draw(Sampler(1.0, 3, 1.0, seed=1))) <= top3
    assert set(draw(Sampler(5.0, 1, 1.0, seed=1))) == {int(np.argmax(logits))}
    # top-p: keep the smallest set of most likely tokens whose probability reaches p
    p = np.exp(logits - logits.max())
    p /= p.sum()
    order = np.argsort(-p)
    n_keep = int(np.searchsorted(np.cumsum(p[order]), 0.5) + 1)
    assert set(draw(Sampler(1.0, 0, 0.5, seed=2))) <= set(order[:n_keep])


def test_sampling_follows_the_distribution():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    s = Sampler(1.0, 0, 1.0, seed=3)
    counts = np.bincount([s(logits) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)
