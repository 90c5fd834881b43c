"""The NumPy reference engine: the oracle every other engine is judged against.

It implements the Engine interface of CONTRACTS.md — `reset()`, `prefill(tokens, all_logits=False,
record=None)`, `decode(token, record=None)`, `n_past` — with the public operations of
`refengine.reference`, in fp32 from dequantized weights (fp64 inside norms, RoPE and softmax). It
does not imitate llama.cpp's f16 KV cache or 8-bit activation quantization. One sequence.

With `record={names}` a call returns `(logits, activations)`, the activations float32 and keyed by
`blk.{i}.out` (residual stream after block i, [n_tokens, n_embd]), `output_norm` ([n_tokens,
n_embd]) and `logits` (what the call returns).
"""

from __future__ import annotations

import math

import numpy as np

from . import defaults
from . import reference as ref
from .errors import UserError
from .spec import ModelSpec, load_spec
from .weights import GGUFWeights


def _keep(rec, record, name: str, x: np.ndarray) -> None:
    """Record activation `name` for this ubatch, appending to earlier ubatches of the same call."""
    if rec is not None and name in record:
        rec[name] = np.concatenate([rec[name], x]) if name in rec else x.copy()


def check_context(n_tokens: int, n_ctx: int, n_ctx_train: int) -> None:
    """UserError when a sequence of n_tokens does not fit a context of n_ctx tokens."""
    if n_tokens > n_ctx:
        raise UserError(
            f"{n_tokens} tokens do not fit the context of {n_ctx}; pass a larger context "
            f"(-c, at most {n_ctx_train} for this model) or a shorter prompt"
        )


def check_tokens(tokens, spec: ModelSpec, n_past: int, n_ctx: int) -> np.ndarray:
    """The ubatch's token ids as int64, or UserError: empty, outside the vocabulary, or past the
    context."""
    ids = np.asarray(tokens).reshape(-1)
    if ids.size == 0:
        raise UserError("the prompt is empty; give at least one token")
    n_vocab = spec.hparams.n_vocab
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= n_vocab:
        raise UserError(f"token ids must be integers in 0..{n_vocab - 1}")
    check_context(n_past + ids.size, n_ctx, spec.hparams.n_ctx_train)
    return ids.astype(np.int64)


def finish(logits, rec, record):
    """What an Engine call returns: the logits, or (logits, the requested activations)."""
    if rec is None:
        return logits
    if "logits" in record:
        rec["logits"] = logits
    return logits, {k: v for k, v in rec.items() if k in record}


class KVCache:
    """Per-layer keys and values of the positions seen so far, grown by doubling up to n_ctx."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, n_ctx: int):
        self.n_ctx, self.n_past = n_ctx, 0  # tokens
        self._shape_k, self._shape_v = (n_head_kv, head_dim), (n_head_kv, head_dim_v)
        self.k = [np.empty((0, *self._shape_k), np.float32) for _ in range(n_layer)]
        self.v = [np.empty((0, *self._shape_v), np.float32) for _ in range(n_layer)]

    def append(
        self, il: int, k: np.ndarray, v: np.ndarray, start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store [T, Hkv, D] keys/values at positions start.. and return the cache up to them."""
        end = start + k.shape[0]
        if end > self.k[il].shape[0]:
            n_cells = min(self.n_ctx, max(end, 2 * self.k[il].shape[0], 64))
            for store, shape in ((self.k, self._shape_k), (self.v, self._shape_v)):
                grown = np.empty((n_cells, *shape), np.float32)
                grown[:start] = store[il][:start]
                store[il] = grown
        self.k[il][start:end] = k
        self.v[il][start:end] = v
        return self.k[il][:end], self.v[il][:end]


