"""Compile every CUDA kernel to PTX for a real GPU architecture, without a GPU, and read what the
GPU would run.

The simulator runs the kernels' Python, which accepts code that Numba cannot compile for a device
(typing, local array shapes, unsupported calls); this compiles each kernel with the argument types
the runtime launches it with, through NVVM (the `nvidia-nvvm` and `nvidia-cuda-nvrtc` wheels),
so such code fails in CI rather than on the GPU machine. Run it with the simulator off:

    NUMBA_ENABLE_CUDASIM=0 python -m cudarun.ptx_check [--out DIR] [-k NAME]

With `--out`, each kernel's PTX goes to DIR/<kernel>.ptx, `ptxas -arch=sm_90 -v` (from the
`nvidia-cuda-nvcc` wheel) assembles it, and a table per kernel gives registers, shared memory,
stack frame, spills, f64 instructions and parameters and the widest global load, with the gate
(`gate_failures`) each must pass; DIR/report.json holds the same rows for tests/test_ptx_gates.py.
A stack frame is local memory and an f64 instruction runs at 1/64 of the fp32 rate on a GeForce
(1/2 on an H100, still double the registers): in a kernel that streams weights either is a bug.
It does not run a kernel or time one.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from numba import types as t

from solver.workspace import INT8_PASS_TOKENS

from . import compat  # noqa: F401  (before numba.cuda)
from . import kernel_build
from .kernel_build import ARCH



def arr(dtype, ndim):
    return t.Array(dtype, ndim, "C")


def vec_shapes():
    """The vec decode kernels compiled here: head dims 64, 128 and 256 at 1 and 2 query rows
    (llama.cpp's fattn-vec ncols), 16-byte loads, 8 lanes a key; and a head dim of 80 (4 lanes a
    key, 8-byte loads)."""
    from .kernels.attention_vec import Shape

    return [*(Shape(d, d, 4, 4, 8, rows, 8, 2, 2) for d in (64, 128, 256) for rows in (1, 2)),
            Shape(80, 80, 4, 4, 4, 1, 8, 1, 1)]  # fmt: skip


def vec_name(shape) -> str:
    return f"decode_vec[D{shape.d}x{shape.rows}]"


def kernels():
    """(name, python function, argument types) for every kernel."""
    from .blocks import DECODERS
    from .kernels import (attention, attention_vec, elementwise, glue, int8, matvec, moe, panel,
                          prefill)  # fmt: skip

    f32, f16, i64, i32 = t.float32, t.float16, t.int64, t.int32
    words = arr(t.uint16, 1)
    panel_words = {2: t.uint16, 4: t.uint32, 8: t.int64}
    out = [
        (
            "rms_norm",
            elementwise.rms_norm,
            (arr(f32, 2), arr(f32, 1), arr(f32, 2), f32, t.boolean),
        ),
        ("softmax", elementwise.softmax, (arr(f32, 2), arr(f32, 2))),
        (
            "rope_qk",
            elementwise.rope_qk,
            (arr(f32, 3), arr(f32, 3), arr(i64, 1), arr(f32, 1), arr(f32, 1), f32, t.boolean, i64,
             f32, f32, f32, f32, t.boolean),
        ),  # fmt: skip
        ("gated", elementwise.gated, (arr(f32, 2), arr(f32, 2), arr(f32, 2), t.boolean)),
        ("add", elementwise.add, (arr(f32, 2),) * 3),
        ("route", moe.route, (arr(f32, 2), i64, t.boolean, arr(i32, 2), arr(f32, 2))),
        ("combine", moe.combine, (arr(f32, 2), arr(f32, 2), arr(f32, 2))),
        ("to_half", prefill.to_half, (arr(f32, 2), arr(f16, 2))),
        ("scale_rows", glue.scale_rows, (arr(f32, 2), f32)),
        ("add_bias", glue.add_bias, (arr(f32, 2), arr(f32, 1))),
        (
            "store_kv",
            glue.store_kv,
            (
                arr(f32, 2),
                arr(f32, 2),
                arr(i64, 1),
                arr(f16, 2),
                arr(f16, 2),
                arr(f16, 2),
                arr(f16, 2),
            ),
        ),  # fmt: skip
    ]
    # attention reads the fp16 caches as 64-bit words (four values), or as 32-bit pairs where the
    # head dim is not a multiple of 4 (attention_vec.cache_words); decode's partial is a slice of
    # the workspace's splits, C-contiguous for one token only
    positions = (arr(i64, 1), arr(i64, 1))
    for word, bits in ((t.uint64, 64), (t.uint32, 32)):
        q_k_v = (arr(f32, 3), arr(word, 3), arr(word, 3))
        prefill_args = (*q_k_v, *positions, arr(f32, 3), f32, i64, i64)
        out.append((f"attention[KV{bits}]", attention.attention, prefill_args))
        for layout in "CA":
            decode_args = (*q_k_v, *positions, f32, i64, i64, i64, t.Array(f32, 4, layout))
            name = f"decode_partial[KV{bits}_{layout}]"
            out.append((name, attention.decode_partial, decode_args))
    for layout in "CA":
        merge_args = (t.Array(f32, 4, layout), arr(f32, 3))
        out.append((f"decode_merge[{layout}]", attention.decode_merge, merge_args))
    # the vec decode kernels of the SASS gate's head dims (8 KV heads; every shape compiles the
    # same code) and one of single 8-byte loads (a head dim of 80); the partial C-contiguous for
    # one token too (D128x1_C)
    for shape in vec_shapes():
        word = t.uint64 if shape.k_per == 4 else t.uint32
        for layout in "AC" if (shape.d, shape.rows) == (128, 1) else "A":
            vec_args = (arr(f32, 3), arr(word, 1), arr(word, 1), *positions, f32, i64, t.uint32,
                        t.uint32, t.Array(f32, 4, layout))  # fmt: skip
            name = vec_name(shape) + ("_C" if layout == "C" else "")
            out.append((name, attention_vec.decode_kernel(shape), vec_args))
    u64, u32 = arr(t.uint64, 1), arr(t.uint32, 1)
    out.append(("quantize_q8_1", int8.quantize, (arr(f32, 2), arr(i32, 1), arr(f32, 1), i64)))
    for qtype in sorted(int8.UNITS, key=lambda q: q.name):
        w = u32 if int8.UNITS[qtype].word_bytes == 4 else words
        for tokens in INT8_PASS_TOKENS:
            # weight words and bytes, xq, xq32, xds, out, bias, has_bias, gate, act, glu, n_cols,
            # n_tokens
            out.append((
                f"int8_matvec[{qtype.name}x{tokens}]",
                int8.gpu_kernel(qtype, tokens),
                (w, arr(t.int8, 1), u64, u32, u64, arr(f32, 2), arr(f32, 1), t.boolean,
                 arr(f32, 2), arr(f32, 2), i64, t.uint32, t.uint32),
            ))  # fmt: skip
            out.append((  # Q, K and V of one type (mixed types compile the same code)
                f"int8_matvec3[{qtype.name}x{tokens}]",
                int8.triple_kernel(qtype, qtype, qtype, tokens),
                (w, arr(t.int8, 1)) * 3 + (u64, u32, u64) + (arr(f32, 2),) * 3
                + (arr(f32, 1),) * 3 + (t.boolean,) * 3 + (t.uint32, t.uint32),
            ))  # fmt: skip
        out.append((
            f"int8_experts[{qtype.name}]",

            int8.expert_kernel(qtype),
            # the copy's words and bytes, the cache's, xq, xq32, xds, ids, out, n_cols,
            # per_slot_input, n_cached
            (w, arr(t.int8, 1), w, arr(t.int8, 1), u64, u32, u64, arr(i32, 2), arr(f32, 2),
             t.uint32, t.boolean, t.uint32),
        ))  # fmt: skip

    for qtype in sorted(DECODERS, key=lambda q: q.name):
        name = qtype.name
        out += [
            (
                f"matvec[{name}]",
                matvec.gpu_kernel(qtype),
                # the weight's bytes as uint16, x, out, bias, has_bias, gate, act, glu, n_cols
                (words, arr(f32, 2), arr(f32, 2), arr(f32, 1), t.boolean, arr(f32, 2),
                 arr(f32, 2), i64, i64),
            ),
            (
                f"matvec3[{name}]",  # Q, K and V of one type (mixed types compile the same code)
                matvec.triple_kernel(qtype, qtype, qtype),
                (words,) * 3 + (arr(f32, 2),) * 4 + (arr(f32, 1),) * 3 + (t.boolean,) * 3 + (i64,),
            ),  # fmt: skip
            (
                f"get_rows[{name}]",
                elementwise.get_rows_kernel(qtype),
                (words, arr(i64, 1), arr(f32, 2), i64),  # the table's bytes as uint16
            ),
            (
                f"expert_matvec[{name}]",
                moe.expert_matvec_kernel(qtype),
                (words, words, arr(f32, 2), arr(i32, 2), arr(f32, 2), i64, i64, t.boolean, i64),
            ),
            (
                f"dequantize[{name}]",
                prefill.dequantize_kernel(qtype),
                # the weight's words and bytes, the panel as int64 words, first block, units
                (arr(panel_words[panel.UNITS[qtype].word_bytes], 1), arr(t.int8, 1), arr(i64, 1),
                 t.uint32, t.uint32),
            ),
        ]
    return out


# -- what ptxas and the PTX say --------------------------------------------------------------------


@dataclass(frozen=True)
class Resources:
    """ptxas -v for a PTX file holding one kernel: its entry's registers and static shared memory;
    the deepest stack (the entry's frame or the cumulative size with its non-inlined callees) and
    the spills of the entry and every function it calls."""

    registers: int
    shared_bytes: int
    stack_bytes: int
    spill_store_bytes: int
    spill_load_bytes: int


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")


def parse_ptxas(text: str) -> Resources:
    """The resources of the one entry function in ptxas's `-v` output."""
    entries = _ENTRY.findall(text)
    if len(entries) != 1:
        raise ValueError(f"ptxas output names {len(entries)} entry functions, expected 1")
    frames = [tuple(map(int, m)) for m in _FRAME.findall(text)]
    used = [line for line in text.splitlines() if _USED.search(line)]
    if not frames or len(used) != 1:
        raise ValueError("ptxas output has no 'Used N registers' or stack frame line")
    smem, cumulative = _SMEM.search(used[0]), _CUMULATIVE.search(used[0])
    return Resources(
        registers=int(_USED.search(used[0]).group(1)),
        shared_bytes=int(smem.group(1)) if smem else 0,
        stack_bytes=max([f[0] for f in frames] + [int(cumulative.group(1)) if cumulative else 0]),
        spill_store_bytes=sum(f[1] for f in frames),
        spill_load_bytes=sum(f[2] for f in frames),
    )


@dataclass(frozen=True)
class PtxStats:
    """What the PTX text of one kernel shows: instructions on f64 values (arithmetic, moves, loads
    and `cvt` to or from f64, in the kernel and the functions it calls), f64 kernel parameters, and
    the widest `ld.global` (its vector and type suffix, e.g. `v4.u32`, and its bits)."""

    f64_instructions: int
    f64_params: int
    widest_load: str
    widest_load_bits: int


# an instruction line: optional guard predicate, then the opcode with its dotted suffixes
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w:.]*)")
_ENTRY_PARAMS = re.compile(r"\.entry\s+[\w$]+\s*\((.*?)\)", re.S)
_TYPE_BITS = re.compile(r"^[busf](8|16|32|64|128)$")


