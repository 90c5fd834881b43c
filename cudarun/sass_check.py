"""The decode kernels' static peer gate: the warp-instructions our int8 matvec issues per KiB of
weights, beside llama.cpp's `mul_mat_vec_q` for the same type and tokens, both compiled for sm_90
by the same CUDA release and read from their SASS, without a GPU (docs/sass_gate.md); and our
decode attention beside llama.cpp's `flash_attn_ext_vec` per KiB of KV (`sass_attention`); and
the prefill's dequantization beside convert.cu's per KiB of weights (`sass_dequant`).

    NUMBA_ENABLE_CUDASIM=0 python -m cudarun.sass_check [--max-ratio 1.1] [--json FILE] [-t TYPE]

Ours: each kernel's PTX (as `ptx_check` compiles it) assembled by ptxas. llama.cpp's: ggml-cuda's
`mmvq.cu` of the sdist `scripts/build_llamacpp.sh` builds, compiled by the nvcc wheel with the
flags of ggml-cuda's CMakeLists (a stub cuBLAS header: mmvq's kernels call no cuBLAS), once per
sdist version and CUDA release, cached beside the llama.cpp build. Both disassembled by nvdisasm.

In each kernel the loop over the weight blocks is the innermost loop holding the most global
loads; its instructions are counted along every path through one iteration (averaged), and its
work is read from its induction step (`induction_step`: compilers unroll). Per KiB of weights:
the loop's count over the bytes one iteration consumes per warp, and the whole kernel at K = 4096
and 14336, where each warp also issues its shortest way into the loop and out of it to an exit
(the same bound for both). Exit 1 when any of ours is above `--max-ratio` times llama.cpp's,
loop or whole kernel; exit 2 when a kernel cannot be analysed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from . import sass_attention, sass_dequant
from .ptx_check import ARCH
from .sass_read import (ISSUE_BUDGET_PER_KIB, CannotAnalyse, Counts, count, our_sass, peer_sass,
                        sass_functions, toolchain)  # fmt: skip

GATED = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
TIERS = (1, 4, 8)  # tokens of one kernel pass (16 tokens: two passes of 8, for both)
KS = (4096, 14336)


# -- the peer's launch geometry (ggml-cuda/mmvq.cu and vecdotq.cuh of the sdist) -------------------


@dataclass(frozen=True)
class PeerType:
    """llama.cpp's traits of a type: values per block (qk), 32-bit quant words per block (qi),
    words a thread takes per dot (vdr)."""

    qk: int
    qi: int
    vdr: int


PEER_TYPES = {
    Q.Q4_0: PeerType(32, 4, 2), Q.Q4_1: PeerType(32, 4, 2), Q.Q5_0: PeerType(32, 4, 2),
    Q.Q5_1: PeerType(32, 4, 2), Q.Q8_0: PeerType(32, 8, 2), Q.Q4_K: PeerType(256, 32, 2),
    Q.Q5_K: PeerType(256, 32, 2), Q.Q6_K: PeerType(256, 32, 1),
}  # fmt: skip


def peer_warps(tokens: int) -> int:
    """calc_nwarps for the generic (NVIDIA) table."""
    return 4 if tokens <= 4 else 2 if tokens <= 8 else 1


def peer_rows(tokens: int) -> int:
    """calc_rows_per_block for the generic table (small_k off: K of 4096 and more)."""
    return 1 if tokens == 1 else 2 if tokens <= 8 else 1


# -- what one iteration consumes -------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """How a kernel maps onto the weights: bytes one warp consumes per unit of the induction
    step, warps and rows per thread block, and the per-warp row bytes at K."""

    bytes_per_step: float
    warps: int
    rows: int
    block_nbytes: int
    values: int


def our_geometry(qtype) -> Geometry:
    from .kernels import int8

    u = int8.UNITS[qtype]
    # the counter walks the row's blocks: a step is one block, for the whole warp
    return Geometry(u.block_nbytes, 1, 1, u.block_nbytes, u.values)


def peer_geometry(qtype, tokens: int) -> Geometry:
    from .blocks import layout

    p, nbytes = PEER_TYPES[qtype], layout(qtype)[2]
    warps, rows = peer_warps(tokens), peer_rows(tokens)
    # kbx counts blocks for the whole thread block; a step is one block, of each of its rows,
    # shared by its warps
    return Geometry(nbytes * rows / warps, warps, rows, nbytes, p.qk)


@dataclass(frozen=True)
class Row:
    kernel: str
    tier: int
    ours: Counts
    peer: Counts
    ours_loop_per_kib: float
    peer_loop_per_kib: float
    ours_whole_per_kib: dict
    peer_whole_per_kib: dict
    ours_narrow_loads_per_kib: float
    peer_narrow_loads_per_kib: float


def loop_per_kib(c: Counts, g: Geometry, what: float | None = None) -> float:
    """Of the loop's instructions (or of `what` per iteration), per KiB of weights."""
    per_iteration = c.loop_instructions if what is None else what
    return per_iteration / (c.step * g.bytes_per_step) * 1024


