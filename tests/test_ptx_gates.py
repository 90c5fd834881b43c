"""The static gates on the CUDA kernels (issue 16): what `cudarun.ptx_check` reads from ptxas's `-v`
output and from the PTX, on literal text, and then every kernel assembled for sm_90 by ptxas from
the `nvidia-cuda-nvcc` wheel — no GPU needed."""

import pytest

from cudarun.ptx_check import PtxStats, Resources, file_stem, gate_failures, parse_ptx, parse_ptxas

# ptxas 13.5 -arch=sm_90 -v on a kernel that calls a non-inlined f64 pow (names shortened)
PTXAS_WITH_CALLEE = """\
ptxas info    : 48 bytes gmem
ptxas info    : Compiling entry function '_ZN7cudarun6matvecB2v5Exx' for 'sm_90'
ptxas info    : Function properties for _ZN7cudarun6matvecB2v5Exx
    1088 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1096 bytes cumulative stack size, 2048 bytes smem
ptxas info    : Compile time = 103.550 ms
ptxas info    : Function properties for __internal_accurate_pow
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""

# a clean kernel; older ptxas also prints the constant bank
PTXAS_CLEAN = """\
ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function '_ZN7cudarun4glue8add_biasEd' for 'sm_90'
ptxas info    : Function properties for _ZN7cudarun4glue8add_biasEd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 21 registers, used 0 barriers, 384 bytes cmem[0]
ptxas info    : Compile time = 9.170 ms
"""


def test_ptxas_resources_of_an_entry_and_its_callees():
    assert parse_ptxas(PTXAS_WITH_CALLEE) == Resources(
        registers=40, shared_bytes=2048, stack_bytes=1096, spill_store_bytes=12, spill_load_bytes=8
    )
    assert parse_ptxas(PTXAS_CLEAN) == Resources(21, 0, 0, 0, 0)


def test_ptxas_output_without_one_entry_is_refused():
    with pytest.raises(ValueError, match="2 entry functions"):
        parse_ptxas(PTXAS_CLEAN + PTXAS_CLEAN)
    with pytest.raises(ValueError, match="Used N registers"):
        parse_ptxas(PTXAS_CLEAN.replace("Used 21 registers", "Used registers"))


PTX = """\
.version 9.5
.target sm_90
.address_size 64

	// .globl	_Z4rope  (a comment that says .f64 is not an instruction)
.visible .entry _Z4rope(
	.param .u64 _Z4rope_param_0,
	.param .f64 _Z4rope_param_1,
	.param .f32 _Z4rope_param_2,
	.param .f64 _Z4rope_param_3
)
{
	.reg .pred 	%p<3>;
	.reg .f64 	%fd<12>;

	ld.param.f64 	%fd1, [_Z4rope_param_1];
	ld.global.u8 	%rs1, [%rd1];
	@%p1 ld.global.nc.L1::no_allocate.v4.u32 	{%r1, %r2, %r3, %r4}, [%rd2];
	ld.global.nc.v2.f32 	{%f1, %f2}, [%rd3];
	cvt.f64.f32 	%fd2, %f1;
	fma.rn.f64 	%fd3, %fd2, %fd1, 0d3FF0000000000000;
	@!%p2 cvt.rn.f32.f64 	%f3, %fd3;
	st.global.f32 	[%rd4], %f3;
$L__BB0_2:
	ret;
}
.func  (.param .b64 func_retval0) __internal_accurate_pow(
	.param .b64 __internal_accurate_pow_param_0
)
{
	mul.rn.f64 	%fd4, %fd3, %fd3;
}
"""


def test_ptx_f64_instructions_parameters_and_the_widest_global_load():
    # ld.param.f64, cvt.f64.f32, fma.rn.f64, the guarded cvt.rn.f32.f64, and the callee's mul
    assert parse_ptx(PTX) == PtxStats(
        f64_instructions=5, f64_params=2, widest_load="v4.u32", widest_load_bits=128
    )
    clean = "\n".join(line for line in PTX.splitlines() if "f64" not in line and "v4" not in line)
    assert parse_ptx(clean) == PtxStats(0, 0, "v2.f32", 64)


def test_the_gate_names_each_failure():
    clean = Resources(32, 128, 0, 0, 0), PtxStats(0, 0, "v4.u32", 128)
    assert gate_failures(*clean) == []
    assert gate_failures(Resources(40, 2048, 1088, 8, 4), PtxStats(330, 1, "u8", 8)) == [
        "1088 B stack frame",
        "spills 8/4 B",
        "330 f64 instructions",
        "1 f64 parameters",
    ]


def test_kernel_names_as_file_names():
    assert file_stem("matvec[Q4_K]") == "matvec_Q4_K"
    assert file_stem("rms_norm") == "rms_norm"


def _ptx_check(*args):
    """python -m cudarun.ptx_check with the simulator off (the tests run with it on)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    cmd = [sys.executable, "-m", "cudarun.ptx_check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def test_ptx_check_out_writes_each_kernels_ptx_and_prints_its_row(tmp_path):
    import json

    r = _ptx_check("--out", str(tmp_path), "-k", "matvec[Q8_0]")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "expert_matvec_Q8_0.ptx",
        "matvec_Q8_0.ptx",
        "report.json",
    ]
    assert ".entry" in (tmp_path / "matvec_Q8_0.ptx").read_text()
    row = json.loads((tmp_path / "report.json").read_text())["matvec[Q8_0]"]
    assert row["registers"] > 0 and row["widest_load_bits"] >= 8
    assert "matvec[Q8_0]" in r.stdout and "2 kernels compiled for sm_90, 0 failed" in r.stdout


