"""llama4 (Llama-4 Scout, Maverick), planned for llama.cpp: every interleave_moe_layer_step-th
layer routed beside one shared expert, the others dense, and 3 of every 4 layers attending within
chunks of 8192 tokens, cached as a sliding window (docs/llamacpp-architectures.md, 2.6). Its files
read as llama.cpp lays them out, real llama.cpp allocates the KV and compute buffers planned, and
a plan over two RPC servers verifies."""

from __future__ import annotations

import pytest

from refengine.spec import load_spec
from refengine.synthetic import SyntheticConfig, preset, spec_from_hparams, write_synthetic
from solver.groups import tensor_groups
from solver.memory import KVShape, kv_layer_nbytes

from .conftest import refengine
from .rpc_verify import verify_over_two_servers

# with rope_freqs, as Meta's files convert (llama3 RoPE scaling)
L4 = SyntheticConfig("llama4", n_layer=8, n_embd=512, n_ff=1024, n_head=8, n_head_kv=2,
                     head_dim=64, n_vocab=8000, qtype="Q8_0", n_expert=16, n_expert_used=1,
                     n_ff_exp=384, moe_every=2, rope_freqs=True, seed=11)  # fmt: skip


def test_a_llama4_file_reads_as_llama_cpp_lays_it_out(tmp_path):
    spec = load_spec(write_synthetic(tmp_path / "l4.gguf", L4))
    hp, by = spec.hparams, spec.by_name
    assert spec.arch.name == "llama4" and not spec.arch.engines
    assert [hp.routed(il) for il in range(8)] == [False, True] * 4
    assert by["blk.1.ffn_up_exps.weight"].shape == (16, 384, 512)
    assert by["blk.1.ffn_up_shexp.weight"].shape == (384, 512)  # one shared expert, as wide
    assert by["blk.2.ffn_up.weight"].shape == (1024, 512) and "blk.2.ffn_gate_inp.weight" not in by
    # chunks of 8192 on three of every four layers, whatever window the file names
    assert hp.n_swa == 8192 and hp.swa_layers == (True, True, True, False) * 2
    # RoPE's factors, global, placed with the first layer as llama.cpp places them
    assert by["rope_freqs.weight"].shape == (32,) and by["rope_freqs.weight"].layer is None
    first = next(g for g in tensor_groups(spec) if g.name == "blk.0.attn")
    assert "rope_freqs.weight" in first.tensors


@pytest.mark.parametrize("window,chunk", [(None, 8192), (4096, 8192), (0, 0)])
def test_llama4_attends_in_chunks_of_8192_unless_its_window_is_0(tmp_path, monkeypatch, window,
                                                                  chunk):
    """llama.cpp chunks by 8192 whether the file names no window or another one; 0 turns it off."""
    from gguf import GGUFWriter

    add = GGUFWriter.add_sliding_window
    monkeypatch.setattr(GGUFWriter, "add_sliding_window",
                        lambda self, n: None if window is None else add(self, window))
    hp = load_spec(write_synthetic(tmp_path / "l4.gguf", L4)).hparams
    assert hp.n_swa == chunk and hp.swa_layers == ((True, True, True, False) * 2 if chunk else ())


def test_a_llama4_file_without_its_interleave_step_is_refused_naming_it(tmp_path, monkeypatch):
    from gguf import GGUFWriter

    monkeypatch.setattr(GGUFWriter, "add_interleave_moe_layer_step", lambda self, n: None)
    r = refengine("info", write_synthetic(tmp_path / "l4.gguf", L4))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "'llama4.interleave_moe_layer_step' is missing" in r.stderr


def test_llama4_maverick_has_its_published_parameters():
    # meta-llama: Maverick 400B parameters, a routed layer every second; Scout's language model
    spec = spec_from_hparams(preset("llama-4-maverick"))
    assert spec.n_params / 1e9 == pytest.approx(400, rel=0.005)
    assert sum(spec.hparams.routed(il) for il in range(48)) == 24


def test_kv_and_compute_buffers_of_chunked_attention_as_llamacpp_allocates(tmp_path, llama_bin,
                                                                           rpc_servers):
    """Beyond the chunk, the chunked layers' cache stops at 8192 + a ubatch of cells and the full
    layers' grows: the KV to the byte and the compute buffer within a tenth of a MiB."""
    from solver.llamacpp_check import MIB, parse_load_log, run_llamacpp
    from solver.memory import llamacpp_compute_nbytes

    path = write_synthetic(tmp_path / "l4.gguf", L4)
    spec = load_spec(path)
    args = ["--rpc", rpc_servers[0], "-dev", "RPC0", "-fit", "off", "-ngl", "99", "-c", "16384",
            "-b", "2048", "-ub", "512", "-fa", "on"]  # fmt: skip
    log = parse_load_log(run_llamacpp(llama_bin, str(path), args), spec)
    kv = KVShape(n_ctx=16384)
    assert log.buffers["RPC0"].kv_bytes == sum(kv_layer_nbytes(spec, il, kv) for il in range(8))
    planned = llamacpp_compute_nbytes(spec, 512, 16384, True, 512)
    assert abs(log.buffers["RPC0"].compute_bytes - planned) <= 0.1 * MIB


def test_exported_flags_keep_rope_freqs_with_the_first_layer(tmp_path, llama_bin, rpc_servers):
    """Layers 0-3 on RPC0, layers 4-7 and the head on RPC1: llama.cpp loads rope_freqs, a global
    tensor, with layer 0 on RPC0 (not with the head), as the plan and its flags say."""
    from solver.cost import PINNED, Loc, TierPlacement
    from solver.export import llamacpp_args, tensor_devices
    from solver.llamacpp_check import on_rpc, parse_load_log, run_llamacpp

    path = write_synthetic(tmp_path / "l4.gguf", L4)
    spec = load_spec(path)
    device = lambda il: 0 if il is not None and il < 4 else 1  # noqa: E731
    place = TierPlacement({g.name: Loc(PINNED, device=device(g.layer)) for g in
                           tensor_groups(spec)},
                          {il: Loc(PINNED, device=device(il)) for il in range(8)})  # fmt: skip
    place.groups["token_embd"] = Loc("cpu")
    args = llamacpp_args(spec, place, 4096, "f16", True, n_devices=2)
    assert "-ot" not in args  # where llama.cpp puts it unasked
    log = parse_load_log(run_llamacpp(llama_bin, str(path), on_rpc(args, rpc_servers[:2])), spec)
    want = {name: dev.replace("CUDA", "RPC") for name, dev in tensor_devices(spec, place).items()}
    assert log.tensors == want and log.tensors["rope_freqs.weight"] == "RPC0"


def test_verify_a_llama4_plan_over_two_rpc_servers(tmp_path, llama_bin, rpc_servers):
    """Solved over two llama.cpp RPC servers of unequal budgets, exported and run in real
    llama.cpp: every tensor where the plan put it, each device's memory within 3% + 4 MiB of the
    plan and within its budget; the device that holds the head alone reserves for the head
    (docs/measured/2026-11-28-verify-llama4.txt)."""
    path = write_synthetic(tmp_path / "l4.gguf", L4)
    out = verify_over_two_servers(path, tmp_path, llama_bin, rpc_servers, "64MiB,48MiB", 16384)
    assert "-ts 4,1" in out  # RPC1 holds the head alone
