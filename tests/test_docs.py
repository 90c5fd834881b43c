"""The project cites only what it holds: every document a source file or doc names is in docs/, and
nothing points at the team's background notes outside the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("refengine", "solver", "cudarun", "tests", "examples", "scripts", "docs", ".ci")
SUFFIXES = {".py", ".md", ".sh", ".json", ".txt", ".toml", ""}

# the team's background pages, by the names they have outside the repository, and a path out of it
OUTSIDE = re.compile(r"\.\./shared|\b(CONTRACTS|NOTES|GPU_NOTES|PSHARD|LLAMACPP|DESIGN|STYLE)\.md"
                     r"|\bseed 00\d")  # fmt: skip
CITED = re.compile(r"\bdocs/([\w-]+\.md)")


def project_files():
    yield ROOT / "README.md"
    yield ROOT / "pyproject.toml"
    for top in SOURCES:
        for path in (ROOT / top).rglob("*"):
            if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts:
                yield path


def test_nothing_in_the_project_refers_to_files_outside_it():
    outside = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)}"
               for p in project_files()
               for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
               for m in OUTSIDE.finditer(line)]  # fmt: skip
    assert not outside, "\n".join(outside[:20])


def test_every_cited_document_is_in_docs():
    cited = {m.group(1) for p in project_files() for m in CITED.finditer(p.read_text(errors="replace"))}
    assert {"contracts.md", "llamacpp.md", "pshard.md", "toolchain.md"} <= cited
    missing = sorted(name for name in cited if not (ROOT / "docs" / name).is_file())
    assert not missing, missing
