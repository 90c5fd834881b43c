"""The GPU issue's one-call driver (scripts/device_call.py), here without a GPU: a case that raises
is a line and a traceback, not a lost stage; a stage over its limit is stopped and the next runs."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import device_call  # noqa: E402


def test_a_failed_case_and_a_stage_over_its_limit_lose_nothing_else(tmp_path, monkeypatch):
    def agreement(a, out, names=()):
        with out.guard("agreement", "first case"):
            raise RuntimeError("boom")
        out.say("agreement", "second case: OK")
        time.sleep(30)  # past the stage's limit
        out.say("agreement", "never written")

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setitem(device_call.STAGE_SECONDS, "agreement", 1)
    monkeypatch.setattr(device_call, "agreement", agreement)
    monkeypatch.setattr(sys, "argv", ["device_call.py", "--engine", "standin", "--seconds", "60",
                                      "--stages", "agreement,kernels", "--models", str(tmp_path)])
    started = time.monotonic()
    assert device_call.main() == 0
    assert time.monotonic() - started < 10
    (call,) = tmp_path.glob("*-call.txt")
    text = call.read_text()
    assert "first case: FAILED (RuntimeError: boom)" in text and "second case: OK" in text
    assert "== agreement: stopped at its limit of 1 s" in text and "never written" not in text
    assert "the kernel table needs a GPU: not run" in text
    (errors,) = tmp_path.glob("*-errors.txt")
    assert "RuntimeError: boom" in errors.read_text()
    (stage,) = tmp_path.glob("*-agreement.txt")
    # the device's line first (here, none), then the stage's lines alone
    head, *lines = stage.read_text().splitlines()
    assert head == device_call.smi_line()
    assert lines == ["first case: FAILED (RuntimeError: boom)", "second case: OK"]


def test_a_lost_context_goes_on_in_a_fresh_process_without_the_cases_done(tmp_path, monkeypatch):
    def agreement(a, out, names=()):
        for case in ("first", "second", "third"):
            if case in out.done:
                continue
            with out.guard("agreement", case):
                if case == "second":
                    raise RuntimeError("cuLaunchKernel: CUDA_ERROR_MISALIGNED_ADDRESS: misaligned")
                out.say("agreement", f"{case}: OK")

    execs = []
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.delenv(device_call.DONE_ENV, raising=False)
    monkeypatch.setattr(device_call, "agreement", agreement)
    monkeypatch.setattr(device_call.os, "execv", lambda path, argv: execs.append(argv))
    argv = ["device_call.py", "--engine", "standin", "--seconds", "60", "--stages",
            "agreement,kernels", "--models", str(tmp_path)]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    device_call.main()
    (fresh,) = execs  # (the stand-in for exec returned: this process went on)
    assert fresh[1].endswith("device_call.py") and fresh[2:6] == [
        "--engine", "standin", "--models", str(tmp_path)]  # fmt: skip
    assert fresh[6:8] == ["--stages", "agreement,kernels"] and 50 < float(fresh[9]) <= 60
    done = device_call.os.environ[device_call.DONE_ENV].split("\n")
    assert "first" in done and "second" in done and "third" not in done
    call = next(tmp_path.glob("*-call.txt")).read_text()
    assert "the CUDA context is lost (second): a fresh process for agreement, kernels" in call

    monkeypatch.setattr(sys, "argv", fresh[1:])  # the fresh process: only what is left
    (stage,) = tmp_path.glob("*-agreement.txt")
    stage.write_text("")
    device_call.main()
    assert stage.read_text() == "third: OK\n"