class NumpyEngine:
    name = "numpy"

    def __init__(
        self, model: ModelSpec | str, n_ctx: int | None = None, n_ubatch: int = defaults.N_UBATCH
    ):
        self.spec = model if isinstance(model, ModelSpec) else load_spec(model)
        hp = self.spec.hparams
        self.n_ctx = min(n_ctx or defaults.N_CTX, hp.n_ctx_train)
        self.n_ubatch = n_ubatch
        self.w = GGUFWeights(self.spec)
        self.output_name = "token_embd.weight" if self.spec.tied_output else "output.weight"
        # Dequantize now, so calls time only the compute; an untied embedding table is read a few
        # rows at a time instead.
        for t in self.spec.tensors:
            if t.name != "token_embd.weight" or self.spec.tied_output:
                self.w.dense(t.name)
        self.reset()

    @property
    def n_past(self) -> int:
        return self.kv.n_past

    def reset(self) -> None:
        hp = self.spec.hparams
        self.kv = KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, hp.head_dim_v, self.n_ctx)

    # -- Engine API ------------------------------------------------------------------------------

    def prefill(self, tokens, all_logits: bool = False, record=None):
        tokens = self._check_tokens(tokens)
        rec = {} if record is not None else None
        logits = []
        for start in range(0, tokens.size, self.n_ubatch):
            chunk = tokens[start : start + self.n_ubatch]
            last_chunk = start + self.n_ubatch >= tokens.size
            logits.append(self._forward(chunk, all_logits or last_chunk, all_logits, rec, record))
        out = np.concatenate(logits, axis=0) if all_logits else logits[-1][-1]
        return self._finish(out, rec, record)

    def decode(self, token: int, record=None):
        tokens = self._check_tokens([token])
        rec = {} if record is not None else None
        out = self._forward(tokens, True, False, rec, record)[-1]
        return self._finish(out, rec, record)

    # -- the forward pass ------------------------------------------------------------------------

    def _check_tokens(self, tokens) -> np.ndarray:
        return check_tokens(tokens, self.spec, self.n_past, self.n_ctx)

    def _finish(self, logits, rec, record):
        return finish(logits, rec, record)

    def _forward(self, tokens, want_logits: bool, all_positions: bool, rec, record):
        """Run one ubatch at positions n_past.. ; logits [T or 1, n_vocab] (or None)."""
        spec, hp, tr, w = self.spec, self.spec.hparams, self.spec.arch, self.w
        n_tok = tokens.size
        pos = np.arange(self.n_past, self.n_past + n_tok)

        x = w.rows("token_embd.weight", tokens)  # [T, d]
        if tr.embed_scale:
            x = x * np.float32(math.sqrt(hp.n_embd))

        for il in range(hp.n_layer):
            p = f"blk.{il}."
            # attention
            h = ref.rms_norm(x, w.dense(p + "attn_norm.weight"), hp.rms_eps)
            q, k, v = (self._linear(h, p + n) for n in ("attn_q", "attn_k", "attn_v"))
            q = q.reshape(n_tok, hp.n_head, hp.head_dim)
            k = k.reshape(n_tok, hp.n_head_kv, hp.head_dim)
            v = v.reshape(n_tok, hp.n_head_kv, hp.head_dim_v)
            if tr.qk_norm:
                q = ref.rms_norm(q, w.dense(p + "attn_q_norm.weight"), hp.rms_eps)
                k = ref.rms_norm(k, w.dense(p + "attn_k_norm.weight"), hp.rms_eps)
            swa = spec.is_swa(il)
            base, scale = (hp.rope_base_swa, 1.0) if swa else (hp.rope_base, hp.rope_scale)
            q = ref.rope(q, pos, hp.n_rot, base, tr.rope_style, scale)
            k = ref.rope(k, pos, hp.n_rot, base, tr.rope_style, scale)
            k_all, v_all = self.kv.append(il, k, v, self.n_past)
            a = ref.attention(
                q,
                k_all,
                v_all,
                pos,
                np.arange(k_all.shape[0]),
                scale=hp.attn_scale,
                window=hp.n_swa if swa else 0,
            )
            a = self._linear(a.reshape(n_tok, -1), p + "attn_output")
            if tr.post_norms:
                a = ref.rms_norm(a, w.dense(p + "post_attention_norm.weight"), hp.rms_eps)
            x = x + a
            # feed-forward
            h = ref.rms_norm(x, w.dense(p + "ffn_norm.weight"), hp.rms_eps)
            if tr.moe:
                ids, gates = ref.moe_route(
                    self._linear(h, p + "ffn_gate_inp"), hp.n_expert_used, tr.expert_weights_norm
                )
                f = ref.moe_ffn(
                    h,
                    ids,
                    gates,
                    w.dense(p + "ffn_gate_exps.weight"),
                    w.dense(p + "ffn_up_exps.weight"),
                    w.dense(p + "ffn_down_exps.weight"),
                    tr.ffn_act,
                )
            else:
                f = ref.gated(
                    tr.ffn_act, self._linear(h, p + "ffn_gate"), self._linear(h, p + "ffn_up")
                )
                f = self._linear(f, p + "ffn_down")
            if tr.post_norms:
                f = ref.rms_norm(f, w.dense(p + "post_ffw_norm.weight"), hp.rms_eps)
            x = x + f
            _keep(rec, record, f"blk.{il}.out", x)

        self.kv.n_past += n_tok
        if not want_logits and rec is None:
            return None
        x = ref.rms_norm(x, w.dense("output_norm.weight"), hp.rms_eps)
        _keep(rec, record, "output_norm", x)
        if not want_logits:
            return None
        rows = x if all_positions else x[-1:]
        return ref.matmul(rows, w.dense(self.output_name))

    def _linear(self, x: np.ndarray, base: str) -> np.ndarray:
        y = ref.matmul(x, self.w.dense(base + ".weight"))
        if self.w.has(base + ".bias"):
            y = y + self.w.dense(base + ".bias")
        return y
