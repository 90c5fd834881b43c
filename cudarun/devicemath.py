"""The parts of the forward pass (cudarun.program) as Numba CUDA kernel launches on one stream,
over the workspace arrays of `solver.workspace` and the group's tensors in a ring slot or an arena
region. The same parts as `hostmath`, which is what the tests hold them to (under the simulator
at tiny shapes in CI, on the GPU at real ones).

Up to 16 tokens the products read the GGUF blocks directly (`matvec_gpu`); beyond, the weight is
dequantized to fp16 panels for cuBLAS (`matmul_prefill`, the named fp16 tensor-core path).
"""

from __future__ import annotations

import math

import numpy as np

from refengine.spec import ModelSpec
from solver.workspace import MAX_DECODE_TOKENS

from .hostweights import Placed
from .kernels import THREADS, attention, elementwise, glue, matvec, moe, prefill


def device_tensors(layout: list[Placed], buf) -> dict:
    """The group's tensors in `buf` (a device uint8 array): F32 vectors (norms, biases) as float32
    arrays, the matrices as their raw bytes (what the matmul kernels decode)."""
    out = {}
    for p in layout:
        t = p.info
        raw = buf[p.offset : p.offset + t.nbytes]
        vector = t.qtype.name == "F32" and len(t.shape) == 1
        out[t.name] = raw.view(np.float32) if vector else raw
    return out


