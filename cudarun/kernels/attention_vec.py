"""Decode attention over the fp16 KV ring as llama.cpp's `flash_attn_ext_vec` computes it: the
queries and the output accumulators in registers, K and V read as wide words straight from global
memory into the fma chains, no staging through shared memory (docs/sass_gate.md counts it beside
llama.cpp's kernel).

A block (WARPS warps) attends `rows` query rows of one KV head (consecutive (token, head) pairs of
its group, as in `attention`: every K and V word it loads serves all of them) to one split of the
keys. Each warp walks its own keys, THREADS at a time, with its own running max and sum:

1. K: `key_lanes` consecutive lanes share a key, each holding a slice of the row (lane part loads
   `k_load` words from word k_load * part, and again key_lanes * k_load words on: 16-byte loads
   at D = 128), so a warp dots THREADS / key_lanes keys at once.
   A lane's partial dots are reduced over its key's lanes by shuffles; after key_lanes such steps
   every lane holds one key's score per row;
2. the score of a key a row cannot see (the future, past the window, a never-written cell whose
   position is kvstore.EMPTY, past the split) becomes -inf by a select, never by arithmetic, so
   the NaN an unwritten cell may hold never reaches the softmax; the warp's max, exp, and the
   rescale of the accumulators (online softmax, fp32); the weights go to shared memory, a warp's
   own slice;
3. V: the same lanes take the same slices of each key's V row and add weight * value into their
   accumulators; a key whose weights are all 0 (masked, or underflowed) is not read.

At the end the warps' accumulators are reduced over the lanes that shared dims (shuffles) and
over the warps (shared memory), and the block writes what `attention.decode_partial` writes:
per row, the unnormalized output, the max and the sum, into `partial` [T, splits, H, Dv + 2],
for `attention.decode_merge`.

The head dims, the rows and the words are compile-time constants of each kernel (generated
source, as `int8`'s row loops), so the per-lane queries and accumulators are named registers: no
local arrays, no stack frame; the KV heads are too, so a key's row stride is a constant and an
iteration's loads sit at immediate offsets from one address. Indices are unsigned (no wraparound
checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import compat  # noqa: F401  (before numba.cuda)

# module level: the simulator swaps this global for its fake module
from numba import config, cuda, float32, uint32, uint64  # noqa: E402

from . import THREADS  # noqa: E402
from .bits import half_pair, load_pair  # noqa: E402
from .elementwise import FULL_MASK, warp_max, warp_sum  # noqa: E402

MAX_HEAD_DIM = 256
NEG = float32(-3.0e38)  # a row's max before it has seen a key (the tiled kernels' masked score)
NEG_INF = np.float32(-np.inf)  # a float32 global: a constant of the kernel, not an f64
WARPS = 2 if config.ENABLE_CUDASIM else 4  # per block
BLOCK_THREADS = WARPS * THREADS
KEYS_PER_BLOCK = BLOCK_THREADS  # keys one pass of the block's warps attends: THREADS a warp
MAX_KEY_LANES = 8 if THREADS == 32 else 2  # llama.cpp's 8 (16-byte loads over a 128-dim row)
MAX_ROWS = 8
# rows x head dim a kernel keeps in registers (queries, and as many outputs); the simulator's
# fewer keep its tests' blocks small
ROW_DIMS = 32 if config.ENABLE_CUDASIM else 512
MAX_LANE_VALUES = 32  # a lane's share of a row's head dim; past it, the tiled kernel attends


@dataclass(frozen=True)
class Shape:
    """A kernel's compile-time constants: head dims, halves per word of K and of V (4: uint64
    words, 2: uint32), lanes per key, query rows, KV heads (a row's stride), and words per load
    of K and of V (2: one 16-byte load where the rows and the cache allow, as llama.cpp's)."""

    d: int
    dv: int
    k_per: int
    v_per: int
    key_lanes: int
    rows: int
    kv_heads: int
    k_load: int
    v_load: int

    @property
    def k_loads(self) -> int:  # loads of K one lane issues per key
        return self.d // (self.k_per * self.k_load * self.key_lanes)

    @property
    def v_loads(self) -> int:
        return self.dv // (self.v_per * self.v_load * self.key_lanes)


def key_lanes(k_words: int, v_words: int, most: int = MAX_KEY_LANES) -> int:
    """The most lanes per key (a power of two, at most `most`) that split both rows' words
    evenly."""
    lanes = most
    while lanes > 1 and (k_words % lanes or v_words % lanes):
        lanes //= 2
    return lanes


def load_width(words: int, lanes: int, aligned: bool) -> int:
    """Words per load: a pair (16 or 8 bytes) where the row's words split into pairs over the
    lanes and the cache starts on a pair's boundary."""
    return 2 if aligned and words % (2 * lanes) == 0 else 1


def row_tile(n_rows: int, d: int, dv: int, dims: int = ROW_DIMS) -> int:
    """Query rows per block: the fewest powers of two that hold them, within the registers'
    `dims` (rows x head dim)."""
    most = max(1, min(MAX_ROWS, dims // max(d, dv)))
    rows = 1
    while rows < min(n_rows, most):
        rows *= 2
    return min(rows, most)


def fits(shape: Shape) -> bool:
    """Whether a lane's share of the rows fits in registers (else the tiled kernel attends)."""
    return max(shape.d, shape.dv) // shape.key_lanes <= MAX_LANE_VALUES


# -- the generated kernel --------------------------------------------------------------------------


def _load(words: str, at: str, width: int, into: str) -> str:
    """A line that loads `width` consecutive words from index `at` into into_0.."""
    if width == 2:
        return f"{into}_0, {into}_1 = load_pair({words}, {at})"
    return f"{into}_0 = {words}[{at}]"


def _halves(word: str, per: int, into: str) -> list[str]:
    """Lines that convert one word's fp16 values into float32 names into_0.., each 32 bits
    converted where they sit (`half_pair`)."""
    if per == 2:
        return [f"{into}_0, {into}_1 = half_pair({word})"]
    return [f"{into}_0, {into}_1 = half_pair(uint32({word} & 0xFFFFFFFF))",
            f"{into}_2, {into}_3 = half_pair(uint32({word} >> 32))"]  # fmt: skip


def _values(loads: int, width: int, per: int) -> list[tuple[int, int, int]]:
    """A lane's values of a row: (load, word of the load, half of the word)."""
    return [(m, j, c) for m in range(loads) for j in range(width) for c in range(per)]


def _dim(s: Shape, m: int, j: int, c: int, width: int, per: int) -> str:
    """The head dim of a lane's value (m, j, c): lane part's loads start at word width * part,
    a step of the key's lanes apart."""
    return f"{per} * ({width} * part + {m * width * s.key_lanes + j}) + {c}"


def _pass(s: Shape, tail: bool) -> list[str]:
    """One pass of a warp over THREADS keys from `base` (the loop body's lines). A full pass has
    every key inside the split; the tail's keys past `stop` are masked and their loads clamped
    to the last key."""
    kl, kps = s.key_lanes, THREADS // s.key_lanes
    k_step, v_step = kps * s.kv_heads * s.d // s.k_per, kps * s.kv_heads * s.dv // s.v_per
    rows = range(s.rows)
    k_vals = _values(s.k_loads, s.k_load, s.k_per)
    v_vals = _values(s.v_loads, s.v_load, s.v_per)
    inside = "key < stop and " if tail else ""
    lines = [
        f"base = uint32(pass_at + warp * {THREADS})",
        "key = uint32(base + mine)",
        "kp = k_pos[min(key, stop - 1)]" if tail else "kp = k_pos[key]",
    ]
    for r in rows:
        lines.append(f"ok{r} = {inside}kp <= qp{r} and not (window > 0 and qp{r} - kp >= window)")
    lines += ["first = uint32(base + ks)",
              "k_first = uint64(first) * K_ROW + k_at",
              "v_first = uint64(first) * V_ROW + v_at"]  # fmt: skip

    def key_at(first: str, row: str, i: int, step: int) -> str:
        if tail:  # the clamped key's row
            return f"uint64(min(uint32(first + {i * kps}), stop - 1)) * {row} + {first[0]}_at"
        return f"{first} + uint64({i * step})"

    # 1. scores: key_lanes steps of THREADS / key_lanes keys each
    for i in range(kl):
        lines.append(f"at = {key_at('k_first', 'K_ROW', i, k_step)}")
        for m in range(s.k_loads):
            lines.append(_load("k", f"at + uint64({m * s.k_load * kl})", s.k_load, f"w{m}"))
        for m in range(s.k_loads):
            for j in range(s.k_load):
                lines += _halves(f"w{m}_{j}", s.k_per, f"f{m}_{j}")
        for r in rows:
            terms = [f"q{r}_{m}_{j}_{c} * f{m}_{j}_{c}" for m, j, c in k_vals]
            lines.append(f"d{r} = " + " + ".join(terms))
            step = 1
            while step < kl:
                lines.append(f"d{r} += cuda.shfl_xor_sync(FULL_MASK, d{r}, {step})")
                step *= 2
            lines.append(f"sc{r} = d{r} if part == uint32({i}) else sc{r}")
    # 2. the online softmax per row; the weights into the warp's slice of shared memory
    for r in rows:
        lines += [
            f"sc{r} = sc{r} if ok{r} else NEG_INF",
            f"top{r} = max(m{r}, warp_max(sc{r}))",
            f"shrink{r} = math.exp(m{r} - top{r})",
            f"m{r} = top{r}",
            f"e{r} = math.exp(sc{r} - top{r})",
            f"s{r} = s{r} * shrink{r} + e{r}",
            f"ps[own + {r * THREADS} + mine] = e{r}",
        ]
        lines += [f"o{r}_{m}_{j}_{c} *= shrink{r}" for m, j, c in v_vals]
    lines.append("cuda.syncwarp(FULL_MASK)")
    # 3. the values: the same lanes, the same steps. A key all of whose weights are 0 is not
    # read: its registers keep the last key's words (finite: read from a written cell, or the
    # zeros they start as), so a never-written cell's NaN never meets its weight of 0
    for i in range(kl):
        lines.append(f"j = uint32(own + {i * kps} + ks)")
        for r in rows:
            lines.append(f"a{r} = ps[j + {r * THREADS}]")
        lines.append("if " + " or ".join(f"a{r} != float32(0.0)" for r in rows) + ":")
        lines.append(f"    at = {key_at('v_first', 'V_ROW', i, v_step)}")
        for m in range(s.v_loads):
            lines.append("    " + _load("v", f"at + uint64({m * s.v_load * kl})", s.v_load, f"x{m}"))  # noqa: E501
        for m in range(s.v_loads):
            for j in range(s.v_load):
                lines += _halves(f"x{m}_{j}", s.v_per, f"f{m}_{j}")
        for r in rows:
            lines += [f"o{r}_{m}_{j}_{c} += a{r} * f{m}_{j}_{c}" for m, j, c in v_vals]
    lines.append("cuda.syncwarp(FULL_MASK)")
    return lines


def _source(s: Shape) -> str:
    """The kernel of Shape s as Python source: the rows' queries into registers, the loop of full
    passes and the tail pass (`_pass`), the warps' reductions, the block's merge of its warps."""
    kl, kps = s.key_lanes, THREADS // s.key_lanes
    rows = range(s.rows)
    k_vals = _values(s.k_loads, s.k_load, s.k_per)
    v_vals = _values(s.v_loads, s.v_load, s.v_per)
    kwr, vwr = s.d // s.k_per, s.dv // s.v_per  # a KV head's words in a row of K, of V
    lines = [
        "def decode_vec(q, k, v, q_pos, k_pos, scale, window, chunk, n_rows, partial):",
        "    g, split = uint32(cuda.blockIdx.x), uint32(cuda.blockIdx.y)",
        "    tile, tid = uint32(cuda.blockIdx.z), uint32(cuda.threadIdx.x)",
        f"    lane, warp = uint32(tid % {THREADS}), uint32(tid // {THREADS})",
        f"    part, ks = uint32(lane % {kl}), uint32(lane // {kl})",
        # the key (of the warp's THREADS) whose score this lane ends up holding
        f"    mine = uint32(part * {kps} + ks)",
        f"    group = uint32(q.shape[1] // {s.kv_heads})",
        f"    k_at = uint64(g * {kwr} + {s.k_load} * part)",
        f"    v_at = uint64(g * {vwr} + {s.v_load} * part)",
        "    last = uint32(n_rows - 1)",
    ]
    for r in rows:
        lines += [
            f"    p{r} = uint32(min(tile * {s.rows} + {r}, last))",
            f"    t{r}, h{r} = uint32(p{r} // group), uint32(g * group + p{r} % group)",
            f"    qp{r} = q_pos[t{r}]",
            f"    m{r} = NEG",
            f"    s{r} = float32(0.0)",
            f"    sc{r} = NEG_INF",
        ]
        for m, j, c in k_vals:
            dim = _dim(s, m, j, c, s.k_load, s.k_per)
            lines.append(f"    q{r}_{m}_{j}_{c} = q[t{r}, h{r}, uint32({dim})] * scale")
        lines.append("    " + " = ".join(f"o{r}_{m}_{j}_{c}" for m, j, c in v_vals) + " = float32(0.0)")  # noqa: E501
    # the V words a key that is not read leaves in place
    lines.append("    " + " = ".join(f"x{m}_{j}" for m in range(s.v_loads) for j in range(s.v_load))
                 + " = V_ZERO")  # fmt: skip
    lines += [
        "    start = uint32(split * chunk)",
        "    stop = uint32(min(uint32(k_pos.shape[0]), start + chunk))",
        f"    ps = cuda.shared.array({WARPS * s.rows * THREADS}, float32)",
        f"    mw = cuda.shared.array({WARPS * s.rows}, float32)",
        f"    sw = cuda.shared.array({WARPS * s.rows}, float32)",
        f"    ow = cuda.shared.array({WARPS * s.rows * s.dv}, float32)",
        f"    own = uint32(warp * {s.rows * THREADS})",
        # every warp runs the block's passes (the simulator's shuffles wait for all of them)
        "    pass_at = start",
        f"    while pass_at + {KEYS_PER_BLOCK} <= stop:",
        *("        " + x for x in _pass(s, tail=False)),
        f"        pass_at = uint32(pass_at + {KEYS_PER_BLOCK})",
        "    if pass_at < stop:",
        *("        " + x for x in _pass(s, tail=True)),
    ]
    # the warp's sums over its lanes, its outputs over the lanes that shared dims
    for r in rows:
        lines.append(f"    s{r} = warp_sum(s{r})")
        for m, j, c in v_vals:
            o = f"o{r}_{m}_{j}_{c}"
            step = kl
            while step < THREADS:
                lines.append(f"    {o} += cuda.shfl_xor_sync(FULL_MASK, {o}, {step})")
                step *= 2
        lines += [
            "    if lane == 0:",
            f"        mw[warp * {s.rows} + {r}] = m{r}",
            f"        sw[warp * {s.rows} + {r}] = s{r}",
            "    if ks == 0:",
        ]
        for m, j, c in v_vals:
            dim = _dim(s, m, j, c, s.v_load, s.v_per)
            lines.append(f"        ow[(warp * {s.rows} + {r}) * {s.dv} + {dim}] = o{r}_{m}_{j}_{c}")
    # the block's rows over its warps
    lines += [
        "    cuda.syncthreads()",
        f"    for e in range(tid, {s.rows * s.dv}, {BLOCK_THREADS}):",
        f"        r, i = e // {s.dv}, e % {s.dv}",
        f"        p = tile * {s.rows} + r",
        "        if p < n_rows:",
        "            top = NEG",
        f"            for w in range({WARPS}):",
        f"                top = max(top, mw[w * {s.rows} + r])",
        "            out = float32(0.0)",
        "            total = float32(0.0)",
        f"            for w in range({WARPS}):",
        f"                f = math.exp(mw[w * {s.rows} + r] - top)",
        f"                out += ow[(w * {s.rows} + r) * {s.dv} + i] * f",
        f"                total += sw[w * {s.rows} + r] * f",
        "            t, h = p // group, g * group + p % group",
        "            partial[t, split, h, i] = out",
        "            if i == 0:",
        f"                partial[t, split, h, {s.dv}] = top",
        f"                partial[t, split, h, {s.dv + 1}] = total",
    ]
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=None)
def decode_kernel(shape: Shape):
    """The kernel of one Shape: grid (Hkv, splits, row tiles), BLOCK_THREADS threads; q [T, H, D]
    fp32, k and v the caches' words flattened, q_pos [T], k_pos [S] (the cells' positions),
    partial [T, splits, H, Dv + 2]."""
    v_zero = (uint64 if shape.v_per == 4 else uint32)(0)
    scope = {"cuda": cuda, "math": math, "uint32": uint32, "uint64": uint64, "float32": float32,
             "NEG": NEG, "NEG_INF": NEG_INF, "FULL_MASK": FULL_MASK, "V_ZERO": v_zero,
             "half_pair": half_pair, "load_pair": load_pair, "warp_max": warp_max,
             "warp_sum": warp_sum, "K_ROW": uint64(shape.kv_heads * shape.d // shape.k_per),
             "V_ROW": uint64(shape.kv_heads * shape.dv // shape.v_per)}  # fmt: skip
    name = f"<decode_vec d{shape.d} dv{shape.dv} x{shape.rows} kl{shape.key_lanes}>"
    exec(compile(_source(shape), name, "exec"), scope)
    return cuda.jit(scope["decode_vec"])


def cache_words(cache):
    """An fp16 cache [S, Hkv, D] as the words the kernels load: uint64 [S, Hkv, D / 4] (four
    values a load) where D and the address allow, else uint32 pairs."""
    dim = cache.shape[2]
    if dim % 2 or dim > MAX_HEAD_DIM:
        raise ValueError(f"attention kernels take even head dims up to {MAX_HEAD_DIM}, not {dim}")
    wide = dim % 4 == 0 and _address(cache) % 8 == 0
    return cache.view(np.uint64 if wide else np.uint32)


def kernel_shape(q, k, v) -> Shape | None:
    """The Shape that attends q's rows over caches k, v (fp16 [S, Hkv, D]), or None where a
    lane's share would not fit in registers."""
    kw, vw = cache_words(k), cache_words(v)
    (n_kv, d), dv = k.shape[1:], v.shape[2]
    lanes = key_lanes(kw.shape[2], vw.shape[2])
    pair = [_address(c) % (2 * w.itemsize) == 0 for c, w in ((k, kw), (v, vw))]
    shape = Shape(d, dv, d // kw.shape[2], dv // vw.shape[2], lanes,
                  row_tile(q.shape[0] * (q.shape[1] // n_kv), d, dv), n_kv,
                  load_width(kw.shape[2], lanes, pair[0]),
                  load_width(vw.shape[2], lanes, pair[1]))  # fmt: skip
    return shape if fits(shape) else None


def _address(array) -> int:
    return getattr(array, "__cuda_array_interface__", {"data": (0,)})["data"][0]


def decode_splits(n_keys: int, n_kv_heads: int, n_tiles: int, sms: int = 132,
                  split_keys: int = KEYS_PER_BLOCK) -> int:
    """Enough splits of the keys to give every SM a few blocks (n_kv_heads x n_tiles blocks a
    split), none shorter than `split_keys` (one pass of this kernel's warps; the tiled kernel's
    tile)."""
    want = max(1, -(-4 * sms // (n_kv_heads * n_tiles)))
    return max(1, min(want, -(-n_keys // split_keys)))


def attend(q, k, v, q_pos, k_pos, scale, window, partial, shape: Shape, stream=0):
    """Launch the vec kernel: partial [T, splits, H, Dv + 2] gets each split's rows."""
    n_tokens, n_heads, _ = q.shape
    n_keys, n_kv = k.shape[0], k.shape[1]
    n_rows = n_tokens * (n_heads // n_kv)
    tiles = -(-n_rows // shape.rows)
    kw, vw = cache_words(k), cache_words(v)
    splits = partial.shape[1]
    decode_kernel(shape)[(n_kv, splits, tiles), BLOCK_THREADS, stream](
        q, kw.reshape(kw.size), vw.reshape(vw.size), q_pos, k_pos, np.float32(scale),
        np.int64(window), np.uint32(-(-n_keys // splits)), np.uint32(n_rows), partial,
    )  # fmt: skip