def parse_ptx(ptx: str) -> PtxStats:
    f64 = 0
    widest, widest_bits = "-", 0
    for line in ptx.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:  # directives (.reg .f64 ...), labels, comments, braces
            continue
        parts = m.group(1).split(".")
        if "f64" in parts[1:]:
            f64 += 1
        if parts[:2] == ["ld", "global"]:
            lanes = [int(p[1:]) for p in parts if re.fullmatch(r"v\d+", p)]
            bits = [int(b.group(1)) for p in parts if (b := _TYPE_BITS.match(p))]
            if bits:
                width = (lanes[0] if lanes else 1) * bits[-1]
                if width > widest_bits:
                    kept = [p for p in parts[2:] if re.fullmatch(r"v\d+", p) or _TYPE_BITS.match(p)]
                    widest, widest_bits = ".".join(kept), width
    params = _ENTRY_PARAMS.search(ptx)
    f64_params = len(re.findall(r"\.param\s+\.f64\b", params.group(1))) if params else 0
    return PtxStats(f64, f64_params, widest, widest_bits)


def gate_failures(res: Resources, ptx: PtxStats) -> list[str]:
    """Why a kernel fails the static gate of issue 16 (empty when it passes): no stack frame (local
    memory is device-memory traffic), no spills, no f64 arithmetic and no f64 parameter."""
    out = []
    if res.stack_bytes:
        out.append(f"{res.stack_bytes} B stack frame")
    if res.spill_store_bytes or res.spill_load_bytes:
        out.append(f"spills {res.spill_store_bytes}/{res.spill_load_bytes} B")
    if ptx.f64_instructions:
        out.append(f"{ptx.f64_instructions} f64 instructions")
    if ptx.f64_params:
        out.append(f"{ptx.f64_params} f64 parameters")
    return out