class DeviceMath:
    def __init__(self, spec: ModelSpec, stream_ptr: int = 0):
        self.spec, self.hp, self.tr = spec, spec.hparams, spec.arch
        self.stream_ptr = stream_ptr  # the raw stream cuBLAS runs on (prefill)

    # -- primitives ------------------------------------------------------------------------------

    def mm(self, x, w: dict, name: str, out, ws, stream) -> None:
        """out [T, n_out] = x [T, n_in] times the weight (+ its bias)."""
        t = self.spec.by_name[name]
        if x.shape[0] <= MAX_DECODE_TOKENS:
            matvec.matvec_gpu(w[name], x, out, t.qtype, t.shape, stream)
        else:
            n_in, rows = t.shape[1], ws["panel16"].shape[0]
            # contiguous [rows, n_in] and [T, n_in] views: cuBLAS reads them with ld = n_in
            panel = ws["panel16"].reshape(-1)[: rows * n_in].reshape(rows, n_in)
            x16 = ws["x16"].reshape(-1)[: x.shape[0] * n_in].reshape(x.shape[0], n_in)
            prefill.matmul_prefill(w[name], x, out, t.qtype, t.shape, panel, x16, stream,
                                   self.stream_ptr)  # fmt: skip
        bias = name.replace(".weight", ".bias")
        if bias in w:
            glue.add_bias[x.shape[0], THREADS, stream](out, w[bias])

    def norm(self, x, weight, out, stream) -> None:
        eps = np.float32(self.hp.rms_eps)  # a Python float would compile an f64 kernel
        elementwise.rms_norm[x.shape[0], THREADS, stream](x, weight, out, eps, True)

    def rope(self, x, pos, il: int, stream) -> None:
        hp, swa = self.hp, self.spec.is_swa(il)
        base, scale = (hp.rope_base_swa, 1.0) if swa else (hp.rope_base, hp.rope_scale)
        neox = self.tr.rope_style == "neox"
        elementwise.rope[(x.shape[0], x.shape[1]), THREADS, stream](
            x, pos, x, hp.n_rot, *elementwise.rope_constants(hp.n_rot, base, scale), neox
        )

    def residual(self, ws, n: int, f, w: dict, norm_name: str | None, stream) -> None:
        """x += f, after the post-norm when the architecture has one."""
        x = ws["x"][:n]
        if norm_name is not None:
            self.norm(f, w[norm_name], f, stream)
        elementwise.add[n, THREADS, stream](x, f, x)

    # -- parts -----------------------------------------------------------------------------------

    def embed(self, ws, n, w, il, stream) -> None:
        t = self.spec.by_name["token_embd.weight"]
        x = ws["x"][:n]
        elementwise.launch_rows(elementwise.get_rows_kernel(t.qtype), n, w[t.name],
                                ws["tokens"][:n], x, t.shape[1], stream=stream)  # fmt: skip
        if self.tr.embed_scale:
            glue.scale_rows[n, THREADS, stream](x, np.float32(math.sqrt(self.hp.n_embd)))

    def qkv(self, ws, n, w, il, stream) -> None:
        p = f"blk.{il}."
        h = ws["h"][:n]
        self.norm(ws["x"][:n], w[p + "attn_norm.weight"], h, stream)
        for name, dst in (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v")):
            out = ws[dst][:n]
            self.mm(h, w, p + name + ".weight", out.reshape(n, -1), ws, stream)
        q, k = ws["q"][:n], ws["k"][:n]
        if self.tr.qk_norm:
            for arr, name in ((q, "attn_q_norm"), (k, "attn_k_norm")):
                rows = arr.reshape(-1, arr.shape[2])
                self.norm(rows, w[p + name + ".weight"], rows, stream)
        pos = ws["pos"][:n]
        self.rope(q, pos, il, stream)
        self.rope(k, pos, il, stream)

    def kq(self, ws, n, il, k_cache, v_cache, k_pos, stream, used: int) -> None:
        """Store K and V at their ring cells (fp16; and in the staging strips), then attend over
        the first `used` cells (the others were never written)."""
        hp = self.hp
        pos = ws["pos"][:n]
        k_flat, v_flat = ws["k"][:n].reshape(n, -1), ws["v"][:n].reshape(n, -1)
        glue.store_kv[n, THREADS, stream](
            k_flat, v_flat, pos, k_cache.reshape(k_cache.shape[0], -1),
            v_cache.reshape(v_cache.shape[0], -1), ws["k_stage"][:n], ws["v_stage"][:n],
        )  # fmt: skip
        window = hp.n_swa if self.spec.is_swa(il) else 0
        scale = np.float32(hp.attn_scale)  # a Python float would compile an f64 kernel
        q, a = ws["q"][:n], ws["a"][:n]
        k_cache, v_cache, k_pos = k_cache[:used], v_cache[:used], k_pos[:used]
        if n <= MAX_DECODE_TOKENS:
            splits = min(attention.decode_splits(k_cache.shape[0], hp.n_head_kv, n),
                         ws["partial"].shape[1])  # fmt: skip
            partial = ws["partial"][:n, :splits]
            attention.attention_decode(q, k_cache, v_cache, pos, k_pos, a, scale, window,
                                       splits, partial, stream)  # fmt: skip
        else:
            attention.attention_prefill(q, k_cache, v_cache, pos, k_pos, a, scale, window, stream)

    def o(self, ws, n, w, il, stream) -> None:
        p = f"blk.{il}."
        f = ws["f"][:n]
        self.mm(ws["a"][:n].reshape(n, -1), w, p + "attn_output.weight", f, ws, stream)
        post = p + "post_attention_norm.weight" if self.tr.post_norms else None
        self.residual(ws, n, f, w, post, stream)
        self.norm(ws["x"][:n], w[p + "ffn_norm.weight"], ws["h"][:n], stream)
        if self.tr.moe:
            router = ws["router"][:n]
            self.mm(ws["h"][:n], w, p + "ffn_gate_inp.weight", router, ws, stream)
            moe.route.forall(n, stream=stream)(router, self.hp.n_expert_used,
                                               self.tr.expert_weights_norm, ws["ids"][:n],
                                               ws["gates"][:n])  # fmt: skip

    def ffn_gate(self, ws, n, w, il, stream) -> None:
        self.mm(ws["h"][:n], w, f"blk.{il}.ffn_gate.weight", ws["gate"][:n], ws, stream)

    def ffn_up(self, ws, n, w, il, stream) -> None:
        self.mm(ws["h"][:n], w, f"blk.{il}.ffn_up.weight", ws["up"][:n], ws, stream)

    def ffn_down(self, ws, n, w, il, stream) -> None:
        act = ws["act"][:n]
        elementwise.launch_rows(elementwise.gated, n, ws["gate"][:n], ws["up"][:n], act,
                                self.tr.ffn_act == "gelu", stream=stream)  # fmt: skip
        f = ws["f"][:n]
        self.mm(act, w, f"blk.{il}.ffn_down.weight", f, ws, stream)
        self._post_ffn(ws, n, f, w, il, stream)

    def _post_ffn(self, ws, n, f, w, il, stream) -> None:
        post = f"blk.{il}.post_ffw_norm.weight" if self.tr.post_norms else None
        self.residual(ws, n, f, w, post, stream)

    def _experts(self, ws, n, w, name, x, out, per_slot, stream) -> None:
        t = self.spec.by_name[name]
        rows, cols = t.shape[1], t.shape[2]
        slots = n * self.hp.n_expert_used
        moe.expert_matvec_kernel(t.qtype)[(rows, slots), THREADS, stream](
            w[name], x, ws["ids"][:n], out[:slots], rows, cols, per_slot
        )

    def ffn_gate_exps(self, ws, n, w, il, stream) -> None:
        name = f"blk.{il}.ffn_gate_exps.weight"
        self._experts(ws, n, w, name, ws["h"][:n], ws["gate"], False, stream)

    def ffn_up_exps(self, ws, n, w, il, stream) -> None:
        self._experts(
            ws, n, w, f"blk.{il}.ffn_up_exps.weight", ws["h"][:n], ws["up"], False, stream
        )

    def ffn_down_exps(self, ws, n, w, il, stream) -> None:
        slots = n * self.hp.n_expert_used
        act = ws["act"][:slots]
        elementwise.launch_rows(elementwise.gated, slots, ws["gate"][:slots], ws["up"][:slots],
                                act, self.tr.ffn_act == "gelu", stream=stream)  # fmt: skip
        down = ws["down"][:slots]
        self._experts(ws, n, w, f"blk.{il}.ffn_down_exps.weight", act, down, True, stream)
        f = ws["f"][:n]
        moe.combine[n, THREADS, stream](down, ws["gates"][:n], f)
        self._post_ffn(ws, n, f, w, il, stream)

    def output(self, ws, n, w, il, stream) -> None:
        """The final norm (into h); the head runs per row (`head`)."""
        self.norm(ws["x"][:n], w["output_norm.weight"], ws["h"][:n], stream)

    def head(self, ws, w, row: int, stream) -> None:
        """logits[0] = the head times row `row` of the normed activations."""
        name = "token_embd.weight" if self.spec.tied_output else "output.weight"
        self.mm(ws["h"][row : row + 1], w, name, ws["logits"][:1], ws, stream)
