"""The parts of the forward pass (cudarun.program) as Numba CUDA kernel launches on one stream,
over the workspace arrays of `solver.workspace` and the group's tensors in a ring slot or an arena
region. The same parts as `hostmath`, which is what the tests hold them to (under the simulator
at tiny shapes in CI, on the GPU at real ones).

Up to 16 tokens the products read the GGUF blocks directly: in integers for the quantized types
(`int8`: the input quantized to int8 per 32 once, then dp4a, the named int8 path), in fp32 for the
float ones (`matvec_gpu`); beyond, the weight is dequantized to fp16 panels for cuBLAS
(`matmul_prefill`, the named fp16 tensor-core path).
"""

from __future__ import annotations

import math

import numpy as np

from refengine.spec import ModelSpec
from solver.workspace import INT8_TYPES, MAX_DECODE_TOKENS

from .hostweights import Placed
from .kernels import THREADS, attention, elementwise, glue, int8, matvec, moe, prefill


ROUTED_IDS = "routed_ids"  # a routed copy's weights: where each chosen expert sits in it
CACHED, CACHE_SLOTS = "@cache", "@cache_slots"  # a stack's expert cache, and its size


def device_tensors(layout: list[Placed], buf, held: int | None = None) -> dict:
    """The group's tensors in `buf` (a device uint8 array): F32 vectors (norms, biases) as float32
    arrays, the matrices as their raw bytes (what the matmul kernels decode). `held`: `buf` is a
    routed copy (`hostweights.routed_pack`) holding that many experts of the stack."""
    out, offset = {}, 0
    for p in layout:
        t = p.info
        routed = held is not None and len(t.shape) == 3
        nbytes = t.nbytes // t.shape[0] * held if routed else t.nbytes
        raw = buf[offset : offset + nbytes]
        vector = t.qtype.name == "F32" and len(t.shape) == 1
        out[t.name] = raw.view(np.float32) if vector else raw
        offset += nbytes
    return out