def whole_per_kib(c: Counts, g: Geometry, k: int) -> float:
    """A thread block's instructions over its rows' weight bytes at row length k: each warp's
    iterations and its way around the loop."""
    row_nbytes = k // g.values * g.block_nbytes
    iterations = -(-row_nbytes * g.rows // int(round(c.step * g.bytes_per_step * g.warps)))
    return g.warps * (iterations * c.loop_instructions + c.outside) / (g.rows * row_nbytes) * 1024


_PEER_NAME = re.compile(r"mul_mat_vec_qIL9ggml_type(\d+)ELi(\d+)ELb(\d)ELb(\d)ELb(\d)E")


def peer_kernels(text: str) -> dict[tuple, tuple]:
    """(type, tokens) -> instructions and labels of mul_mat_vec_q<type, tokens, no fusion,
    small_k off, halve_iters off>: what runs on an H100 at K of 4096 and more."""
    out = {}
    for name, fn in sass_functions(text).items():
        m = _PEER_NAME.search(name)
        if m and m.group(3, 4, 5) == ("0", "0", "0"):
            out[(int(m.group(1)), int(m.group(2)))] = fn
    return out


# -- the table -------------------------------------------------------------------------------------


def measure(tools, qtypes=GATED, tiers=TIERS) -> list[Row]:
    peers = peer_kernels(peer_sass(tools))
    rows = []
    for qtype in qtypes:
        # the expert matvec (None): llama.cpp runs a slot's expert through the same 1-token
        # kernel, its ids argument set
        for tokens in (*tiers, None):
            if (int(qtype), tokens or 1) not in peers:
                raise CannotAnalyse(f"llama.cpp's mmvq has no {qtype.name} x{tokens} kernel")
            ours_name = f"int8_matvec[{qtype.name}x{tokens}]" if tokens else f"int8_experts[{qtype.name}]"  # noqa: E501
            (name, fn), = sass_functions(our_sass(tools, ours_name)).items()
            ours, peer = count(*fn), count(*peers[(int(qtype), tokens or 1)])
            go, gp = our_geometry(qtype), peer_geometry(qtype, tokens or 1)
            rows.append(Row(
                qtype.name + ("" if tokens else " experts"), tokens or 1, ours, peer,
                loop_per_kib(ours, go), loop_per_kib(peer, gp),

                {k: whole_per_kib(ours, go, k) for k in KS},
                {k: whole_per_kib(peer, gp, k) for k in KS},
                loop_per_kib(ours, go, ours.narrow_loads),
                loop_per_kib(peer, gp, peer.narrow_loads),
            ))  # fmt: skip
    return rows


def failures(rows: list[Row], max_ratio: float) -> list[str]:
    out = []
    for r in rows:
        if r.ours.generic_loads:
            out.append(f"{r.kernel} x{r.tier}: {r.ours.generic_loads} generic loads (LD) in "
                       "the loop: a pointer whose address space the compiler lost")  # fmt: skip
        if r.ours_loop_per_kib > max_ratio * r.peer_loop_per_kib:
            out.append(f"{r.kernel} x{r.tier}: loop {r.ours_loop_per_kib:.0f} > {max_ratio} x "
                       f"{r.peer_loop_per_kib:.0f} instructions per KiB")  # fmt: skip
        for k in KS:
            if r.ours_whole_per_kib[k] > max_ratio * r.peer_whole_per_kib[k]:
                out.append(f"{r.kernel} x{r.tier}: whole kernel at K={k} "
                           f"{r.ours_whole_per_kib[k]:.0f} > {max_ratio} x "
                           f"{r.peer_whole_per_kib[k]:.0f} instructions per KiB")  # fmt: skip
    return out


def print_table(rows: list[Row], max_ratio: float) -> None:
    from rich.table import Table

    table = Table(title=f"int8 decode matvec, warp-instructions per KiB of weights ({ARCH} SASS); "
                        f"ours / llama.cpp mul_mat_vec_q; gate {max_ratio}x")  # fmt: skip
    heads = ("type", "tokens", "loop ours", "llama.cpp", "ratio",
             *(f"K={k} ours / llama.cpp" for k in KS),
             "H100 HBM on issue ours / llama.cpp", "8/16-bit loads per KiB ours / llama.cpp",
             "dp4a per iteration ours / llama.cpp")  # fmt: skip
    for h in heads:
        table.add_column(h, justify="right")
    for r in rows:
        hbm = [min(1.0, ISSUE_BUDGET_PER_KIB / r.ours_whole_per_kib[KS[0]]),
               min(1.0, ISSUE_BUDGET_PER_KIB / r.peer_whole_per_kib[KS[0]])]
        table.add_row(
            r.kernel, str(r.tier), f"{r.ours_loop_per_kib:.0f}", f"{r.peer_loop_per_kib:.0f}",
            f"{r.ours_loop_per_kib / r.peer_loop_per_kib:.2f}",
            *(f"{r.ours_whole_per_kib[k]:.0f} / {r.peer_whole_per_kib[k]:.0f}" for k in KS),
            f"{hbm[0]:.0%} / {hbm[1]:.0%}",
            f"{r.ours_narrow_loads_per_kib:.0f} / {r.peer_narrow_loads_per_kib:.0f}",

            f"{r.ours.dp4a:.0f} / {r.peer.dp4a:.0f}",
        )  # fmt: skip
    console().print(table)


def console():
    from rich.console import Console

    out = Console()
    return out if out.is_terminal else Console(width=220)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudarun.sass_check",
                                description=__doc__.split("\n\n")[0])  # fmt: skip
    p.add_argument("--max-ratio", type=float, default=1.1)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("-t", "--type", dest="types", action="append",
                   help="only these types' matvecs (and no attention)")  # fmt: skip
    args = p.parse_args(argv)
    from numba import config

    if config.ENABLE_CUDASIM:
        print("sass_check: the simulator is on (NUMBA_ENABLE_CUDASIM=1); nothing to compile")
        return 2
    qtypes = [Q[t] for t in args.types] if args.types else GATED
    try:
        tools = toolchain()
        rows = measure(tools, qtypes)
        attention = [] if args.types else sass_attention.measure(tools)
        dequant = [] if args.types else sass_dequant.measure(tools)
    except CannotAnalyse as e:
        print(f"sass_check: cannot analyse: {e}")
        return 2
    print_table(rows, args.max_ratio)
    if attention:
        console().print(sass_attention.table(attention, args.max_ratio, ISSUE_BUDGET_PER_KIB))
    if dequant:
        console().print(sass_dequant.table(dequant, args.max_ratio))
    if args.json:
        args.json.write_text(json.dumps({"matvec": [asdict(r) for r in rows],
                                         "attention": [asdict(r) for r in attention],
                                         "dequantize": [asdict(r) for r in dequant]}, indent=1))
    failed = (failures(rows, args.max_ratio) + sass_attention.failures(attention, args.max_ratio)
              + sass_dequant.failures(dequant, args.max_ratio))
    for f in failed:
        print(f"FAILED {f}")
    worst = max(rows, key=lambda r: r.ours_loop_per_kib / r.peer_loop_per_kib)
    n = len(rows) + len(attention) + len(dequant)
    print(f"sass_check: {n - len({f.split(':')[0] for f in failed})} of {n} kernels within "
          f"{args.max_ratio}x of llama.cpp; worst matvec loop ratio "
          f"{worst.ours_loop_per_kib / worst.peer_loop_per_kib:.2f} ({worst.kernel} x{worst.tier})")
    if attention:
        a = max(attention, key=lambda r: r.ours_loop_per_kib / r.peer_loop_per_kib)
        print(f"sass_check: worst attention loop ratio "
              f"{a.ours_loop_per_kib / a.peer_loop_per_kib:.2f} (D={a.head_dim} x{a.rows})")
    if dequant:
        d = max(dequant, key=lambda r: r.ours_per_kib / r.peer_per_kib)
        print(f"sass_check: worst dequantize ratio {d.ours_per_kib / d.peer_per_kib:.2f} "
              f"({d.kernel})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