def file_stem(name: str) -> str:
    """`matvec[Q4_K]` -> `matvec_Q4_K`: a kernel's name as a file name."""
    return name.replace("[", "_").replace("]", "")


def ptxas_path() -> Path:
    """ptxas from the installed `nvidia-cuda-nvcc` wheel (the test extra)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("nvidia-cuda-nvcc")
    except metadata.PackageNotFoundError:
        raise SystemExit(
            "ptx_check --out needs ptxas: pip install 'nvidia-cuda-nvcc>=13' (the test extra)"
        ) from None
    found = [f for f in dist.files or () if f.name in ("ptxas", "ptxas.exe")]
    if not found:
        raise SystemExit(f"nvidia-cuda-nvcc {dist.version} holds no ptxas")
    return Path(dist.locate_file(found[0]))


# -- the command -----------------------------------------------------------------------------------


def check(out: Path | None, only: str | None) -> dict[str, dict]:
    """name -> its row: `error` when it did not compile, else (with `out`) its resources, PTX stats
    and gate failures."""
    ptxas = ptxas_path() if out else None
    rows: dict[str, dict] = {}
    for name, kernel, argtypes in kernels():
        if only and only not in name:
            continue
        try:
            if out is None:
                kernel_build.ptx(file_stem(name), kernel, argtypes)
                rows[name] = {}
                continue
            built = kernel_build.assemble(file_stem(name), kernel, argtypes, ptxas)
            (out / f"{file_stem(name)}.ptx").write_text(built.ptx)
            res, stats = parse_ptxas(built.report), parse_ptx(built.ptx)
            rows[name] = {**asdict(res), **asdict(stats), "gate": gate_failures(res, stats)}
        except Exception as e:  # report every kernel, not just the first
            rows[name] = {"error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
    return rows


def print_table(rows: dict[str, dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"CUDA kernels assembled for {ARCH} (ptxas -v)")
    heads = ("kernel", "regs", "smem B", "stack B", "spill st/ld B", "f64 ins", "f64 params",
             "widest ld.global", "gate")  # fmt: skip
    for i, h in enumerate(heads):
        table.add_column(h, justify="left" if i in (0, 7, 8) else "right")
    for name, r in rows.items():
        if "error" in r:
            table.add_row(name, *[""] * 7, f"[red]did not compile: {r['error']}")
            continue
        load = f"{r['widest_load']} ({r['widest_load_bits']}b)" if r["widest_load_bits"] else "-"
        gate = "[red]" + "; ".join(r["gate"]) if r["gate"] else "ok"
        table.add_row(name, str(r["registers"]), str(r["shared_bytes"]), str(r["stack_bytes"]),
                      f"{r['spill_store_bytes']}/{r['spill_load_bytes']}",
                      str(r["f64_instructions"]), str(r["f64_params"]), load, gate)  # fmt: skip
    console = Console()
    if not console.is_terminal:  # a log or a pipe: wide enough that no row wraps
        console = Console(width=200)
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m cudarun.ptx_check", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--out", type=Path, help="write each kernel's PTX here, run ptxas, print a table"
    )
    p.add_argument("-k", dest="only", help="only the kernels whose name contains this")
    args = p.parse_args(argv)
    from numba import config

    if config.ENABLE_CUDASIM:
        print("ptx_check: the simulator is on (NUMBA_ENABLE_CUDASIM=1); nothing to compile")
        return 2
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    rows = check(args.out, args.only)
    failed = [name for name, r in rows.items() if "error" in r]
    for name in failed:
        print(f"FAILED {name}: {rows[name]['error']}")
    if args.out:
        (args.out / "report.json").write_text(json.dumps(rows, indent=1))
        print_table(rows)
        gated = sum(1 for r in rows.values() if r.get("gate"))
        print(f"ptx_check: {gated} kernels fail the gate (stack, spills, f64); PTX in {args.out}")
    print(f"ptx_check: {len(rows) - len(failed)} kernels compiled for {ARCH}, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
