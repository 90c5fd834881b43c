import numpy as np
import pytest

from refengine.errors import UserError
from refengine.quants import QTYPES, SUPPORTED, Q, dequantize, qtype, quantize, tensor_nbytes
from refengine.synthetic import random_kquant_blocks


def test_block_geometry_matches_the_format():
    # (values per block, bytes per block), written as sums of the block's fields (ggml-common.h)
    expected = {
        Q.F32: (1, 4),
        Q.F16: (1, 2),
        Q.BF16: (1, 2),
        Q.Q8_0: (32, 2 + 32),
        Q.Q4_0: (32, 2 + 16),
        Q.Q4_1: (32, 2 + 2 + 16),
        Q.Q5_0: (32, 2 + 4 + 16),
        Q.Q5_1: (32, 2 + 2 + 4 + 16),
        Q.Q4_K: (256, 2 + 2 + 12 + 128),
        Q.Q5_K: (256, 2 + 2 + 12 + 32 + 128),
        Q.Q6_K: (256, 128 + 64 + 16 + 2),
        Q.Q2_K: (256, 16 + 64 + 2 + 2),
        Q.Q3_K: (256, 32 + 64 + 12 + 2),
        Q.IQ4_NL: (32, 2 + 16),
        Q.IQ4_XS: (256, 2 + 2 + 4 + 128),
        Q.MXFP4: (32, 1 + 16),
    }
    assert set(QTYPES) == set(expected) == set(SUPPORTED)
    for t, (elems, nbytes) in expected.items():
        assert (QTYPES[t].block_elems, QTYPES[t].block_nbytes) == (elems, nbytes)
    assert QTYPES[Q.Q4_K].bits_per_weight == 4.5
    assert tensor_nbytes((4096, 4096), Q.Q8_0) == 4096 * 4096 // 32 * 34


def test_hand_worked_q8_0_block():
    # d = 0.5 (fp16 0x3800), quants 0..31 -> values 0, 0.5, 1, ..., 15.5
    block = np.concatenate(
        [
            np.frombuffer(np.float16(0.5).tobytes(), np.uint8),
            np.arange(32, dtype=np.int8).view(np.uint8),
        ]
    )
    np.testing.assert_array_equal(dequantize(block[None], Q.Q8_0, (1, 32))[0], np.arange(32) * 0.5)


# Independent decoders of single blocks, written from ggml's dequantize_row_* (ggml-quants.c), to
# check the table-driven path on random blocks without trusting gguf-py alone.


def _f16(b):
    return float(np.frombuffer(bytes(b[:2]), np.float16)[0])


def _q4_0(b):
    d, qs = _f16(b), b[2:18].astype(int)
    return [((qs[j] & 0xF) - 8) * d for j in range(16)] + [
        ((qs[j] >> 4) - 8) * d for j in range(16)
    ]


def _q5_0(b):
    d, qh, qs = _f16(b), int.from_bytes(bytes(b[2:6]), "little"), b[6:22].astype(int)
    lo = [(((qs[j] & 0xF) | (((qh >> j) << 4) & 0x10)) - 16) * d for j in range(16)]
    hi = [(((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10)) - 16) * d for j in range(16)]
    return lo + hi


def _q4_k(b):
    d, dmin, sc, qs = _f16(b), _f16(b[2:4]), b[4:16].astype(int), b[16:144].astype(int)

    def scale_min(j):
        if j < 4:
            return sc[j] & 63, sc[j + 4] & 63
        return (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4), (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4)

    out = []
    for chunk in range(4):  # 64 values: low nibbles, then high nibbles, of 32 bytes
        q = qs[32 * chunk : 32 * chunk + 32]
        for half, shift in ((0, 0), (1, 4)):
            s, m = scale_min(2 * chunk + half)
            out += [d * s * ((x >> shift) & 0xF) - dmin * m for x in q]
    return out


