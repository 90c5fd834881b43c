from dataclasses import replace

import numpy as np
import pytest
from gguf import GGUFReader

from refengine.gguf_file import read_gguf
from refengine.layout import tensor_layout
from refengine.spec import (
    ATTENTION,
    EMBEDDING,
    EXPERT,
    FFN,
    NORM,
    OUTPUT,
    ROUTER,
    load_spec,
    tensor_role,
)
from refengine.synthetic import PRESETS, preset, spec_from_hparams

from .conftest import SMALL, tiny_gguf


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_spec_of_a_synthetic_file_round_trips_its_config(small_models, arch):
    spec = load_spec(small_models[arch])
    cfg = SMALL[arch]
    assert spec.arch.name == arch
    stored = cfg.hparams()  # GGUF keeps floats as float32
    assert spec.hparams == replace(stored, rms_eps=float(np.float32(stored.rms_eps)))
    assert spec.path is not None and spec.file_nbytes == small_models[arch].stat().st_size
    expected = spec_from_hparams(cfg)
    assert [(t.name, t.shape, t.qtype, t.nbytes, t.layer, t.role) for t in spec.tensors] == [
        (t.name, t.shape, t.qtype, t.nbytes, t.layer, t.role) for t in expected.tensors
    ]


@pytest.mark.parametrize("arch", sorted(SMALL))
def test_our_reader_agrees_with_gguf_py(small_models, arch):
    ours, theirs = read_gguf(small_models[arch]), GGUFReader(small_models[arch])
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.ne == tuple(int(d) for d in b.shape) and a.ggml_type == int(b.tensor_type)
        assert a.offset == b.data_offset
    for key, f in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        v, w = ours.fields[key], f.contents()
        assert (np.asarray(v).tolist() if isinstance(v, np.ndarray) else v) == pytest.approx(w), key


def test_roles():
    assert tensor_role("token_embd.weight") == EMBEDDING
    assert tensor_role("output.weight") == OUTPUT
    assert tensor_role("output_norm.weight") == NORM
    assert tensor_role("blk.3.attn_output.weight") == ATTENTION
    assert tensor_role("blk.3.attn_q.bias") == ATTENTION
    assert tensor_role("blk.3.attn_k_norm.weight") == NORM
    assert tensor_role("blk.3.post_ffw_norm.weight") == NORM
    assert tensor_role("blk.3.ffn_up.weight") == FFN
    assert tensor_role("blk.3.ffn_gate_inp.weight") == ROUTER
    assert tensor_role("blk.3.ffn_down_exps.weight") == EXPERT


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_real_models_have_the_layout_of_their_preset(name):
    from refengine.models import resolve_model

    spec = load_spec(resolve_model(name))
    cfg = PRESETS[name]
    assert spec.hparams.n_layer == cfg.n_layer and spec.hparams.n_embd == cfg.n_embd
    layout = tensor_layout(spec.arch, spec.hparams, cfg.tied_output)
    assert sorted((s.name, s.shape) for s in layout) == sorted(
        (t.name, t.shape) for t in spec.tensors
    )
    if name == "gemma3-270m":
        hp = spec.hparams
        assert (hp.n_swa, hp.rope_base, hp.rope_base_swa) == (512, 1e6, 1e4)
        assert [il for il in range(hp.n_layer) if not spec.is_swa(il)] == [5, 11, 17]


def test_spec_only_presets_have_plausible_sizes():
    gib = 2**30
    seventy = spec_from_hparams(preset("llama3-70b"))
    assert seventy.path is None and 68e9 < seventy.n_params < 72e9
    assert 36 * gib < seventy.weights_nbytes < 40 * gib  # Q4_K, 4.5 bits per weight
    moe = spec_from_hparams(preset("qwen3moe-235b-a22b"))
    assert 230e9 < moe.n_params < 240e9
    experts = sum(t.nbytes for t in moe.tensors if t.role == EXPERT)
    assert experts > 0.9 * moe.weights_nbytes
    big = spec_from_hparams(preset("qwen3.5-122b-a10b"))
    assert 121.5e9 < big.n_params < 122.5e9  # Qwen: 122B


def test_missing_required_metadata_is_a_user_error(tmp_path):
    from refengine.errors import UserError

    p = tiny_gguf(
        tmp_path / "bare.gguf",
        "llama",
        {"token_embd.weight": (np.zeros((4, 8), np.float32), None)},
        embedding_length=8,
    )
    with pytest.raises(UserError, match="llama.attention.head_count' is missing"):
        load_spec(p)


def _with_tensors(src, dst, drop=(), extra=None, reshape=None):
    """Copy a GGUF (metadata as the synthetic writer wrote it) with tensors dropped, added or
    reshaped."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.array(t.data)
        if reshape and t.name in reshape:
            data = np.zeros(reshape[t.name], np.float32)
        w.add_tensor(t.name, data, raw_dtype=None if data.dtype == np.float32 else t.tensor_type)
    for name, data in (extra or {}).items():
        w.add_tensor(name, data)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    return dst


def test_files_that_break_the_layout_are_refused(small_models, tmp_path):
    from refengine.errors import UserError

    src = small_models["llama"]
    cases = [
        ({"drop": ["blk.1.ffn_up.weight"]}, "missing"),
        (
            {"extra": {"blk.0.ffn_gate_exps.weight": np.zeros((2, 128, 64), np.float32)}},
            "not part of the llama layout",
        ),
        ({"reshape": {"blk.0.attn_norm.weight": (32,)}}, "has shape"),
    ]
    for i, (change, message) in enumerate(cases):
        with pytest.raises(UserError, match=message):
            load_spec(_with_tensors(src, tmp_path / f"bad{i}.gguf", **change))
    # an optional bias is accepted (llama.cpp applies Q/K/V biases wherever they are present)
    ok = _with_tensors(
        src, tmp_path / "bias.gguf", extra={"blk.0.attn_q.bias": np.zeros(64, np.float32)}
    )
    assert "blk.0.attn_q.bias" in load_spec(ok).by_name


@pytest.mark.parametrize(
    "keys,message",
    [
        ({"rope_scaling_type": "yarn"}, "RoPE scaling 'yarn' is not supported"),
        ({"head_count": "nine"}, "is not a single int"),
    ],
)
def test_unsupported_or_mistyped_metadata_is_refused(tmp_path, keys, message):
    from gguf import GGUFWriter

    from refengine.errors import UserError

    p = tmp_path / "m.gguf"
    w = GGUFWriter(p, "llama")
    w.add_embedding_length(64), w.add_block_count(1), w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-5)
    if "head_count" in keys:
        w.add_string("llama.attention.head_count", keys["head_count"])
    else:
        w.add_head_count(4)
        w.add_string("llama.rope.scaling.type", keys["rope_scaling_type"])
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(UserError, match=message):
        load_spec(p)


def test_gemma3_27b_gets_llamacpps_attention_scale():
    from refengine.synthetic import SyntheticConfig

    hp = SyntheticConfig(
        "gemma3", n_layer=62, n_embd=5376, n_head=32, n_head_kv=16, head_dim=128, n_ff=256
    ).hparams()
    assert hp.attn_scale == pytest.approx(1 / np.sqrt(5376 / 32))
    assert SyntheticConfig("gemma3", n_layer=6, head_dim=64).hparams().attn_scale == 1 / 8
