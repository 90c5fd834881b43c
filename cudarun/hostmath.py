"""The parts of the forward pass (cudarun.program) computed on host arrays.

Two flavours, one code:
- `exact`: the reference operations, in fp32 — the stand-in device's compute queue, so the real
  models run through the executor in CI. A matmul first checks, byte for byte, that the weights
  it was handed (a ring slot, an arena region) are the tensor's bytes in the file, then multiplies
  by the reference's dequantized matrix (`GGUFWeights.dense`, shared with a NumPy engine when one
  is given): a wrong, stale or poisoned slot fails loudly, and the math is the reference's.
- not exact: the CPU kernels a plan's CPU-placed tensors run on a real machine (int8-activation
  `q8` matmuls where the type has one, `cpu_ops` norms, RoPE, attention over the fp16 cache and
  gating) — the named int8 path of docs/contracts.md.

The activations live in an `Act`, which the executor hands from part to part (and, on a GPU, from
device to host and back). `w` is the group's tensors as `hostweights.tensors_of` gives them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
from gguf import GGMLQuantizationType as Q

from refengine import reference as ref
from refengine.spec import ModelSpec

from refengine.weights import GGUFWeights

from .hostweights import dense
from .kvstore import CellMap, DeviceCells
from .kernels import cpu, cpu_ops, q8_gemm, q8_panel


@dataclass
class Act:
    tokens: np.ndarray  # [T] int64
    pos: np.ndarray  # [T] int64 positions
    all_logits: bool = False
    x: np.ndarray | None = None  # residual [T, d]
    h: np.ndarray | None = None  # normed input of the current block [T, d]
    q: np.ndarray | None = None
    k: np.ndarray | None = None
    v: np.ndarray | None = None
    a: np.ndarray | None = None  # attention output [T, H, Dv]
    gate: np.ndarray | None = None
    up: np.ndarray | None = None
    ids: np.ndarray | None = None  # MoE: chosen experts [T, k]
    pred: np.ndarray | None = None  # MoE, prefetch: the experts the router is predicted to choose
    gates: np.ndarray | None = None  # MoE: their weights [T, k]
    logits: np.ndarray | None = None
    total: np.ndarray | None = None  # a tensor split: the host's latest sum of partial outputs
    record: dict = field(default_factory=dict)  # activation name -> [T, ...] of this ubatch
    cells: CellMap | None = None  # the host KV cells the tokens write and read
    device: DeviceCells | None = None  # and the device's (the plan executor's)
    logit_rows: np.ndarray | None = None  # the tokens whose logits are wanted (None: the last)

    def for_host(self) -> "Act":
        """The activations a device engine's CPU segments fill: the ubatch's tokens, what it
        records, its cells and the rows whose logits it wants (a prompt's ubatch before its last
        wants none)."""
        host = Act(self.tokens, self.pos, self.all_logits)
        host.record, host.cells, host.logit_rows = self.record, self.cells, self.logit_rows
        return host


def panel_cache_nbytes() -> int:
    """Host memory the repacked weights of a prompt's products (int8 tiles, fp32 panels) may keep
    (a third of physical memory): a prompt's ubatches then repack each weight once per process,
    not once per ubatch."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 3
    except (ValueError, OSError):
        return 4 << 30


def _numba_owns(x: np.ndarray) -> bool:
    """Whether Numba's thread team may run parallel regions on this ubatch (x's leading dimension
    is its tokens): not from BLAS_TOKENS on, where BLAS's threads run the products and keep the
    cores (two busy-waiting teams on two cores slowed a prompt 4x)."""
    return x.shape[0] < cpu.BLAS_TOKENS


