"""The spec-only shape table and llama.cpp's Q4_K_M mix: real sizes, real file sizes."""

import pytest

from refengine.qmix import fit_rows, use_more_bits
from refengine.quants import Q
from refengine.synthetic import load_shapes, preset, shape_for, spec_from_hparams

from .conftest import refengine


def test_every_shape_names_its_source():
    for name, row in load_shapes().items():
        assert row["source"].startswith("huggingface.co/"), name
        assert row["arch"] and row["params"], name


@pytest.mark.parametrize(
    "name,gb",
    # published Q4_K_M files: bartowski/Meta-Llama-3.1-70B-Instruct-GGUF 42.52 GB,
    # Qwen/Qwen3-32B-GGUF 19.76 GB, Qwen/Qwen3-30B-A3B-GGUF 18.6 GB
    [("llama3-70b", 42.52), ("qwen3-32b", 19.76), ("qwen3moe-30b-a3b", 18.6)],
)
def test_q4_k_m_mix_matches_published_file_sizes(name, gb):
    spec = spec_from_hparams(preset(name, qtype="Q4_K_M"))
    assert sum(t.nbytes for t in spec.tensors) / 1e9 == pytest.approx(gb, rel=0.01)


def test_q4_k_m_picks_q6_k_where_llama_cpp_does():
    spec = spec_from_hparams(preset("llama3-8b", qtype="Q4_K_M"))
    types = {t.name: t.qtype for t in spec.tensors}
    more = [il for il in range(32) if use_more_bits(il, 32)]
    # the first and last eighth, and every third layer from the eighth on
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    for il in range(32):
        want = Q.Q6_K if il in more else Q.Q4_K
        assert types[f"blk.{il}.ffn_down.weight"] == want
        assert types[f"blk.{il}.attn_v.weight"] == want
        assert types[f"blk.{il}.ffn_up.weight"] == Q.Q4_K
    assert types["output.weight"] == Q.Q6_K and types["token_embd.weight"] == Q.Q4_K
    # a 70B llama's attn_v gets Q5_K where it would get Q4_K
    big = {t.name: t.qtype for t in spec_from_hparams(preset("llama3-70b", qtype="Q4_K_M")).tensors}
    assert big["blk.10.attn_v.weight"] == Q.Q5_K and big["blk.9.attn_v.weight"] == Q.Q6_K


def test_rows_that_are_not_whole_blocks_fall_back_as_llama_cpp_does():
    assert fit_rows(Q.Q4_K, 640) == Q.Q5_0  # Gemma-3 270M's 640-wide rows
    assert fit_rows(Q.Q6_K, 640) == Q.Q8_0
    assert fit_rows(Q.Q4_K, 4096) == Q.Q4_K


def test_arch_and_params_name_a_shape():
    assert shape_for("qwen3moe", "30b-a3b") == "qwen3moe-30b-a3b"
    r = refengine("solve", "--arch", "llama", "--params", "13B")
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "no shape for --arch llama --params 13B" in r.stderr and "llama 70B" in r.stderr


def test_solve_a_spec_only_q4_k_m_model(tmp_path):
    out = tmp_path / "plan.json"
    r = refengine(
        "solve", "--arch", "llama", "--params", "8B", "--qtype", "Q4_K_M", "--budget", "4GiB",
        "--tiers", "1,512", "--time-limit", "2", "--profile", "rtx5080-xeon-w5-3425", "-o", out,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "llama3-8b:Q4_K_M" in out.read_text()