class DeviceMath:
    def __init__(self, spec: ModelSpec, stream_ptr: int = 0):
        self.spec, self.hp, self.tr = spec, spec.hparams, spec.arch
        self.stream_ptr = stream_ptr  # the raw stream cuBLAS runs on (prefill)
        self.blas = None  # its cuBLAS handle (`cudarun.cublas`), at the first prefill product
        # layers whose gate product runs on the device before their up product, in the tier run
        # now: the up product gates in its epilogue (set by the engine at each tier)
        self.glu_layers: frozenset[int] = frozenset()

    # -- primitives ------------------------------------------------------------------------------

    def mm(self, x, w: dict, name: str, out, ws, stream, gated=None, half_ready=False,
           int8_ready=False) -> None:  # fmt: skip
        """out [T, n_out] = x [T, n_in] times the weight (+ its bias); gated = (gate, act,
        use_gelu): act = act(gate) * out as well; half_ready: the workspace's x16 holds x (a
        prompt's product only); int8_ready: its xq and xds hold x (a decode product's)."""
        t = self.spec.by_name[name]
        bias = name.replace(".weight", ".bias")
        if x.shape[0] <= MAX_DECODE_TOKENS:  # the bias and the gating in the product's epilogue
            if t.qtype.name in INT8_TYPES:
                xq, xds = (ws["xq"], ws["xds"]) if int8_ready else self.quantized(x, ws, stream)
                int8.matvec_gpu(w[name], xq, xds, out, t.qtype, t.shape, stream, w.get(bias),
                                gated)  # fmt: skip
            else:
                matvec.matvec_gpu(w[name], x, out, t.qtype, t.shape, stream, w.get(bias), gated)
        else:
            n_in, rows = t.shape[1], ws["panel16"].shape[0]
            # contiguous [rows, n_in] and [T, n_in] views: cuBLAS reads them with ld = n_in
            panel = ws["panel16"].reshape(-1)[: rows * n_in].reshape(rows, n_in)
            x16 = ws["x16"].reshape(-1)[: x.shape[0] * n_in].reshape(x.shape[0], n_in)
            prefill.matmul_prefill(w[name], x, out, t.qtype, t.shape, panel, x16, stream,
                                   self.cublas(ws["cublas"]), half_ready)  # fmt: skip
            if bias in w:
                glue.add_bias[x.shape[0], THREADS, stream](out, w[bias])
            if gated is not None:
                elementwise.launch_rows(elementwise.gated, x.shape[0], gated[0], out, gated[1],
                                        gated[2], stream=stream)  # fmt: skip

    @staticmethod
    def quantized(x, ws, stream):
        """x [T, n] quantized to int8 per 32 into the workspace's xq and xds (`kernels.int8`)."""
        int8.quantize_gpu(x, ws["xq"], ws["xds"], stream)
        return ws["xq"], ws["xds"]

    def cublas(self, workspace):
        """The stream's cuBLAS handle, working in the tier's `cublas` workspace region."""
        if self.blas is None:
            from .cublas import Blas

            self.blas = Blas(self.stream_ptr)
        self.blas.use_workspace(workspace)
        return self.blas

    def norm(self, x, weight, out, stream) -> None:
        eps = np.float32(self.hp.rms_eps)  # a Python float would compile an f64 kernel
        elementwise.rms_norm[x.shape[0], THREADS, stream](x, weight, out, eps, True)

    def rope_qk(self, q, k, pos, w: dict, il: int, stream) -> None:
        """Q's and K's Q/K norms (where the architecture has them) and RoPE, in place."""
        hp, swa = self.hp, self.spec.is_swa(il)
        base, scale = (hp.rope_base_swa, 1.0) if swa else (hp.rope_base, hp.rope_scale)
        neox = self.tr.rope_style == "neox"
        p = f"blk.{il}."
        norms = (w[p + "attn_q_norm.weight"], w[p + "attn_k_norm.weight"]) if self.tr.qk_norm else (q[0, 0], k[0, 0])  # fmt: skip
        elementwise.rope_qk[(q.shape[0], q.shape[1] + k.shape[1]), THREADS, stream](
            q, k, pos, *norms, np.float32(hp.rms_eps), self.tr.qk_norm, hp.n_rot,
            *elementwise.rope_constants(hp.n_rot, base, scale), neox,
        )  # fmt: skip

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
        elementwise.get_rows(w[t.name], ws["tokens"][:n], x, t.qtype, stream=stream)
        if self.tr.embed_scale:
            glue.scale_rows[n, THREADS, stream](x, np.float32(math.sqrt(self.hp.n_embd)))

    def qkv(self, ws, n, w, il, stream) -> None:
        p = f"blk.{il}."
        h = ws["h"][:n]
        self.norm(ws["x"][:n], w[p + "attn_norm.weight"], h, stream)
        names = [f"{p}attn_{m}.weight" for m in "qkv"]
        outs = [ws[m][:n].reshape(n, -1) for m in "qkv"]
        if n <= MAX_DECODE_TOKENS:  # one launch for the three products
            qtypes = [self.spec.by_name[m].qtype for m in names]
            biases = [w.get(m.replace(".weight", ".bias")) for m in names]
            if all(q.name in INT8_TYPES for q in qtypes):  # h quantized once for the three
                xq, xds = self.quantized(h, ws, stream)
                int8.matvec3_gpu([w[m] for m in names], xq, xds, outs, qtypes, h.shape[1],
                                 biases, stream)  # fmt: skip
            else:
                matvec.matvec3_gpu([w[m] for m in names], h, outs, qtypes, h.shape[1], biases,
                                   stream)  # fmt: skip
        else:  # h rounded to fp16 once for the three
            for i, (name, out) in enumerate(zip(names, outs)):
                self.mm(h, w, name, out, ws, stream, half_ready=i > 0)
        self.rope_qk(ws["q"][:n], ws["k"][:n], ws["pos"][:n], w, il, stream)

    def kq(self, ws, n, il, k_cache, v_cache, k_pos, write, window: int, ranges, stream) -> None:
        """Store K and V in their cells `write` (fp16; and in the staging strips), then attend:
        per (first token, end token, first cell, end cell) range, those queries at their keys
        (ws["q_key"]) over those cells' keys `k_pos` (`kvstore.device_keys`), in `window`."""
        hp = self.hp
        k_flat, v_flat = ws["k"][:n].reshape(n, -1), ws["v"][:n].reshape(n, -1)
        glue.store_kv[n, THREADS, stream](
            k_flat, v_flat, write, k_cache.reshape(k_cache.shape[0], -1),
            v_cache.reshape(v_cache.shape[0], -1), ws["k_stage"][:n], ws["v_stage"][:n],
        )  # fmt: skip
        scale = np.float32(hp.attn_scale)  # a Python float would compile an f64 kernel
        for t0, t1, lo, hi in ranges:
            q, a, q_key = ws["q"][t0:t1], ws["a"][t0:t1], ws["q_key"][t0:t1]
            k, v, keys = k_cache[lo:hi], v_cache[lo:hi], k_pos[lo:hi]
            if n <= MAX_DECODE_TOKENS:  # the workspace has the split-KV partials
                splits = min(attention.decode_splits(hi - lo, hp.n_head_kv, t1 - t0),
                             ws["partial"].shape[1])  # fmt: skip
                partial = ws["partial"][: t1 - t0, :splits]
                attention.attention_decode(q, k, v, q_key, keys, a, scale, window, splits,
                                           partial, stream)  # fmt: skip
            else:
                attention.attention_prefill(q, k, v, q_key, keys, a, scale, window, stream)

    def o(self, ws, n, w, il, stream) -> None:
        p = f"blk.{il}."
        f = ws["f"][:n]
        self.mm(ws["a"][:n].reshape(n, -1), w, p + "attn_output.weight", f, ws, stream)
        post = p + "post_attention_norm.weight" if self.tr.post_norms else None
        self.residual(ws, n, f, w, post, stream)
        self.ffn_input(ws, n, w, il, stream)

    def ffn_input(self, ws, n, w, il, stream) -> None:
        """The FFN norm into h; a MoE layer's router on it: the experts (ids) and their gates."""
        p = f"blk.{il}."
        self.norm(ws["x"][:n], w[p + "ffn_norm.weight"], ws["h"][:n], stream)
        if self.tr.moe:
            router = ws["router"][:n]
            self.mm(ws["h"][:n], w, p + "ffn_gate_inp.weight", router, ws, stream)
            moe.route_top_k(router, self.hp.n_expert_used, self.tr.expert_weights_norm,
                            ws["ids"][:n], ws["gates"][:n], stream)  # fmt: skip

    def predict(self, ws, n, w, il, stream) -> None:
        """The layer's router on the layer's input (after `qkv`, whose h it reuses), normed as
        the FFN's input will be: ws["pred"], the experts a prefetch copies."""
        p = f"blk.{il}."
        self.norm(ws["x"][:n], w[p + "ffn_norm.weight"], ws["h"][:n], stream)
        router = ws["router"][:n]
        self.mm(ws["h"][:n], w, p + "ffn_gate_inp.weight", router, ws, stream)
        moe.route_top_k(router, self.hp.n_expert_used, self.tr.expert_weights_norm,
                        ws["pred"][:n], ws["gates"][:n], stream)  # fmt: skip

    def ffn_gate(self, ws, n, w, il, stream) -> None:
        self.mm(ws["h"][:n], w, f"blk.{il}.ffn_gate.weight", ws["gate"][:n], ws, stream)

    def ffn_up(self, ws, n, w, il, stream) -> None:
        """Where the gate product ran on the device before (`glu_layers`), the up product's
        epilogue gates too: `ffn_down` then starts at its product."""
        gated, ready = None, False
        if il in self.glu_layers:
            gated = (ws["gate"][:n], ws["act"][:n], self.tr.ffn_act == "gelu")
            # the gate product just quantized the same h
            ready = self.spec.by_name[f"blk.{il}.ffn_gate.weight"].qtype.name in INT8_TYPES
        self.mm(ws["h"][:n], w, f"blk.{il}.ffn_up.weight", ws["up"][:n], ws, stream, gated,
                int8_ready=ready)  # fmt: skip


    def ffn_down(self, ws, n, w, il, stream) -> None:
        self.down(ws, n, w, il, stream)
        self._post_ffn(ws, n, ws["f"][:n], w, il, stream)

    def down(self, ws, n, w, il, stream) -> None:
        """f = the gated activations times down (and its bias, where `w` has it)."""
        act = ws["act"][:n]
        if il not in self.glu_layers:
            elementwise.launch_rows(elementwise.gated, n, ws["gate"][:n], ws["up"][:n], act,
                                    self.tr.ffn_act == "gelu", stream=stream)  # fmt: skip
        self.mm(act, w, f"blk.{il}.ffn_down.weight", ws["f"][:n], ws, stream)

    def _post_ffn(self, ws, n, f, w, il, stream) -> None:
        post = f"blk.{il}.post_ffw_norm.weight" if self.tr.post_norms else None
        self.residual(ws, n, f, w, post, stream)

    def _experts(self, ws, n, w, name, x, out, per_slot, stream) -> None:
        t = self.spec.by_name[name]
        slots = n * self.hp.n_expert_used
        ids = w.get(ROUTED_IDS, ws["ids"])[:n]  # routed: the experts' places (cache, copy)
        cache, n_cached = w.get(name + CACHED), w.get(CACHE_SLOTS, 0)
        if t.qtype.name in INT8_TYPES:
            xq, xds = self.quantized(x, ws, stream)
            int8.expert_matvec_gpu(w[name], xq, xds, ids, out[:slots], t.qtype, t.shape[1:],
                                   per_slot, stream, cache, n_cached)  # fmt: skip
        else:
            moe.expert_matvec(w[name], x, ids, out[:slots], t.qtype, t.shape[1:], per_slot,
                              stream, cache, n_cached)  # fmt: skip


    def ffn_gate_exps(self, ws, n, w, il, stream) -> None:
        name = f"blk.{il}.ffn_gate_exps.weight"
        self._experts(ws, n, w, name, ws["h"][:n], ws["gate"], False, stream)

    def ffn_up_exps(self, ws, n, w, il, stream) -> None:
        self._experts(
            ws, n, w, f"blk.{il}.ffn_up_exps.weight", ws["h"][:n], ws["up"], False, stream
        )

    def ffn_down_exps(self, ws, n, w, il, stream) -> None:
        self.down_exps(ws, n, w, il, stream)
        self._post_ffn(ws, n, ws["f"][:n], w, il, stream)

    def down_exps(self, ws, n, w, il, stream) -> None:
        """f = each token's chosen experts' down products, weighted by their gates and summed."""
        slots = n * self.hp.n_expert_used
        act = ws["act"][:slots]
        elementwise.launch_rows(elementwise.gated, slots, ws["gate"][:slots], ws["up"][:slots],
                                act, self.tr.ffn_act == "gelu", stream=stream)  # fmt: skip
        down = ws["down"][:slots]
        self._experts(ws, n, w, f"blk.{il}.ffn_down_exps.weight", act, down, True, stream)
        moe.combine[n, THREADS, stream](down, ws["gates"][:n], ws["f"][:n])

    def output(self, ws, n, w, il, stream) -> None:
        """The final norm (into h); the head runs per row (`head`)."""
        self.norm(ws["x"][:n], w["output_norm.weight"], ws["h"][:n], stream)

    def head(self, ws, w, row: int, count: int, stream) -> None:
        """logits[:count] = the head times rows row .. row + count - 1 of the normed
        activations."""
        name = "token_embd.weight" if self.spec.tied_output else "output.weight"
        self.mm(ws["h"][row : row + count], w, name, ws["logits"][:count], ws, stream)
