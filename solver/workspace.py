"""Our runtime's workspace: every device array one ubatch needs, laid out in the memory map's
`workspace` region, so the engine allocates nothing after warm-up (docs/contracts.md, Budget). The
memory model of a `refengine` plan reserves exactly this (`memory.compute_nbytes`), and cudarun
carves its arrays from it (`arrays`): one layout, so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refengine.spec import ModelSpec

from .cells import pad_cells

ALIGN = 256
# the prefill GEMM dequantizes a weight to fp16 a panel of rows at a time: each panel is a
# dequantize launch and a cuBLAS call from Python (~50 us of host time), so panels are large
# (`panel_rows`); 256-row panels made an 8B-shaped pp512 host-bound at 3.5 s on an H200
# (docs/measured/2026-11-27-h200-where-8b.txt)
PANEL_NBYTES, PANEL_WEIGHTS_SHARE = 64 << 20, 32
PANEL_ROW_STEP = 256
# products whose fp16 input the Q product before them rounded (`DeviceMath.qkv`)
SHARED_HALF = ("attn_k.weight", "attn_v.weight")
CUBLAS_SPLITS = 32  # the split-K partial outputs cuBLAS's workspace holds (`cublas_nbytes`)
MAX_DECODE_TOKENS = 16  # the matvec kernels' most tokens
INT8_PASS_TOKENS = (1, 4, 8)  # the tokens of one pass of an int8 decode product: a kernel each
# the types whose decode products run in integers (cudarun.kernels.int8.UNITS): their input is
# quantized to int8 first, a launch of its own; the float types take the fp32 matvec
INT8_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})
SPLIT_BLOCKS_PER_SM, SMS = 4, 132  # split-KV decode attention's target (kernels.attention)
GPU_TILE = 32  # keys per tile of decode attention on a GPU (a warp)


@dataclass(frozen=True)
class Slice:
    offset: int
    shape: tuple[int, ...]
    dtype: str


def layout(spec: ModelSpec, tokens: int, logit_rows: int, n_ctx: int) -> dict[str, Slice]:
    """name -> where it lives in the workspace, for ubatches of up to `tokens` tokens over a
    context of n_ctx."""
    hp = spec.hparams
    t = tokens
    d = hp.n_embd
    k_dim, v_dim = hp.n_head_kv * hp.head_dim, hp.n_head_kv * hp.head_dim_v
    used = max(hp.n_expert_used, 1)
    ff_rows, n_ff = (t * used, hp.n_ff_exp) if spec.arch.moe else (t, hp.n_ff)
    want = {
        "tokens": ((t,), "int64"),
        "pos": ((t,), "int64"),
        # the tokens' device keys (cudarun.kvstore.device_keys) and KV cells
        "q_key": ((t,), "int64"),
        "write": ((t,), "int64"),
        "write_swa": ((t if hp.n_swa else 0,), "int64"),
        "x": ((t, d), "float32"),
        "h": ((t, d), "float32"),
        "f": ((t, d), "float32"),
        "q": ((t, hp.n_head, hp.head_dim), "float32"),
        "k": ((t, hp.n_head_kv, hp.head_dim), "float32"),
        "v": ((t, hp.n_head_kv, hp.head_dim_v), "float32"),
        "a": ((t, hp.n_head, hp.head_dim_v), "float32"),
        "k_stage": ((t, k_dim), "float16"),
        "v_stage": ((t, v_dim), "float16"),
        "gate": ((ff_rows, n_ff), "float32"),
        "up": ((ff_rows, n_ff), "float32"),
        "act": ((ff_rows, n_ff), "float32"),
        "logits": ((logit_rows, hp.n_vocab), "float32"),
        # the key each KV cell holds, for full-context and sliding-window layers
        "k_pos": ((pad_cells(n_ctx),), "int64"),
        "k_pos_swa": ((pad_cells(n_ctx) if hp.n_swa else 0,), "int64"),
    }
    if spec.arch.moe:
        want["router"] = ((t, hp.n_expert), "float32")
        want["ids"] = ((t, used), "int32")
        # each chosen expert's place in a routed copy (cudarun: routed streaming)
        want["slot_ids"] = ((t, used), "int32")
        want["pred"] = ((t, used), "int32")  # the experts a prefetch copies (predicted)
        want["gates"] = ((t, used), "float32")
        want["down"] = ((ff_rows, d), "float32")
    # split-KV decode attention's partial results: a prefill tier runs its short ubatches (a
    # prompt's last few tokens, a short prompt) through the decode kernels too
    decode_t = min(t, MAX_DECODE_TOKENS)
    splits = max_splits(hp.n_head_kv, decode_t, n_ctx)
    want["partial"] = ((decode_t, splits, hp.n_head, hp.head_dim_v + 2), "float32")
    # the int8 activations of a decode product (cudarun.kernels.int8): values packed 8 to a word,
    # a word of (d, s) per 32, for the widest input of its widest ubatch (whole passes of tokens);
    # a prompt's expert products run the matvec kernels too: h for gate and up, every slot's
    # activations for down
    values = pass_rows(decode_t) * panel_width(spec)
    if spec.arch.moe:
        values = max(values, t * d, t * used * hp.n_ff_exp)
    want["xq"] = ((values // 8,), "uint64")
    want["xds"] = ((values // 32,), "uint64")
    if t > MAX_DECODE_TOKENS:  # the prefill GEMM's fp16 panels, and cuBLAS's workspace
        widest = panel_width(spec)
        want["panel16"] = ((panel_rows(spec), widest), "float16")
        want["x16"] = ((t * max(used, 1), widest), "float16")
        want["cublas"] = ((cublas_nbytes(t),), "uint8")
    out, offset = {}, 0
    for name, (shape, dtype) in want.items():
        out[name] = Slice(offset, shape, dtype)
        offset += align_up(int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return out


def pass_tokens(tokens: int) -> int:
    """The tokens of one pass of an int8 decode product of `tokens`: one token alone, up to four
    in one pass, else passes of eight (INT8_PASS_TOKENS)."""
    return next((p for p in INT8_PASS_TOKENS if tokens <= p), INT8_PASS_TOKENS[-1])


def pass_rows(tokens: int) -> int:
    """The activation rows an int8 decode product of `tokens` reads: its passes are whole (the
    tokens past `tokens` of the last pass are read and their sums dropped)."""
    step = pass_tokens(tokens)
    return -(-tokens // step) * step


def cublas_nbytes(tokens: int) -> int:
    """cuBLAS's workspace for the prefill products (cudarun.cublas): room for the fp32 partial
    outputs of a split-K product of up to 32 splits over a [tokens, PANEL_ROW_STEP] panel, within
    the 32 MiB cuBLAS's guide recommends on Hopper."""
    return min(CUBLAS_SPLITS * tokens * PANEL_ROW_STEP * 4, 32 << 20)


