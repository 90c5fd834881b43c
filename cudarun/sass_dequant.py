"""The prefill's dequantization in the peer report (`sass_check`): our fp16 panel kernel
(`kernels.prefill.dequantize_kernel`) beside the kernels llama.cpp's `ggml_get_to_fp16_cuda` picks
for a contiguous weight (ggml-cuda's convert.cu of the sdist), both compiled for sm_90 by the same
CUDA release and read from their SASS (docs/sass_gate.md).

Neither has a loop over the weight (a thread decodes a few values and exits; llama.cpp's generic
`dequantize_block` loops over rows and planes, once each for a contiguous weight), so a warp's
work is its longest path from the entry to an exit, back edges left out: the path of a warp whose
values are all inside the tensor. Per KiB of weights: that count over the bytes a warp decodes;
gated at the ratio the decode kernels are, with the widest store of each beside it."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q

from .sass_read import CannotAnalyse, load_bits, our_sass, peer_sass, sass_functions, successors

PEER_SOURCE = "convert.cu"
# llama.cpp's fp16 kernel per type: a piece of its mangled name, warps per thread block, and the
# values a thread block decodes (convert.cu's dequantize_row_*_cuda and dequantize_block_cuda)
PEER_KERNELS = {
    Q.Q4_0: ("dequantize_block_q4_0I6__half", 1, 256),
    Q.Q4_1: ("dequantize_block_q4_1I6__half", 1, 256),
    Q.Q5_0: ("dequantize_q5_0EPKvliR6float2EE6__half", 8, 512),  # 256 threads, two values each
    Q.Q5_1: ("dequantize_q5_1EPKvliR6float2EE6__half", 8, 512),
    Q.Q8_0: ("dequantize_block_q8_0_f16ILb0E", 1, 2048),
    Q.Q4_K: ("dequantize_block_q4_KI6__half", 1, 256),
    Q.Q5_K: ("dequantize_block_q5_KI6__half", 2, 256),
    Q.Q6_K: ("dequantize_block_q6_KI6__half", 2, 256),
}


@dataclass(frozen=True)
class DequantRow:
    kernel: str
    ours_instructions: int  # a warp's
    peer_instructions: int
    ours_per_kib: float
    peer_per_kib: float
    ours_store_bits: int  # the widest global store
    peer_store_bits: int


def longest_path(ins, labels) -> int:
    """The most instructions from the entry to an exit along forward edges."""
    best = [0] * len(ins)
    best[0] = 1
    most = 0
    for k, i in enumerate(ins):
        if not best[k]:
            continue
        if i.op in ("EXIT", "RET") and i.pred is None:
            most = max(most, best[k])
            continue
        for j in successors(ins, labels, k):
            if j > k:
                best[j] = max(best[j], best[k] + 1)
    return most


def widest_store_bits(ins) -> int:
    return max((load_bits(i.op) for i in ins if i.op.startswith("STG.")), default=0)


def measure(tools) -> list[DequantRow]:
    from .blocks import layout
    from .kernels.panel import UNITS

    peers = sass_functions(peer_sass(tools, PEER_SOURCE))
    rows = []
    for qtype, (piece, warps, values) in PEER_KERNELS.items():
        found = [fn for name, fn in peers.items() if piece in name]
        if len(found) != 1:
            raise CannotAnalyse(f"convert.cu has {len(found)} kernels named like {piece}")
        per_block, block_nbytes = layout(qtype)[1:3]
        (_, ours_fn), = sass_functions(our_sass(tools, f"dequantize[{qtype.name}]")).items()
        ours, peer = longest_path(*ours_fn), longest_path(*found[0])
        ours_nbytes = 32 / UNITS[qtype].units * block_nbytes  # a thread a unit
        peer_nbytes = values // per_block * block_nbytes / warps
        rows.append(DequantRow(qtype.name, ours, peer, ours / ours_nbytes * 1024,
                               peer / peer_nbytes * 1024, widest_store_bits(ours_fn[0]),
                               widest_store_bits(found[0][0])))  # fmt: skip
    return rows


def failures(rows: list[DequantRow], max_ratio: float) -> list[str]:
    return [f"dequantize {r.kernel}: {r.ours_per_kib:.0f} > {max_ratio} x {r.peer_per_kib:.0f} "
            "instructions per KiB of weights"
            for r in rows if r.ours_per_kib > max_ratio * r.peer_per_kib]  # fmt: skip


def table(rows: list[DequantRow], max_ratio: float):
    from rich.table import Table

    from .ptx_check import ARCH

    t = Table(title=f"prefill dequantize to fp16, warp-instructions per KiB of weights ({ARCH} "
                    f"SASS); ours / llama.cpp convert.cu; gate {max_ratio}x")  # fmt: skip
    for h in ("type", "a warp's ours", "llama.cpp", "per KiB ours", "llama.cpp", "ratio",
              "widest store bits"):  # fmt: skip
        t.add_column(h, justify="right")
    for r in rows:
        t.add_row(r.kernel, str(r.ours_instructions), str(r.peer_instructions),
                  f"{r.ours_per_kib:.0f}", f"{r.peer_per_kib:.0f}",
                  f"{r.ours_per_kib / r.peer_per_kib:.2f}",
                  f"{r.ours_store_bits} / {r.peer_store_bits}")  # fmt: skip
    return t