def attention_blas(q, k, v, q_pos, k_pos, scale: float, window: int = 0,
                   max_scores: int = 1 << 24) -> np.ndarray:  # fmt: skip
    """`cpu_ops.attention` for a prompt's ubatch: per KV head, the scores of its query heads as one
    BLAS product, masked, a row softmax (`cpu_ops.masked_softmax`, serial beside BLAS's threads),
    and the product with V, in fp32 (queries in chunks that keep the scores under `max_scores`
    floats)."""
    n, n_head, dim = q.shape
    n_kv, dv = k.shape[1], v.shape[2]
    group = n_head // n_kv
    k32, v32 = k.astype(np.float32), v.astype(np.float32)
    out = np.empty((n, n_head, dv), np.float32)
    step = max(1, max_scores // max(1, group * k.shape[0]))
    for t0 in range(0, n, step):
        qp = np.ascontiguousarray(q_pos[t0 : t0 + step])
        rows = qp.size
        for g in range(n_kv):
            qg = q[t0 : t0 + rows, g * group : (g + 1) * group].transpose(1, 0, 2)
            s = (qg.reshape(group * rows, dim) @ k32[:, g].T).reshape(group, rows, -1)
            cpu_ops.masked_softmax(s, qp, k_pos, scale, window, parallel=False)
            o = s.reshape(group * rows, -1) @ v32[:, g]
            out[t0 : t0 + rows, g * group : (g + 1) * group] = o.reshape(
                group, rows, dv
            ).transpose(1, 0, 2)
    return out


class HostMath:
    def __init__(self, spec: ModelSpec, exact: bool, threads: int = 0, reference=None):
        self.spec, self.exact, self.threads = spec, exact, threads
        self.hp, self.tr = spec.hparams, spec.arch
        self.reference = (reference or GGUFWeights(spec)) if exact else None
        # the q8 activations of the last matmul input: q, k, v (and gate, up, the router) read the
        # same normed activations, quantized once; inputs are never changed in place
        self._q8_of: tuple[np.ndarray | None, tuple] = (None, ())
        self._rope_pos, self._rope_tables = None, {}  # (base, scale) -> cos, sin of those positions
        self.panels: dict = {}  # tensor -> its int8 tiles (q8_panel.Panel) or fp32 panel
        self.panel_room_nbytes = panel_cache_nbytes()

    # -- primitives ----------------------------------------------------------------------------

    def mm(self, x: np.ndarray, w: dict, name: str) -> np.ndarray:
        t = self.spec.by_name[name]
        raw = w[name]
        if self.exact:
            y = ref.matmul(x, self._checked(name, raw, self.reference.dense(name)))
        elif raw.dtype == np.float32:  # an F32 matrix
            y = ref.matmul(x, raw)
        else:
            y = self._mm_int8(x, raw.reshape(-1), t)
        bias = name.replace(".weight", ".bias")
        if bias in w:
            y = y + self._dense(w, bias)
        return y

    def _mm_int8(self, x: np.ndarray, raw: np.ndarray, t) -> np.ndarray:
        """The named int8 path: q8 rows below BLAS_TOKENS tokens, else int8 tiles or fp32 panels
        (each cached while there is room) and their products."""
        kind = cpu.path(t.qtype, x.shape[0], t.shape)
        if kind == "q8" and not self.threads:
            out = np.empty((x.shape[0], t.shape[0]), np.float32)
            cpu.q8_matvec(raw, self._quantized(x), t.qtype, t.shape, out)
            return out
        if kind in ("q8gemm", "blas"):
            panel = self.panels.get(t.name)
            tiles = kind == "q8gemm"  # ~1.4 bytes a weight, an fp32 panel's 4
            if panel is None and (2 if tiles else 4) * math.prod(t.shape) <= self.panel_room_nbytes:
                with cpu.threads_set(self.threads):
                    panel = (q8_panel.repack(raw, t.qtype, t.shape) if tiles
                             else cpu.dense_panel(raw, t.qtype, t.shape))  # fmt: skip
                self.panels[t.name] = panel
                self.panel_room_nbytes -= panel.nbytes
            if panel is not None and tiles:
                out = np.empty((x.shape[0], t.shape[0]), np.float32)
                with cpu.threads_set(self.threads):
                    q8_gemm.product(panel, self._quantized(x), out)
                return out
            if panel is not None:
                return np.matmul(np.ascontiguousarray(x, np.float32), panel.T)
        return cpu.matmul(raw, x, t.qtype, t.shape, self.threads)

    def _quantized(self, x: np.ndarray) -> tuple:
        """x's q8 activations, kept for the next caller with the same array."""
        if self._q8_of[0] is not x:
            self._q8_of = (x, cpu.quantize_activations(np.ascontiguousarray(x, np.float32)))
        return self._q8_of[1]

    def _checked(self, name: str, raw: np.ndarray, dense_w: np.ndarray, e=None) -> np.ndarray:
        want = self.reference.raw(name)
        want = want if e is None else want[e]
        if not np.array_equal(raw.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)):
            raise ValueError(f"{name}: the bytes handed to the kernel are not the tensor's")
        return dense_w if e is None else dense_w[e]

    def mm_rows(self, x: np.ndarray, raw: np.ndarray, info, e: int) -> np.ndarray:
        """x times expert e's matrix (`raw`: its rows of the 3-D stack)."""
        if self.exact:
            return ref.matmul(x, self._checked(info.name, raw, self.reference.dense(info.name), e))
        shape = info.shape[1:]
        return cpu.matmul(np.ascontiguousarray(raw).reshape(-1), x, info.qtype, shape, self.threads,
                          exact=self.exact)  # fmt: skip

    def _dense(self, w: dict, name: str) -> np.ndarray:
        return dense(self.spec.by_name[name], w[name])

    def norm(self, x: np.ndarray, w: dict, name: str) -> np.ndarray:
        weight = self._dense(w, name)
        if self.exact:
            return ref.rms_norm(x, weight, self.hp.rms_eps)
        flat = np.ascontiguousarray(x.reshape(-1, x.shape[-1]))
        return cpu_ops.rms_norm(flat, weight, self.hp.rms_eps, _numba_owns(x)).reshape(x.shape)

    def rope(self, x: np.ndarray, pos: np.ndarray, il: int) -> np.ndarray:
        hp, swa = self.hp, self.spec.is_swa(il)
        base, scale = (hp.rope_base_swa, 1.0) if swa else (hp.rope_base, hp.rope_scale)
        if self.exact:
            return ref.rope(x, pos, hp.n_rot, base, self.tr.rope_style, scale)
        if self._rope_pos is not pos:  # q and k of every layer share the ubatch's angles
            self._rope_pos, self._rope_tables = pos, {}
        table = self._rope_tables.get((base, scale))
        if table is None:
            table = self._rope_tables[base, scale] = cpu_ops.rope_table(
                pos, hp.n_rot, base, scale, _numba_owns(x))  # fmt: skip
        return cpu_ops.rope(np.ascontiguousarray(x), pos, hp.n_rot, base, scale,
                            self.tr.rope_style == "neox", _numba_owns(x), table)  # fmt: skip

    def gated(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if self.exact:
            return ref.gated(self.tr.ffn_act, gate, up)
        shape = gate.shape
        g2, u2 = (np.ascontiguousarray(a.reshape(-1, shape[-1])) for a in (gate, up))
        return cpu_ops.gated(g2, u2, self.tr.ffn_act == "gelu", _numba_owns(gate)).reshape(shape)

    def attention(self, q, q_pos, il: int, k, v, k_pos, window: int | None = None) -> np.ndarray:
        """q [T, H, D] at positions q_pos over the cache k, v [S, Hkv, D] (fp16) at positions
        k_pos -> [T, H, Dv]; the layer's window unless one is given (`kvstore.device_keys`)."""
        hp = self.hp
        if window is None:
            window = hp.n_swa if self.spec.is_swa(il) else 0
        if self.exact:
            return ref.attention(
                q, k.astype(np.float32), v.astype(np.float32), q_pos, k_pos, hp.attn_scale, window,
            )  # fmt: skip
        if not _numba_owns(q):
            return attention_blas(q, k, v, q_pos, k_pos, hp.attn_scale, window)
        return cpu_ops.attention(
            np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v),
            q_pos, np.ascontiguousarray(k_pos), hp.attn_scale, window,
        )  # fmt: skip

    def kq_on_host(self, st: Act, il: int, mirror) -> None:
        """The attention of a layer whose KV is in host memory: st.k, st.v into their cells of
        the mirror (fp16), then each sequence's queries over the cells they can see."""
        c = st.cells
        mirror.k[il][c.write] = st.k.astype(np.float16)
        mirror.v[il][c.write] = st.v.astype(np.float16)
        lo_of = c.lo_swa if self.spec.is_swa(il) else c.lo
        st.a = np.empty((st.q.shape[0], self.hp.n_head, self.hp.head_dim_v), np.float32)
        for seq, first, n in c.segments:
            sl = slice(first, first + n)
            lo, hi = int(lo_of[sl].min()), int(c.hi[sl].max())
            # the span of the sequence's own cells: a unified cache's range is every sequence's,
            # whose keys it can only mask (Gemma-3's 8 prompts of 128 spent 3x on attention)
            own = np.flatnonzero(c.cell_seq[lo:hi] == seq)
            if own.size:
                lo, hi = lo + int(own[0]), lo + int(own[-1]) + 1
            st.a[sl] = self.attention(st.q[sl], st.pos[sl], il, mirror.k[il][lo:hi],
                                      mirror.v[il][lo:hi], c.key_positions(seq, lo, hi))  # fmt: skip

    # -- parts ---------------------------------------------------------------------------------

    def run(self, kind: str, il: int | None, st: Act, w: dict) -> None:
        """Every part but `kq` (the executor runs that one where the KV is)."""
        getattr(self, kind)(st, w, il)

    def embed(self, st: Act, w: dict, il) -> None:
        t = self.spec.by_name["token_embd.weight"]
        x = cpu.get_rows(w[t.name], t.qtype, t.shape, st.tokens)
        if self.tr.embed_scale:
            x = x * np.float32(math.sqrt(self.hp.n_embd))
        st.x = x

    def qkv(self, st: Act, w: dict, il: int) -> None:
        hp, p, n = self.hp, f"blk.{il}.", st.tokens.size
        h = self.norm(st.x, w, p + "attn_norm.weight")
        q = self.mm(h, w, p + "attn_q.weight").reshape(n, hp.n_head, hp.head_dim)
        k = self.mm(h, w, p + "attn_k.weight").reshape(n, hp.n_head_kv, hp.head_dim)
        v = self.mm(h, w, p + "attn_v.weight").reshape(n, hp.n_head_kv, hp.head_dim_v)
        if self.tr.qk_norm:
            q = self.norm(q, w, p + "attn_q_norm.weight")
            k = self.norm(k, w, p + "attn_k_norm.weight")
        st.q, st.k, st.v = self.rope(q, st.pos, il), self.rope(k, st.pos, il), v

    def o(self, st: Act, w: dict, il: int) -> None:
        p, n = f"blk.{il}.", st.tokens.size
        a = self.mm(st.a.reshape(n, -1), w, p + "attn_output.weight")
        if self.tr.post_norms:
            a = self.norm(a, w, p + "post_attention_norm.weight")
        st.x = st.x + a
        st.h = self.norm(st.x, w, p + "ffn_norm.weight")
        if self.tr.moe:
            logits = self.mm(st.h, w, p + "ffn_gate_inp.weight")
            st.ids, st.gates = cpu_ops.route(logits, self.hp.n_expert_used,
                                             self.tr.expert_weights_norm)  # fmt: skip

    def predict(self, st: Act, w: dict, il: int) -> None:
        """The layer's router on the layer's input, normed as its FFN's input will be: the
        experts a prefetch copies before the router runs (st.pred)."""
        p = f"blk.{il}."
        logits = self.mm(self.norm(st.x, w, p + "ffn_norm.weight"), w, p + "ffn_gate_inp.weight")
        st.pred, _ = cpu_ops.route(logits, self.hp.n_expert_used, self.tr.expert_weights_norm)

    def ffn_gate(self, st: Act, w: dict, il: int) -> None:
        st.gate = self.mm(st.h, w, f"blk.{il}.ffn_gate.weight")

    def ffn_up(self, st: Act, w: dict, il: int) -> None:
        st.up = self.mm(st.h, w, f"blk.{il}.ffn_up.weight")

    def ffn_down(self, st: Act, w: dict, il: int) -> None:
        self._residual(st, w, il, self.down(st, w, il))

    def down(self, st: Act, w: dict, il: int) -> np.ndarray:
        """The gated activations times down (and its bias, where `w` has it)."""
        return self.mm(self.gated(st.gate, st.up), w, f"blk.{il}.ffn_down.weight")

    def _experts(self, st: Act, w: dict, name: str, x: np.ndarray) -> np.ndarray:
        """Per (token, slot), the chosen expert's product with x ([T, n] shared by a token's
        slots, or [T, k, n]): [T, k, n_out]. The int8 path runs every expert in one pass over
        the stack (`cpu.q8_experts`): a call per expert paid a kernel launch each, and a prompt's
        per-expert fp32 panels alternated Numba's threads with BLAS's on the same cores."""
        info, stack = self.spec.by_name[name], w[name]
        n_tokens, k = st.ids.shape
        n_out = info.shape[1]
        if (self.exact or Q(info.qtype) not in cpu.Q8_ROWS or not isinstance(stack, np.ndarray)
                or stack.shape[0] != self.hp.n_expert or not stack.flags.c_contiguous):
            out = np.zeros((n_tokens, k, n_out), np.float32)
            for e in np.unique(st.ids):
                rows, slot = np.nonzero(st.ids == e)
                out[rows, slot] = self.mm_rows(x[rows] if x.ndim == 2 else x[rows, slot],
                                               stack[e], info, e)  # fmt: skip
            return out
        flat = st.ids.reshape(-1)
        order = np.argsort(flat, kind="stable")  # (token, slot) rows grouped by expert
        counts = np.bincount(flat, minlength=self.hp.n_expert)
        used = np.flatnonzero(counts)
        first = np.concatenate([[0], np.cumsum(counts[used])])
        out = np.empty((n_tokens * k, n_out), np.float32)
        with cpu.threads_set(self.threads):
            if x.ndim == 2:  # each token quantized once, its rows repeated for its slots
                q8 = tuple(cpu.take_rows(a, order // k) for a in self._quantized(x))
            else:
                q8 = cpu.quantize_activations(cpu.take_rows(x.reshape(n_tokens * k, -1), order))
            grouped = np.empty((order.size, n_out), np.float32)
            cpu.q8_experts(stack, q8, used, first, info.qtype, info.shape[1:], grouped)
            cpu.put_rows(out, order, grouped)
        return out.reshape(n_tokens, k, n_out)

    def ffn_gate_exps(self, st: Act, w: dict, il: int) -> None:
        st.gate = self._experts(st, w, f"blk.{il}.ffn_gate_exps.weight", st.h)

    def ffn_up_exps(self, st: Act, w: dict, il: int) -> None:
        st.up = self._experts(st, w, f"blk.{il}.ffn_up_exps.weight", st.h)

    def ffn_down_exps(self, st: Act, w: dict, il: int) -> None:
        self._residual(st, w, il, self.down_exps(st, w, il))

    def down_exps(self, st: Act, w: dict, il: int) -> np.ndarray:
        """Each token's chosen experts' down products, weighted by their gates and summed."""
        act = self.gated(st.gate, st.up)
        down = self._experts(st, w, f"blk.{il}.ffn_down_exps.weight", act)
        if self.exact:
            f = np.zeros((st.tokens.size, down.shape[2]), np.float32)
            for e in np.unique(st.ids):  # the reference's order of summation
                rows, slot = np.nonzero(st.ids == e)
                f[rows] += st.gates[rows, slot][:, None] * down[rows, slot]
            return f
        return cpu_ops.gated_sum(down, st.gates, st.ids)

    def _residual(self, st: Act, w: dict, il: int, f: np.ndarray) -> None:
        if self.tr.post_norms:
            f = self.norm(f, w, f"blk.{il}.post_ffw_norm.weight")
        st.x = st.x + f
        st.record[f"blk.{il}.out"] = st.x

    def output(self, st: Act, w: dict, il) -> None:
        x = self.norm(st.x, w, "output_norm.weight")
        st.record["output_norm"] = x
        head = "token_embd.weight" if self.spec.tied_output else "output.weight"
        x = x if st.all_logits else x[-1:] if st.logit_rows is None else x[st.logit_rows]
        t = self.spec.by_name[head]
        if x.shape[0] == 0:  # a prompt's ubatch before its last
            st.logits = np.empty((0, t.shape[0]), np.float32)
            return
        # a prompt's every row from BLAS_TOKENS on, and more rows than the largest decode step
        # of many sequences, go to an fp32 panel product
        most = cpu.BLAS_TOKENS if st.all_logits else cpu.MAX_DECODE_ROWS
        if not self.exact and x.shape[0] < most and t.qtype in cpu.Q16_ROWS:
            # the logits are what is sampled: the head takes its activations to 15 bits (half
            # of the int8 path's KL against the reference on SmolLM2 came from the head)
            x16, xd = cpu.quantize_activations16(np.ascontiguousarray(x, np.float32))
            st.logits = np.empty((x.shape[0], t.shape[0]), np.float32)
            cpu.q16_matvec(w[head].reshape(-1), x16, xd, t.qtype, t.shape, st.logits)
        elif not self.exact and x.shape[0] < most and t.qtype in cpu.Q8_ROWS:
            # other types: a second int8 plane of what the first left out, about 15 bits too
            two = cpu.quantize_two_planes(np.ascontiguousarray(x, np.float32))
            both = np.empty((2 * x.shape[0], t.shape[0]), np.float32)
            cpu.q8_matvec(w[head].reshape(-1), two, t.qtype, t.shape, both)
            st.logits = both[: x.shape[0]] + both[x.shape[0] :]
        else:
            st.logits = self.mm(x, w, head)