def panel_width(spec: ModelSpec) -> int:
    """The widest input of a product the prefill GEMM runs: the fp16 panel's row length."""
    hp = spec.hparams
    n_ff = hp.n_ff_exp if spec.arch.moe else hp.n_ff
    return max(hp.n_embd, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim_v, n_ff)


def panel_rows(spec: ModelSpec) -> int:
    """Rows of a weight dequantized to fp16 at a time for the prefill GEMM: as many as
    PANEL_NBYTES and 1/PANEL_WEIGHTS_SHARE of the weights allow (a panel takes from what a plan
    could pin: a tight budget keeps its prefill tier), in steps of PANEL_ROW_STEP, at least one
    step, and no more than the tallest layer matrix needs (the head, run at a prompt's every row
    only when all logits are asked for, takes several)."""
    tallest = max(t.shape[0] for t in spec.tensors if t.layer is not None and len(t.shape) == 2)
    nbytes = min(PANEL_NBYTES, spec.weights_nbytes // PANEL_WEIGHTS_SHARE)
    step = PANEL_ROW_STEP
    fit = nbytes // (2 * panel_width(spec)) // step * step
    return max(step, min(fit, -(-tallest // step) * step))


def matrix_launches(spec: ModelSpec, name: str, tokens: int) -> int:
    """What one product (`cudarun.devicemath.DeviceMath.mm`) launches: a matvec up to
    MAX_DECODE_TOKENS tokens (the bias in its epilogue), after quantizing its input for an int8
    type; beyond, the activations to fp16 (unless an earlier product of the same input did:
    SHARED_HALF), then a dequantize and a cuBLAS product per panel, and the bias add."""
    if tokens <= MAX_DECODE_TOKENS:
        return 1 + (spec.by_name[name].qtype.name in INT8_TYPES)

    rows = spec.by_name[name].shape[0]
    panels = -(-rows // panel_rows(spec))
    rounds = not name.endswith(SHARED_HALF)
    return rounds + 2 * panels + (name.replace(".weight", ".bias") in spec.by_name)


def max_splits(n_kv_heads: int, tokens: int, n_ctx: int) -> int:
    """The most KV splits decode attention uses on a GPU (kernels.attention.decode_splits, with
    its tile of 32 keys); the engine never uses more than the workspace holds."""
    want = -(-SPLIT_BLOCKS_PER_SM * SMS // (n_kv_heads * tokens))
    return max(1, min(want, -(-pad_cells(n_ctx) // GPU_TILE)))


def map_padding_nbytes(spec: ModelSpec) -> int:
    """The most that starting each region of a device's memory map on an ALIGN boundary adds
    (plan.memory_map): ALIGN before each region (a weight group and its expert cache, a layer's
    KV, the scratch slots, the workspace) and at the budget's end. Kernels read KV and activations
    in 4- and 8-byte words: a budget of any byte count must not put a KV region on an odd
    address."""
    from .groups import tensor_groups

    return ALIGN * (2 * len(tensor_groups(spec)) + spec.hparams.n_layer + 4)


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def nbytes(slices: dict[str, Slice]) -> int:
    return max(
        s.offset + int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in slices.values()
    )


def arrays(region, slices: dict[str, Slice]) -> dict:
    """Device arrays over `region` (a device uint8 array: the workspace) at the layout's places."""
    out = {}
    for name, s in slices.items():
        n = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
        out[name] = region[s.offset : s.offset + n].view(np.dtype(s.dtype)).reshape(s.shape)
    return out