# -- ptx_check compiles what the runtime launches ----------------------------------------------------


def test_ptx_check_compiles_the_signatures_the_cuda_engine_launches(tmp_path, monkeypatch):
    """Every kernel the CUDA engine launches (a decode token and a prompt past the matvec tokens,
    on gemma3, qwen2 (biases) and qwen3moe with every part on the device) is in ptx_check's list with the
    argument types it was launched with: a Python float where the entry says float32 compiles a
    second, f64, kernel that no gate has seen. Launches are recorded, not run (the simulator would
    take minutes), and the cuBLAS product is skipped."""
    import numba
    from numba.cuda.simulator.kernel import FakeCUDAKernel, _kernel_context

    from cudarun import ptx_check
    from cudarun.cuda_engine import CudaEngine
    from cudarun.kernels import prefill
    from refengine.spec import load_spec
    from refengine.synthetic import SyntheticConfig, write_synthetic
    from solver.cost import PINNED, Loc, TierPlacement, Workload, evaluate
    from solver.groups import tensor_groups
    from solver.plan import plan_json
    from solver.solve import load_profile

    launched = {}  # (id(kernel), argument types) -> kernel
    run_kernel = FakeCUDAKernel.__call__

    def record(self, *args):
        if self._device or _kernel_context:  # a device function, or a call inside a kernel
            return run_kernel(self, *args)
        launched[id(self), tuple(numba.typeof(a) for a in args)] = self

    monkeypatch.setattr(FakeCUDAKernel, "__call__", record)
    monkeypatch.setattr(prefill, "gemm_fp16", lambda *a, **k: None)
    models = {
        "gemma3": SyntheticConfig("gemma3", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                                  head_dim=16, n_vocab=260, qtype="Q8_0", n_swa=3),
        "qwen2": SyntheticConfig("qwen2", n_layer=1, n_embd=32, n_ff=64, n_head=2, n_head_kv=1,
                                 n_vocab=260, qtype="Q4_1"),
        "qwen3moe": SyntheticConfig("qwen3moe", n_layer=1, n_embd=32, n_ff=64, n_head=2,
                                    n_head_kv=1, head_dim=16, n_vocab=260, qtype="Q4_K",
                                    n_expert=4, n_expert_used=2, n_ff_exp=32),
    }  # fmt: skip
    for arch, config in models.items():
        spec = load_spec(str(write_synthetic(tmp_path / f"{arch}.gguf", config)))
        resident = TierPlacement({g.name: Loc(PINNED) for g in tensor_groups(spec)},
                                 {il: Loc(PINNED) for il in range(config.n_layer)})  # fmt: skip
        tiers = {1: resident, 32: resident}
        w = Workload(n_ctx=64, prompt_tokens=20, gen_tokens=1, threads=2)
        prof = load_profile("h100")
        plan = plan_json(spec, w, prof.name, [3 * spec.weights_nbytes + (16 << 20)], tiers,
                         evaluate(tiers, spec, prof, w), "test", "refengine")  # fmt: skip
        engine = CudaEngine(spec, plan)
        engine.prefill(list(range(3, 23)))  # 20 tokens: the fp16 GEMM path
        engine.decode(7)
    entries = {}
    for name, kernel, argtypes in ptx_check.kernels():
        entries.setdefault(id(kernel), (name, set()))[1].add(tuple(argtypes))
        if kernel.py_func.__name__ == "decode_vec":  # generated per shape: the simulator's differ
            entries.setdefault("decode_vec", ("decode_vec", set()))[1].add(tuple(argtypes))
    missing = []
    for (kid, argtypes), kernel in sorted(launched.items(), key=lambda kv: kv[1].__name__):
        if kernel.py_func.__name__ == "decode_vec":
            kid = "decode_vec"
        name, compiled = entries.get(kid, (kernel.py_func.__qualname__, set()))
        if argtypes not in compiled:
            missing.append(
                f"{name} launched with {argtypes}; ptx_check compiles {compiled or 'none'}"
            )
    assert not missing, "\n".join(missing)
    names = {kernel.__name__ for kernel in launched.values()}
    assert len(names) >= 16  # the recorder saw the engine's launches (17 kernels when written)


# -- the gates: every kernel, assembled for sm_90 ---------------------------------------------------


def _kernel_names():
    from cudarun import ptx_check

    return [name for name, _, _ in ptx_check.kernels()]


@pytest.fixture(scope="session")  # not torn down when another module's tests run in between
def assembled(tmp_path_factory):
    """ptx_check --out over every kernel, once: name -> its row of report.json."""
    import json

    out = tmp_path_factory.mktemp("ptx")
    r = _ptx_check("--out", str(out))
    report = out / "report.json"
    assert report.exists(), r.stdout + r.stderr
    return json.loads(report.read_text())


@pytest.mark.xdist_group("ptx")  # one worker compiles every kernel, once
@pytest.mark.parametrize("name", _kernel_names())
def test_kernel_has_no_stack_frame_spills_or_f64(assembled, name):
    """Issue 16's static gate, per kernel: it compiles for sm_90, and ptxas gives it a 0-byte stack
    frame and no spills, and its PTX has no f64 instruction or parameter (`gate_failures`)."""
    row = assembled[name]
    assert "error" not in row, f"{name} does not compile: {row.get('error')}"
    assert row["gate"] == [], f"{name}: " + "; ".join(row["gate"])