def _q6_k(b):
    ql, qh, d = b[0:128].astype(int), b[128:192].astype(int), _f16(b[208:210])
    sc = b[192:208].view(np.int8).astype(int)
    out = [0.0] * 256
    for n in range(2):  # two halves of 128 values
        l_, h_, s_ = ql[64 * n :], qh[32 * n :], sc[8 * n :]
        for i in range(32):
            q = [
                ((l_[i] & 0xF) | (((h_[i] >> 0) & 3) << 4)) - 32,
                ((l_[i + 32] & 0xF) | (((h_[i] >> 2) & 3) << 4)) - 32,
                ((l_[i] >> 4) | (((h_[i] >> 4) & 3) << 4)) - 32,
                ((l_[i + 32] >> 4) | (((h_[i] >> 6) & 3) << 4)) - 32,
            ]
            for k in range(4):
                out[128 * n + i + 32 * k] = d * s_[i // 16 + 2 * k] * q[k]
    return out


@pytest.mark.parametrize(
    "t,decode", [(Q.Q4_0, _q4_0), (Q.Q5_0, _q5_0), (Q.Q4_K, _q4_k), (Q.Q6_K, _q6_k)]
)
def test_dequantize_matches_an_independent_block_decoder(t, decode):
    rng = np.random.default_rng(int(t))
    q = qtype(t)
    blocks = rng.integers(0, 256, size=(6, q.block_nbytes), dtype=np.uint8)
    for off in {Q.Q4_0: [0], Q.Q5_0: [0], Q.Q4_K: [0, 2], Q.Q6_K: [208]}[t]:  # finite fp16 scales
        blocks[:, off : off + 2] = (
            rng.uniform(-0.1, 0.1, size=(6, 1)).astype(np.float16).view(np.uint8)
        )
    got = dequantize(blocks.reshape(1, -1), t, (1, 6 * q.block_elems))[0]
    want = np.concatenate([decode(b) for b in blocks])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantize_then_dequantize_is_close(t):
    rng = np.random.default_rng(int(t))
    x = rng.normal(size=(8, 64)).astype(np.float32)
    raw = quantize(x, t)
    assert raw.dtype == np.uint8 and raw.shape == (8, qtype(t).row_nbytes(64))
    y = dequantize(raw, t, x.shape)
    tol = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 2e-2}.get(t, 0.3)
    assert np.max(np.abs(y - x)) <= tol * np.max(np.abs(x))


@pytest.mark.parametrize("t", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS],
                         ids=lambda t: t.name)  # fmt: skip
def test_random_kquant_blocks_are_valid_and_scaled(t):
    rng = np.random.default_rng(0)
    raw = random_kquant_blocks(rng, (64, 512), t, std=0.05)
    y = dequantize(raw, t, (64, 512))
    assert np.isfinite(y).all()
    assert 0.04 < y.std() < 0.06
    assert abs(y.mean()) < 0.01


def test_unsupported_and_unknown_types_are_user_errors():
    with pytest.raises(UserError, match="IQ2_XXS is not supported"):
        qtype(Q.IQ2_XXS)
    with pytest.raises(UserError, match="unknown"):
        qtype(999)
    with pytest.raises(UserError, match="not a whole number"):
        qtype(Q.Q4_K).row_nbytes(100)


@pytest.mark.parametrize("t", [q.ggml for q in QTYPES.values() if q.scale_offsets],
                         ids=lambda t: t.name)  # fmt: skip
def test_the_tables_scale_fields_are_where_gguf_reads_them(t):
    """Doubling the fp16 fields the table names d, m and dmin doubles every value gguf-py
    dequantizes (value = d x q + m, or d x sc x q - dmin x m): a wrong offset scales quants."""
    q = QTYPES[t]
    rng = np.random.default_rng(3)
    if q.quantizable:
        blocks = quantize(rng.normal(0, 1, size=(8, 256)).astype(np.float32), t)
    else:
        blocks = random_kquant_blocks(rng, (8, 256), t, 1.0)
    blocks = blocks.reshape(-1, q.block_nbytes)
    doubled = blocks.copy()
    for at in q.scale_offsets:
        scales = doubled[:, at : at + 2].copy().view(np.float16)
        doubled[:, at : at + 2] = (scales * np.float16(2)).view(np.uint8)
    values = dequantize(blocks, t, (-1,))
    assert np.abs(values).max() > 0
    np.testing.assert_allclose(dequantize(doubled, t, (-1,)), 2 * values, rtol=1e-6)


def test_every_kernel_table_covers_the_types_its_engine_supports():
    from cudarun.blocks import DECODERS
    from cudarun.kernels.dequant import QUADS
    from refengine.quants import CPU, CUDA, supported

    assert {q.ggml for q in supported(CPU)} <= set(DECODERS)
    assert {q.ggml for q in supported(CUDA)} <= set(QUADS)


def test_a_type_the_engines_lack_is_refused_by_them_in_one_line(tmp_path, monkeypatch):
    """A planner-only type: the model opens and plans; each engine refuses it, naming it."""
    from dataclasses import replace

    from refengine import quants
    from refengine.engine import NumpyEngine
    from refengine.spec import load_spec
    from refengine.synthetic import SyntheticConfig, write_synthetic

    path = tmp_path / "q41.gguf"
    write_synthetic(path, SyntheticConfig("llama", n_layer=1, n_embd=64, n_ff=128, n_head=2,
                                          n_head_kv=2, n_vocab=300, qtype="Q4_1"))  # fmt: skip
    q41 = quants.QTYPES[Q.Q4_1]
    monkeypatch.setitem(quants.QTYPES, Q.Q4_1, replace(q41, engines=frozenset({quants.PLANNER})))
    spec = load_spec(path)
    assert spec.by_name["blk.0.ffn_up.weight"].qtype == Q.Q4_1
    with pytest.raises(UserError, match="the numpy engine cannot compute Q4_1 tensors yet"):
        NumpyEngine(spec)
    for engine in ("cpu", "standin", "cuda"):
        with pytest.raises(UserError, match=f"the {engine} engine cannot compute Q4_1"):
            quants.require(spec.qtypes, engine)
    quants.require({Q.Q8_0, Q.F32}, "cuda")
