"""The decode kernels' static peer gate (cudarun.sass_check): its reading of SASS on a small
function whose counts are known, and the gate itself, ours beside llama.cpp's mmvq.cu compiled by
the same CUDA release (no GPU: nvcc, ptxas and nvdisasm from the wheels)."""

import dataclasses

import pytest

from cudarun import sass_attention, sass_check, sass_dequant

SASS = """
        //--------------------- .text.kern --------------------------
        .text.kern:
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   ISETP.GE.U32.AND P0, PT, R0, UR4, PT ;
        /*0020*/               @P0 BRA `(.L_x_1) ;
.L_x_0:
        /*0030*/                   LDG.E R2, desc[UR6][R4.64] ;
        /*0040*/               @P1 BRA `(.L_x_2) ;
        /*0050*/                   IDP.4A.S8.S8 R3, R2, R2, R3 ;
.L_x_2:
        /*0060*/                   VIADD R0, R0, 0x40 ;
        /*0070*/                   ISETP.LT.U32.AND P0, PT, R0, UR4, PT ;
        /*0080*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0090*/                   STG.E desc[UR6][R6.64], R3 ;
        /*00a0*/                   EXIT ;
"""


def test_a_loops_iterations_are_counted_path_by_path():
    """Two paths through the loop (the dp4a skipped or not: 5 and 6 instructions), its counter
    stepped by 0x40, three instructions into it and two out of it."""
    (name, fn), = sass_check.sass_functions(SASS).items()
    assert name == "kern"
    c = sass_check.count(*fn)
    assert (c.loop_instructions, c.loop_min, c.loop_max) == (5.5, 5, 6)
    assert (c.step, c.outside, c.dp4a, c.widest_load_bits, c.narrow_loads) == (64, 5, 0.5, 32, 0)
    assert c.generic_loads == 0


def test_a_function_without_a_loading_loop_cannot_be_analysed():
    no_loads = SASS.replace("LDG.E R2, desc[UR6][R4.64]", "MOV R2, R4")
    with pytest.raises(sass_check.CannotAnalyse, match="no loop with global loads"):
        sass_check.count(*sass_check.sass_functions(no_loads)["kern"])
    no_step = SASS.replace("VIADD R0, R0, 0x40", "VIADD R0, R0, R9")
    with pytest.raises(sass_check.CannotAnalyse, match="no constant step"):
        sass_check.count(*sass_check.sass_functions(no_step)["kern"])


def test_the_gate_fails_a_kernel_above_the_ratio_loop_or_whole():
    c = sass_check.count(*sass_check.sass_functions(SASS)["kern"])
    ks = sass_check.KS
    row = sass_check.Row("Q8_0", 1, c, c, 110.0, 100.0, dict.fromkeys(ks, 100.0),
                         dict.fromkeys(ks, 100.0), 0.0, 0.0)  # fmt: skip
    assert sass_check.failures([row], 1.1) == []
    worse = dataclasses.replace(row, ours_loop_per_kib=111.0)
    want = "Q8_0 x1: loop 111 > 1.1 x 100 instructions per KiB"
    assert sass_check.failures([worse], 1.1) == [want]
    whole = dataclasses.replace(row, ours_whole_per_kib={ks[0]: 100.0, ks[1]: 120.0})
    assert len(sass_check.failures([whole], 1.1)) == 1
    # a weight read through a generic pointer (the expert kernel's first version chose its
    # buffer by a select): LD in the loop, counted as a load, and refused
    fn = sass_check.sass_functions(SASS.replace("LDG.E R2", "LD.E R2"))["kern"]
    generic = sass_check.count(*fn)
    assert generic.generic_loads == 1 and generic.loop_instructions == 5.5
    assert "generic loads" in sass_check.failures([dataclasses.replace(row, ours=generic)], 1.1)[0]



def test_a_kernels_longest_path_leaves_its_back_edges_out():
    """The dequantize report's count: entry, the loop body once (the dp4a taken), out, EXIT: 11;
    the branch around the loop is shorter (5)."""
    assert sass_dequant.longest_path(*sass_check.sass_functions(SASS)["kern"]) == 11


