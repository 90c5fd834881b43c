"""Everything a lent GPU is for, in one call and one Python process (each kernel compiles once),
under one deadline, the most valuable first, every line written to $OUT as it is measured:

(a) agreement (up to 200 s): synthetic models at the shapes of SmolLM2-135M and Gemma-3-270M, three
    plans each (every weight pinned; 40% of the weights, streaming; the FFNs on the CPU), a
    100-token prompt at tier 512 then 64 greedy tokens at tier 1 (a tier switch): greedy identical
    to the NumPy engine under CONTRACTS' near-tie rule, and each engine's device memory after its
    context was created, measured as the drop in free memory, against its budget;
(b) the kernel table (at most 120 s): decode matvec Q4_K, Q6_K, Q8_0 at 1 and 16 tokens beside the
    measured D2D copy ceiling, decode attention at 8K and 32K, cuBLAS and the prefill path
    (Q4_K 512x4096x14336), PCIe, launch costs;
(c) refengine beside llama.cpp's CUDA build (what is left): an 8B-shaped Q4_K_M model, written in
    the background from the call's start, at 100%, 25% and then 50% of its weights
    (scripts/gpu_vs_llamacpp.py's rows: refengine measured, predicted and bound; llama.cpp's --fit
    held to the budget; llama.cpp with our exported flags; launches per token);
(d) the `gpu` tests, in this process, with what time is left.

A case or row that raises is a line that says so, its traceback in <base>-errors.txt, and the
stage goes on; a stage that outlives its limit is stopped there and the next one starts. An error
that poisons the CUDA context (a misaligned or illegal address in a kernel: every later call
returns it) ends this process: it execs itself, a fresh context, for what is left of the call, the
cases it has done skipped (their kernels compile again). A second
call (--stages agreement-1.5b,eight-b,...) only adds rows.

    python3 scripts/device_call.py --seconds 540 --llama-bin /tmp/llama-cuda/bin
Dry run here, without a GPU (the stand-in engine; an RPC server as llama.cpp's device; a small
model for (c)):
    python scripts/device_call.py --engine standin --rpc 127.0.0.1:50052 --model-8b M.gguf -p 32 -n 4
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from datetime import date
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from refengine.agreement import agreement_along, reference_run  # noqa: E402
from refengine.engine import NumpyEngine  # noqa: E402
from refengine.spec import load_spec  # noqa: E402
from refengine.synthetic import SyntheticConfig, preset, write_synthetic  # noqa: E402
from solver.cost import Workload  # noqa: E402
from solver.solve import load_profile, solve_plan  # noqa: E402

STAGES = ("agreement", "kernels", "vs-llamacpp", "gpu-tests", "agreement-1.5b", "eight-b",
          "per-test", "agreement-serial", "where-8b")  # fmt: skip
FIRST_CALL = STAGES[:4]
# seconds a stage may take at most (None: what is left of the call)
STAGE_SECONDS = {"agreement": 200, "kernels": 120}
EIGHT_B = "llama3-8b-q4km.gguf"
# Qwen2-1.5B's shape (its config.json), beside the two presets: stage agreement-1.5b
QWEN2_1_5B = SyntheticConfig("qwen2", n_layer=28, n_embd=1536, n_ff=8960, n_head=12, n_head_kv=2,
                             n_vocab=151936, qtype="Q4_K_M", name="qwen2-1.5b")  # fmt: skip


# the driver's sticky errors: the context is unusable after them, a fresh process is not
STICKY = ("CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_ILLEGAL_ADDRESS",
          "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_LAUNCH_FAILED", "CUDA_ERROR_INVALID_PC",
          "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT")  # fmt: skip
DONE_ENV, WRITER_ENV = "DEVICE_CALL_DONE", "DEVICE_CALL_WRITER"


class ContextLost(BaseException):
    """A sticky CUDA error: not an Exception, so no guard goes on in this process."""


class StageTimeout(KeyboardInterrupt):
    """A stage's time is up. Not an Exception, so the per-case guards let it through; an
    interrupt, so pytest ends its session on it (it records any other BaseException as one failed
    test and goes on, past the stage's limit)."""


@contextlib.contextmanager
def time_limit(seconds: float):
    def fire(signum, frame):
        raise StageTimeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


class Out:
    """The call's files: <base>-<name>.txt under $OUT (the device tool's), else docs/measured/;
    every line also goes to stdout and <base>-call.txt, the call's whole story."""

    def __init__(self, device: str):
        dest = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "docs" / "measured"
        dest.mkdir(parents=True, exist_ok=True)
        self.base = dest / f"{date.today()}-{device}"
        self.started = time.monotonic()
        # the cases an earlier process of this call finished or lost its context on
        self.done = set(filter(None, os.environ.get(DONE_ENV, "").split("\n")))

    def path(self, name: str) -> Path:
        return Path(f"{self.base}-{name}.txt")

    def say(self, name: str, line: str) -> None:
        print(line, flush=True)
        if not self.path(name).exists():  # every table starts with the device it ran on
            device = smi_line()
            self.path(name).write_text(device + "\n")
            if name == "call":
                print(device, flush=True)
        for path in {self.path(name), self.path("call")}:
            with open(path, "a") as f:
                f.write(line + "\n")

    @contextlib.contextmanager
    def guard(self, name: str, what: str):
        """A case that raises: one line in `name`'s file, its traceback in the errors file."""
        try:
            yield
            self.done.add(what)
        except Exception as e:  # noqa: BLE001 - one case must not lose the stage
            self.say(name, f"{what}: FAILED ({type(e).__name__}: {str(e)[:300]})")
            with open(self.path("errors"), "a") as f:
                f.write(f"== {what}\n{traceback.format_exc()}\n")
            self.done.add(what)
            if any(code in str(e) for code in STICKY):
                raise ContextLost(what) from e


def smi_line() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "(no nvidia-smi here)"
    return subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()


def device_name() -> str:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return "no-gpu"
    out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines()  # fmt: skip
    return out[0].replace(" ", "-") if out else "gpu"


def new_engine(kind: str, spec, plan, serial: bool = False):
    if kind == "cuda":
        from cudarun.cuda_engine import CudaEngine

        if serial:
            return serialized(CudaEngine)(spec, plan)
        return CudaEngine(spec, plan)
    from cudarun.standin_engine import StandInEngine

    return StandInEngine(spec, plan)


def runtime_nbytes(a) -> int:
    """What the CUDA runtime allocates outside its arena, left inside each budget."""
    from solver.budget import CUDA_RUNTIME_NBYTES

    return CUDA_RUNTIME_NBYTES if a.engine == "cuda" else 0


def serialized(engine_class):
    """The engine with every copy, device part and CPU segment followed by a wait for all its
    streams, and no CUDA graphs: a case that agrees this way and not the other is an ordering
    race between streams or with the host, not arithmetic."""

    from cudarun.cuda_ubatch import CudaUbatch

    def then_wait(method):
        def run(self, *args, **kwargs):
            method(self, *args, **kwargs)
            self.e.synchronize()

        return run

    class SerialUbatch(CudaUbatch):
        pass

    for name in ("_copy_unit", "_copy_routed", "_device_part", "_segment"):
        setattr(SerialUbatch, name, then_wait(getattr(CudaUbatch, name)))

    class Serial(engine_class):
        ubatch_class = SerialUbatch

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.graphs.enabled = False

    return Serial


def far_positions(got, kl: float = 1e-2) -> str:
    """The positions whose KL passes `kl` (0: the prompt's logits), with their logits error."""
    far = [f"{i}: KL {k:.2e}, error {e:.2e}" for i, (k, e) in enumerate(zip(got.kl, got.errors))
           if k > kl]  # fmt: skip
    return f"  positions with KL > {kl:g}: " + ("; ".join(far[:12]) if far else "none")


AGREEMENT_PLANS = (("pinned", 3.0, None), ("streamed-40%", 0.4, None),
                   ("cpu-placed", 0.4, "ffncpu-attnstream"))  # fmt: skip


def agreement(a, out: Out, names=("smollm2-135m", "gemma3-270m"), serial: bool = False) -> None:
    profile = load_profile(a.profile)
    prompt_n, gen, n_ctx = 100, 64, 1024
    w = Workload(n_ctx=n_ctx, prompt_tokens=prompt_n, gen_tokens=gen, threads=profile.cpu.threads)
    for name in names:
        with out.guard("agreement", f"{name}: the model and the NumPy reference"):
            config = QWEN2_1_5B if name == "qwen2-1.5b" else preset(name)
            started = time.monotonic()
            spec = load_spec(str(write_synthetic(a.models / f"{name}.gguf", config)))
            prompt = [int(t) for t in np.random.default_rng(0).integers(0, spec.hparams.n_vocab,
                                                                        prompt_n)]  # fmt: skip
            rows = reference_run(NumpyEngine(spec, n_ctx=n_ctx), prompt, gen)
            out.say("agreement", f"{name}: NumPy reference, {prompt_n} + {gen} tokens, "
                                 f"{time.monotonic() - started:.1f} s")  # fmt: skip
            for label, fraction, strategy in AGREEMENT_PLANS:
                label += " serialized" if serial else ""
                if f"{name} {label}" in out.done:
                    continue
                with out.guard("agreement", f"{name} {label}"):
                    started = time.monotonic()
                    # the fraction is the arena's; the runtime's own comes on top
                    budget = int(fraction * spec.weights_nbytes) + runtime_nbytes(a)
                    plan = solve_plan(spec, profile, w, [1, 512], [budget], strategy,
                                      time_limit_seconds=a.solver_seconds,
                                      runtime_nbytes=runtime_nbytes(a))  # fmt: skip
                    solved = time.monotonic() - started
                    engine = None
                    try:
                        engine = new_engine(a.engine, spec, plan, serial)
                        engine.warm_up()
                        got = agreement_along(engine, prompt, rows, engine.tolerance)
                        out.say("agreement", f"{name} {label} ({plan['strategy']}, "
                                             f"{budget / 2**20:.0f} MiB, {engine.path} path): "
                                             f"{'OK' if got.ok else 'FAILS'}: {got.summary()} "
                                             f"[solve {solved:.1f} s, run "
                                             f"{time.monotonic() - started - solved:.1f} s]")
                        out.say("agreement", far_positions(got))
                        for line in engine.memory_report():
                            out.say("agreement", "  " + line)
                    finally:  # the next plan's budget needs what this one held
                        if hasattr(engine, "close"):
                            engine.close()


def kernels(a, out: Out) -> None:
    if a.engine != "cuda":
        out.say("kernels", "the kernel table needs a GPU: not run")
        return
    from cudarun import bench_report

    out.say("kernels", " | ".join(bench_report.GPU_COLUMNS))

    def failed(what, text):
        with open(out.path("errors"), "a") as f:
            f.write(f"== kernels: {what}\n{text}\n")

    for row in bench_report.gpu_rows(("Q4_K", "Q6_K", "Q8_0"), (1, 16), failed):
        out.say("kernels", " | ".join(row))


def start_writer(a) -> subprocess.Popen | None:
    """The 8B-shaped model, written at low priority while (a) and (b) run."""
    model = a.model_8b
    if model.exists():
        return None
    part = model.with_suffix(".part")
    options = a.synth_8b.replace(",", " ")
    cmd = f"nice -n 19 {sys.executable} -m refengine synth {options} {part} && mv {part} {model}"
    log = open(a.models / "synth.log", "w")
    return subprocess.Popen(["sh", "-c", cmd], stdout=log, stderr=subprocess.STDOUT,
                            cwd=ROOT, start_new_session=True)  # fmt: skip


class Adopted:
    """The writer an earlier process of this call started: still this process's child (exec
    keeps children), waited for by its pid."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ChildProcessError):
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            try:
                self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except ChildProcessError:  # reaped already
                self.returncode = 0
        return self.returncode


def model_written(a, out: Out, stage: str) -> bool:
    """Waits for the background writer of the 8B-shaped model, if it runs."""
    if a.writer is None or a.writer.returncode == 0:
        return a.model_8b.exists()
    started = time.monotonic()
    code = a.writer.wait()
    out.say(stage, f"8B-shaped model written (waited {time.monotonic() - started:.0f} s, exit "
                   f"{code})")  # fmt: skip
    if code != 0:
        out.say(stage, (a.models / "synth.log").read_text()[-1000:])
    return code == 0


def vs_llamacpp(a, out: Out, deadline: float) -> None:
    import gpu_vs_llamacpp

    if not model_written(a, out, "vs-llamacpp"):
        return
    args = gpu_vs_llamacpp.parser().parse_args(
        [str(a.model_8b), "--engine", a.engine, "--profile", a.profile, "-p", str(a.p), "-n",
         str(a.n), "-r", str(a.reps), "--out", str(out.path("vs-llamacpp"))]
        + (["--llama-bin", str(a.llama_bin)] if a.llama_bin else [])
        + (["--rpc", a.rpc] if a.rpc else [])
    )  # fmt: skip
    table = gpu_vs_llamacpp.Table(args, say=lambda line: out.say("call", line))
    table.say(smi_line())
    table.header()
    fractions = (1.0, 0.25, 0.5)
    for i, fraction in enumerate(fractions):  # a hung llama-bench costs its row, not the rest
        table.row(fraction, timeout_s=max((deadline - time.monotonic()) / (len(fractions) - i), 1))


def gpu_tests(a, out: Out) -> None:
    if a.engine != "cuda":
        out.say("gpu-tests", "the gpu tests need a GPU: not run")
        return
    import pytest

    class Tee:
        def write(self, text):
            sys.__stdout__.write(text)
            with open(out.path("gpu-tests"), "a") as f:
                f.write(text)
            return len(text)

        def flush(self):
            sys.__stdout__.flush()

        def isatty(self):
            return False

    out.say("gpu-tests", "the gpu tests, -m gpu, in this process")
    with contextlib.redirect_stdout(Tee()):
        code = pytest.main(["-q", "-n", "0", "-m", "gpu", "-p", "no:cacheprovider", "-rfE",
                            "--durations=10", str(ROOT / "tests")])  # fmt: skip
    out.say("gpu-tests", f"pytest exit {int(code)}")


def eight_b_engine(a, fraction: float, strategy, prompt: int, gen: int, n_ctx: int, tiers):
    from cudarun.cuda_engine import CudaEngine

    profile = load_profile(a.profile)
    spec = load_spec(str(a.model_8b))
    w = Workload(n_ctx=n_ctx, prompt_tokens=prompt, gen_tokens=gen, threads=profile.cpu.threads)
    budget = int(fraction * spec.weights_nbytes) + runtime_nbytes(a)
    plan = solve_plan(spec, profile, w, tiers, [budget], strategy,
                      runtime_nbytes=runtime_nbytes(a))  # fmt: skip
    engine = CudaEngine(spec, plan)
    try:
        engine.warm_up()
    except BaseException:  # the next case's larger budget needs what this one holds
        engine.close()
        raise
    return engine, plan, profile


def eight_b(a, out: Out) -> None:
    """`optimal` against `fit` (op-offload streamed at >= 32 tokens) at 25%, 50% and 75% of the
    8B-shaped model's weights: TTFT at a 4K prompt and end-to-end 4K in / 200 out."""
    prompt, gen = 4096, 200
    if not model_written(a, out, "eight-b"):
        return
    out.say("eight-b", f"8B-shaped: optimal vs fit, TTFT at {prompt} in, end-to-end {prompt} in / "
                       f"{gen} out\nbudget  plan     TTFT s  e2e s   predicted TTFT  predicted e2e")
    for fraction in (0.25, 0.5, 0.75):
        for strategy in (None, "fit"):
            with out.guard("eight-b", f"{fraction:.0%} {strategy or 'optimal'}"):
                engine, plan, _ = eight_b_engine(a, fraction, strategy, prompt, gen,
                                                 prompt + gen + 8, [1, 16, 512])  # fmt: skip
                try:
                    ids = np.random.default_rng(1).integers(0, engine.spec.hparams.n_vocab, prompt)
                    start = time.perf_counter()
                    logits = engine.prefill(ids)
                    ttft = time.perf_counter() - start
                    for _ in range(gen - 1):
                        logits = engine.decode(int(np.argmax(logits)))
                    e2e = time.perf_counter() - start
                finally:
                    engine.close()
                p = plan["prediction"]
                out.say("eight-b", f"{fraction:>5.0%}  {plan['strategy']:<8} {ttft:7.2f} {e2e:7.2f}"
                                   f" {p['ttft_seconds']:14.2f} {p['e2e_seconds']:14.2f}")


def bench_line(r) -> str:
    """A `bench_plan.run_bench` row: measured beside predicted and the bound."""
    return (f"{r.test:<14} measured {r.tps:9.2f} t/s  predicted "
            f"{r.tokens / r.predicted_seconds:9.2f}  bound {r.tokens / r.bound_seconds:9.2f}  "
            f"measured/predicted {r.measured_seconds / r.predicted_seconds:.2f}")


def per_test(a, out: Out) -> None:
    """The all-pinned and half-streamed plans of the 8B-shaped model, tiers 1 and 512 at depths 0
    and 4096, measured beside predicted; the half-streamed decode traced with its overlap."""
    from cudarun.bench_plan import run_bench
    from cudarun.trace import overlap_fraction, write_trace

    if not model_written(a, out, "per-test"):
        return
    out.say("per-test", "8B-shaped: measured vs predicted per test (all pinned = 1.5x the weights)")
    for label, fraction in (("all-pinned", 1.5), ("half-streamed", 0.5)):
        with out.guard("per-test", label):
            engine, _, profile = eight_b_engine(a, fraction, None, 512, 128, 4096 + 600, [1, 512])
            try:
                trace = label == "half-streamed"
                if trace:
                    engine.trace_events = []
                for r in run_bench(engine, profile, 512, 128, [0, 4096]):
                    out.say("per-test", f"{label:<14} {bench_line(r)}")
                for line in engine.memory_report() + engine.launch_report(
                    profile.gpus[0].launch_seconds.value
                ):
                    out.say("per-test", "  " + line)
                if trace and engine.trace_events:
                    png = write_trace(engine.trace_events, out.path("trace").with_suffix(".json"))
                    out.say("per-test", f"  trace {png.name}: copies under compute "
                                        f"{overlap_fraction(engine.trace_events):.0%}")
            finally:
                engine.close()


def where_8b(a, out: Out) -> None:
    """Where the all-pinned 8B-shaped prompt's time goes (measured 130-160x under its prediction
    while its decode is 11x under): pp512 and tg32 measured beside predicted with the prefill
    GEMM's panels as the plan sizes them and of 256 rows (the size before 2026-11-27), then a
    prompt under cProfile."""
    import solver.workspace

    if not model_written(a, out, "where-8b"):
        return
    sized = solver.workspace.panel_rows
    try:  # the next stage keeps the sized panels, even after a stage's time ran out here
        for label, rows in (("panels as sized", sized), ("panels of 256 rows", lambda s: 256)):
            solver.workspace.panel_rows = rows
            with out.guard("where-8b", label):
                where_8b_case(a, out, label)
    finally:
        solver.workspace.panel_rows = sized


def where_8b_case(a, out: Out, label: str) -> None:
    import cProfile
    import io
    import pstats

    from cudarun.bench_plan import run_bench

    engine, _, profile = eight_b_engine(a, 1.5, None, 512, 32, 1024, [1, 512])
    try:
        if hasattr(engine, "workspace"):  # the CUDA engine
            shape = engine.workspace(engine.tiers[512])["panel16"].shape
            out.say("where-8b", f"{label}: a panel is {shape[0]} x {shape[1]} fp16")
        for r in run_bench(engine, profile, 512, 32, [0]):
            out.say("where-8b", f"  {bench_line(r)}")
        ids = np.random.default_rng(3).integers(0, engine.spec.hparams.n_vocab, 512)
        engine.reset()
        prof = cProfile.Profile()
        prof.enable()
        engine.prefill(ids)
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(12)
        out.say("where-8b", text.getvalue())
    finally:
        engine.close()


def fresh_process(a, out: Out, stages: list[str], deadline: float) -> None:
    """This script again, in this process's place, for `stages`, with what is left of the call."""
    os.environ[DONE_ENV] = "\n".join(sorted(out.done))
    if a.writer is not None:
        os.environ[WRITER_ENV] = str(a.writer.pid)
    argv, skip = [], False
    for arg in sys.argv[1:]:  # the same options, less the stages and the time
        if skip or arg.startswith(("--stages=", "--seconds=")):
            skip = False
            continue
        if arg in ("--stages", "--seconds"):
            skip = True
            continue
        argv.append(arg)
    seconds = deadline + 5 - time.monotonic()
    sys.stdout.flush()
    os.execv(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv,
                              "--stages", ",".join(stages), "--seconds", f"{seconds:.0f}"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=540, help="the whole call's time")
    ap.add_argument("--stages", default=",".join(FIRST_CALL), help=f"of {','.join(STAGES)}")
    ap.add_argument("--engine", default="cuda", choices=("cuda", "standin"))
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--models", type=Path, default=Path(os.environ.get("REFENGINE_MODELS",
                                                                       "/tmp/models")))
    ap.add_argument("--model-8b", type=Path, help=f"(c)'s model (default: MODELS/{EIGHT_B})")
    ap.add_argument("--synth-8b", default="--preset,llama3-8b,--qtype,Q4_K_M",
                    help="`refengine synth` options, comma-separated, that write (c)'s model "
                         "when it is missing")  # fmt: skip
    ap.add_argument("--llama-bin", type=Path, help="llama.cpp's bin (default: the CPU build's)")
    ap.add_argument("--rpc", help="an RPC server as llama.cpp's GPU 0 (no GPU here)")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--reps", type=int, default=1, help="timed runs of each (c) test")
    ap.add_argument("--agreement-models", default="smollm2-135m,gemma3-270m",
                    help="the presets stage agreement runs")
    ap.add_argument("--solver-seconds", type=float, default=3.0, help="CP-SAT per plan in (a)")
    a = ap.parse_args()
    deadline = time.monotonic() + a.seconds - 5  # the last lines written before the call ends
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        ap.error(f"unknown stage {unknown[0]} (known: {', '.join(STAGES)})")
    a.models.mkdir(parents=True, exist_ok=True)
    a.model_8b = a.model_8b or a.models / EIGHT_B
    out = Out(device_name())
    out.say("call", f"device call {date.today()}: stages {', '.join(stages)}, "
                    f"{a.seconds:.0f} s, engine {a.engine}, profile {a.profile}")  # fmt: skip
    eight_b_stages = {"vs-llamacpp", "eight-b", "per-test", "where-8b"}
    if os.environ.get(WRITER_ENV):
        a.writer = Adopted(int(os.environ[WRITER_ENV]))
    else:
        a.writer = start_writer(a) if eight_b_stages & set(stages) else None
    shapes = tuple(a.agreement_models.split(","))
    run = {"agreement": lambda: agreement(a, out, shapes), "kernels": lambda: kernels(a, out),
           "vs-llamacpp": lambda: vs_llamacpp(a, out, deadline),
           "gpu-tests": lambda: gpu_tests(a, out),
           "agreement-1.5b": lambda: agreement(a, out, ("qwen2-1.5b",)),
           "eight-b": lambda: eight_b(a, out), "per-test": lambda: per_test(a, out),
           "agreement-serial": lambda: agreement(a, out, ("smollm2-135m",), serial=True),
           "where-8b": lambda: where_8b(a, out)}  # fmt: skip
    for i, stage in enumerate(stages):
        left = deadline - time.monotonic()
        limit = min(STAGE_SECONDS.get(stage, left), left)
        if left < 5:
            out.say("call", f"== {stage}: not run, {left:.0f} s left")
            continue
        out.say("call", f"== {stage} (at most {limit:.0f} s; {time.monotonic() - out.started:.0f}"
                        " s into the call)")  # fmt: skip
        started = time.monotonic()
        try:
            with time_limit(limit), out.guard("call", stage):
                run[stage]()
        except StageTimeout:
            out.say("call", f"== {stage}: stopped at its limit of {limit:.0f} s")
        except ContextLost as lost:
            # agreement goes on with its next case; another stage's rows would all fail again
            rest = stages[i:] if stage.startswith("agreement") else stages[i + 1 :]
            out.say("call", f"== {stage}: the CUDA context is lost ({lost}): a fresh process for "
                            f"{', '.join(rest) or 'nothing'}, {deadline - time.monotonic():.0f} s left")
            if rest and deadline - time.monotonic() > 30:
                fresh_process(a, out, rest, deadline)
        gc.collect()  # what a stopped case left unreferenced goes back before the next stage
        out.say("call", f"== {stage}: {time.monotonic() - started:.1f} s")
    if a.writer is not None and a.writer.poll() is None:
        os.killpg(a.writer.pid, signal.SIGTERM)
    out.say("call", f"call done in {time.monotonic() - out.started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
