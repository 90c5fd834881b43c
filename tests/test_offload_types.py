"""The offload quants (Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4): files of them open, are sized and
planned; llama.cpp and the reference engine (gguf-py dequantizes them) run them; the engines with
kernels of their own refuse them in one line."""

from __future__ import annotations

import pytest

from refengine.errors import UserError
from refengine.quants import Q, qtype
from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, write_synthetic

from .conftest import refengine
from .llamacpp_run import assert_both_run

TYPES = ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4")


def typed_llama(qtype_name: str) -> SyntheticConfig:
    # rows of 256: whole blocks of every type
    return SyntheticConfig("llama", n_layer=2, n_embd=256, n_ff=512, n_head=4, n_head_kv=2,
                           n_vocab=300, qtype=qtype_name, seed=11)  # fmt: skip


@pytest.mark.parametrize("name", TYPES)
def test_an_offload_quant_is_sized_planned_and_run(tmp_path, llama_bin, name):
    from cudarun.cpu_engine import CpuEngine

    path = write_synthetic(tmp_path / f"{name}.gguf", typed_llama(name))
    spec = load_spec(path)
    up = spec.by_name["blk.0.ffn_up.weight"]
    assert up.qtype == Q[name]
    assert up.nbytes == 512 * 256 // qtype(name).block_elems * qtype(name).block_nbytes
    assert spec.file_nbytes >= spec.weights_nbytes
    r = refengine("solve", path, "--profile", "h100", "--budget", "2MiB", "--target", "llamacpp",
                  "--time-limit", "2")  # fmt: skip
    assert r.returncode == 0, r.stderr[-800:]
    with pytest.raises(UserError, match=f"the cpu engine cannot compute {name} tensors yet"):
        CpuEngine(spec)
    assert_both_run(path, llama_bin)