def test_the_gate_fails_a_dequantize_kernel_above_the_ratio():
    row = sass_dequant.DequantRow("Q8_0", 99, 484, 186.0, 228.0, 128, 32)
    assert sass_dequant.failures([row], 1.1) == []
    worse = dataclasses.replace(row, ours_per_kib=251.0)
    assert sass_dequant.failures([worse], 1.1) == [
        "dequantize Q8_0: 251 > 1.1 x 228 instructions per KiB of weights"]


def test_the_gate_fails_an_attention_kernel_above_the_ratio():
    c = sass_check.count(*sass_check.sass_functions(SASS)["kern"], stepped=False)
    keys = sass_attention.SPLIT_KEYS
    row = sass_attention.AttentionRow(128, 1, c, c, 49.0, 45.0, dict.fromkeys(keys, 50.0),
                                      dict.fromkeys(keys, 50.0))  # fmt: skip
    assert sass_attention.failures([row], 1.1) == []
    worse = dataclasses.replace(row, ours_loop_per_kib=50.0)
    assert sass_attention.failures([worse], 1.1) == [
        "attention D=128 x1: loop 50.0 > 1.1 x 45.0 instructions per KiB of KV"]
    split = dataclasses.replace(row, ours_whole_per_kib={keys[0]: 56.0, keys[1]: 50.0})
    assert "whole kernel at 512 keys" in sass_attention.failures([split], 1.1)[0]
    # a loop whose step is a launch's geometry: counted, its step left to the caller
    assert (c.step, c.loop_max) == (0, 6)


@pytest.mark.xdist_group("ptx")  # after test_ptx_gates, on its worker: it reads that build
def test_every_int8_decode_kernel_within_the_gate_of_llamacpps(llama_bin, tmp_path):
    """python -m cudarun.sass_check: each type and tokens per pass, and the expert matvec (beside
    llama.cpp's 1-token kernel, which takes expert ids), loop and whole kernel at
    K = 4096 and 14336, at most 1.1x llama.cpp's mul_mat_vec_q warp-instructions per KiB of
    weights (the first run compiles llama.cpp's mmvq.cu, minutes, then cached)."""
    import json
    import os
    import subprocess
    import sys

    out = tmp_path / "rows.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")  # the tests run with the simulator on
    r = subprocess.run([sys.executable, "-m", "cudarun.sass_check", "--json", str(out)],
                       capture_output=True, text=True, env=env)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    found = json.loads(out.read_text())
    rows = found["matvec"]
    kernels = {(q.name, t) for q in sass_check.GATED for t in sass_check.TIERS}
    kernels |= {(q.name + " experts", 1) for q in sass_check.GATED}
    assert {(r["kernel"], r["tier"]) for r in rows} == kernels
    for row in rows:  # both of the dp4a class, and the ratios the exit code stood for
        assert row["ours"]["dp4a"] > 0 and row["peer"]["dp4a"] > 0, row
        assert row["ours_loop_per_kib"] <= 1.1 * row["peer_loop_per_kib"], row
    # decode attention beside fattn-vec: every head dim at 1 and 2 query rows, loop and splits
    attention = found["attention"]
    assert {(a["head_dim"], a["rows"]) for a in attention} == {
        (d, n) for d in sass_attention.HEAD_DIMS for n in sass_attention.ROWS}
    for a in attention:
        assert a["ours_loop_per_kib"] <= 1.1 * a["peer_loop_per_kib"], a
        assert a["ours"]["widest_load_bits"] == a["peer"]["widest_load_bits"] == 128, a
    # the prefill's dequantization beside convert.cu's, every gated type, in 16-byte stores
    dequant = found["dequantize"]
    assert {d["kernel"] for d in dequant} == {q.name for q in sass_dequant.PEER_KERNELS}
    for d in dequant:
        assert 0 < d["ours_per_kib"] <= 1.1 * d["peer_per_kib"], d
        assert d["ours_store_bits"] == 128, d
    assert "46 of 46 kernels within 1.1x of llama.cpp" in r.stdout
