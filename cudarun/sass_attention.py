"""Decode attention in the peer gate (`sass_check`): our vec kernel (`kernels.attention_vec`)
beside llama.cpp's `flash_attn_ext_vec<D, ncols, F16, F16>` (ggml-cuda's fattn-vec.cuh, the
f16-f16 template instance of the sdist), both compiled for sm_90 by the same CUDA release and read
from their SASS (docs/sass_gate.md).

Both kernels run 4 warps a block, and a warp attends 32 keys per iteration of its loop over the
KV (K and V: 32 x (D + Dv) x 2 bytes); llama.cpp's loop strides by the grid, so its work is read
from that geometry, not from its induction step. An iteration is counted along its longest path
(every key's V read: the steady state of a context every query sees). Per KiB of KV at the same
query rows: ours of 1 and 2 rows (a KV head's group, tokens) beside llama.cpp's ncols 1 and 2.
The whole kernel per KiB at a split of 512 and of 4096 keys: each warp's iterations and its
shortest way into its loop and out of it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from .sass_read import CannotAnalyse, Counts, count, our_sass, peer_sass, sass_functions

PEER_SOURCE = "template-instances/fattn-vec-instance-f16-f16.cu"
HEAD_DIMS = (64, 128, 256)
ROWS = (1, 2)
SPLIT_KEYS = (512, 4096)
WARPS, KEYS_PER_WARP = 4, 32  # both kernels'
_PEER_NAME = re.compile(r"flash_attn_ext_vecILi(\d+)ELi(\d+)EL9ggml_type1ELS0_1ELb0E")


@dataclass(frozen=True)
class AttentionRow:
    head_dim: int
    rows: int
    ours: Counts
    peer: Counts
    ours_loop_per_kib: float
    peer_loop_per_kib: float
    ours_whole_per_kib: dict
    peer_whole_per_kib: dict


def peer_kernels(text: str) -> dict[tuple[int, int], tuple]:
    """(D, ncols) -> llama.cpp's f16 K and V kernel without the logit softcap."""
    out = {}
    for name, fn in sass_functions(text).items():
        m = _PEER_NAME.search(name)
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = fn
    return out


def iteration_nbytes(head_dim: int) -> int:
    """The KV one warp's iteration reads: its keys' K and V rows of fp16."""
    return KEYS_PER_WARP * 2 * head_dim * 2


def loop_per_kib(c: Counts, head_dim: int) -> float:
    return c.loop_max / iteration_nbytes(head_dim) * 1024


def whole_per_kib(c: Counts, head_dim: int, keys: int) -> float:
    """A block's instructions over the KV of a split of `keys` keys."""
    iterations = -(-keys // (WARPS * KEYS_PER_WARP))
    nbytes = keys * 2 * head_dim * 2
    return WARPS * (iterations * c.loop_max + c.outside) / nbytes * 1024


def measure(tools) -> list[AttentionRow]:
    from .ptx_check import vec_name, vec_shapes

    peers = peer_kernels(peer_sass(tools, PEER_SOURCE))
    shapes = {(s.d, s.rows): s for s in vec_shapes()}
    rows = []
    for d in HEAD_DIMS:
        for n in ROWS:
            if (d, n) not in peers:
                raise CannotAnalyse(f"llama.cpp's fattn-vec has no D={d} ncols={n} kernel")
            (_, fn), = sass_functions(our_sass(tools, vec_name(shapes[(d, n)]))).items()
            ours, peer = count(*fn, stepped=False), count(*peers[(d, n)], stepped=False)
            rows.append(AttentionRow(
                d, n, ours, peer, loop_per_kib(ours, d), loop_per_kib(peer, d),
                {k: whole_per_kib(ours, d, k) for k in SPLIT_KEYS},
                {k: whole_per_kib(peer, d, k) for k in SPLIT_KEYS},
            ))  # fmt: skip
    return rows


def failures(rows: list[AttentionRow], max_ratio: float) -> list[str]:
    out = []
    for r in rows:
        what = f"attention D={r.head_dim} x{r.rows}"
        if r.ours.generic_loads:
            out.append(f"{what}: {r.ours.generic_loads} generic loads (LD) in the loop")
        if r.ours_loop_per_kib > max_ratio * r.peer_loop_per_kib:
            out.append(f"{what}: loop {r.ours_loop_per_kib:.1f} > {max_ratio} x "
                       f"{r.peer_loop_per_kib:.1f} instructions per KiB of KV")  # fmt: skip
        for k in SPLIT_KEYS:
            if r.ours_whole_per_kib[k] > max_ratio * r.peer_whole_per_kib[k]:
                out.append(f"{what}: whole kernel at {k} keys {r.ours_whole_per_kib[k]:.1f} > "
                           f"{max_ratio} x {r.peer_whole_per_kib[k]:.1f} per KiB of KV")
    return out


def table(rows: list[AttentionRow], max_ratio: float, budget_per_kib: float):
    from rich.table import Table

    from .ptx_check import ARCH

    t = Table(title=f"decode attention, warp-instructions per KiB of KV ({ARCH} SASS); ours / "
                    f"llama.cpp flash_attn_ext_vec (f16 K, V); gate {max_ratio}x")  # fmt: skip
    for h in ("head dim", "query rows", "loop ours", "llama.cpp", "ratio",
              *(f"{k} keys ours / llama.cpp" for k in SPLIT_KEYS),
              "H100 HBM on issue ours / llama.cpp",
              "widest load bits ours / llama.cpp"):  # fmt: skip
        t.add_column(h, justify="right")
    for r in rows:
        k = SPLIT_KEYS[0]
        hbm = [min(1.0, budget_per_kib / w[k])
               for w in (r.ours_whole_per_kib, r.peer_whole_per_kib)]  # fmt: skip
        t.add_row(
            str(r.head_dim), str(r.rows), f"{r.ours_loop_per_kib:.1f}",
            f"{r.peer_loop_per_kib:.1f}", f"{r.ours_loop_per_kib / r.peer_loop_per_kib:.2f}",
            *(f"{r.ours_whole_per_kib[k]:.1f} / {r.peer_whole_per_kib[k]:.1f}" for k in SPLIT_KEYS),
            f"{hbm[0]:.0%} / {hbm[1]:.0%}",
            f"{r.ours.widest_load_bits} / {r.peer.widest_load_bits}",
        )  # fmt: skip
    return t
