from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_starts_with_the_two_setup_commands_and_ci_runs_the_second():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert lines[0] == "```" and lines[3] == "```"
    install, test = lines[1], lines[2]
    assert install.startswith("./scripts/install && ") and "refengine run" in install
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "./scripts/install" in ci and test in ci
