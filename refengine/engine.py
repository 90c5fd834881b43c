"""The NumPy reference engine: the oracle every other engine is judged against.

It implements the Engine interface of docs/contracts.md — `reset()`, `prefill(tokens,
all_logits=False, record=None)`, `decode(token, record=None)`, `n_past` — with the public operations
of `refengine.reference`, in fp32 from dequantized weights (fp64 inside norms, RoPE and softmax). It
does not imitate llama.cpp's f16 KV cache or 8-bit activation quantization. Several sequences, each
with its own cache, extend the API (`add_sequence`, `remove_sequence`, `process`, `decode_batch`:
docs/sequences.md); the single-sequence calls are sequence 0's.

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
from .sequences import Sequences, Ubatch, check_entries, ubatches
from .spec import ModelSpec, load_spec, require_runnable
from .weights import GGUFWeights


def _keep(rec, record, name: str, x: np.ndarray) -> None:
    """Record activation `name` for this ubatch, appending to earlier ubatches of the same call."""
    if rec is not None and name in record:
        rec[name] = np.concatenate([rec[name], x]) if name in rec else x.copy()


def keep_all(rec, record, produced: dict) -> None:
    """`_keep` each activation a ubatch produced (name -> rows)."""
    for name, x in produced.items():
        _keep(rec, record, name, x)


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
    """One sequence's keys and values per layer, by position, grown by doubling up to n_cells."""

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, head_dim_v: int, n_cells: int):
        self.n_cells = n_cells
        self._shape_k, self._shape_v = (n_head_kv, head_dim), (n_head_kv, head_dim_v)
        self.k = [np.empty((0, *self._shape_k), np.float32) for _ in range(n_layer)]
        self.v = [np.empty((0, *self._shape_v), np.float32) for _ in range(n_layer)]

    def append(
        self, il: int, k: np.ndarray, v: np.ndarray, start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Store [T, Hkv, D] keys/values at positions start.. and return the cache up to them."""
        end = start + k.shape[0]
        if end > self.k[il].shape[0]:
            n_cells = min(self.n_cells, max(end, 2 * self.k[il].shape[0], 64))
            for store, shape in ((self.k, self._shape_k), (self.v, self._shape_v)):
                grown = np.empty((n_cells, *shape), np.float32)
                grown[:start] = store[il][:start]
                store[il] = grown
        self.k[il][start:end] = k
        self.v[il][start:end] = v
        return self.k[il][:end], self.v[il][:end]


class SequenceCalls:
    """The calls every engine of several sequences shares (docs/sequences.md), over its `seqs`
    (`Sequences`), its ubatch size `ubatch_tokens` and its `_forward` of one ubatch; `_added` and
    `_removed` give an engine its say when a sequence comes and goes. The single-sequence calls
    are sequence 0's."""

    requested: set[str] = set()  # activations asked for by the current call

    def process(self, entries, all_logits: bool = False, record=None):
        """Each entry's (seq, tokens) appended to its sequence, in ubatches of `ubatch_tokens`
        that may mix sequences; per entry, the logits of its last token ([n_vocab]) or, with
        all_logits, of each of its tokens ([n_tokens, n_vocab])."""
        entries = check_entries(self.seqs, entries, self.spec.hparams.n_vocab)
        rec = {} if record is not None else None
        self.requested = set(record or ())
        rows = []
        for ub in ubatches(self.seqs, entries, self.ubatch_tokens, all_logits):
            rows.append(self._forward(ub, all_logits, rec, record))
            for seq, _, n in ub.segments:
                self.seqs.n_past[seq] += n
        return finish(split_rows(np.concatenate(rows), entries, all_logits), rec, record)

    def _forward(self, ub: Ubatch, all_logits: bool, rec, record) -> np.ndarray:
        """Run one ubatch (positions from the sequences' n_past, advanced after it); the logits
        of its logit rows [R, n_vocab]; requested activations appended to `rec`."""
        raise NotImplementedError

    @property
    def n_past(self) -> int:
        return self.seqs.n_past.get(0, 0)

    def prefill(self, tokens, all_logits: bool = False, record=None):
        return single(self.process([(0, tokens)], all_logits, record))

    def decode(self, token: int, record=None):
        return single(self.process([(0, [token])], False, record))

    def add_sequence(self) -> int:
        seq = self.seqs.add()
        self._added(seq)
        return seq

    def remove_sequence(self, seq: int) -> None:
        self.seqs.remove(seq)
        self._removed(seq)

    def n_past_of(self, seq: int) -> int:
        self.seqs.check_exists(seq)
        return self.seqs.n_past[seq]

    def decode_batch(self, pairs, record=None):
        """One decode step over several sequences: (seq, token) pairs -> [n, n_vocab]."""
        return stack(self.process([(s, [t]) for s, t in pairs], False, record))

    def _added(self, seq: int) -> None:
        pass

    def _removed(self, seq: int) -> None:
        pass


class NumpyEngine(SequenceCalls):
    """With `n_seq` > 1 the engine holds several sequences, each with its own cache, decoded
    together (docs/sequences.md); `unified` only changes the room: the sequences share n_ctx
    cells, and attention, which each sequence runs over its own keys, is the same."""

    name = "numpy"

    def __init__(self, model: ModelSpec | str, n_ctx: int | None = None,
                 n_ubatch: int = defaults.N_UBATCH, n_seq: int = 1, unified: bool = False):  # fmt: skip
        self.spec = model if isinstance(model, ModelSpec) else load_spec(model)
        require_runnable(self.spec, self.name)
        hp = self.spec.hparams
        self.n_ctx = min(n_ctx or defaults.N_CTX, hp.n_ctx_train)
        self.n_ubatch = self.ubatch_tokens = n_ubatch
        self.seqs = Sequences(self.n_ctx, n_seq, unified)
        self.w = GGUFWeights(self.spec)
        self.output_name = "token_embd.weight" if self.spec.tied_output else "output.weight"
        # Dequantize now, so calls time only the compute; an untied embedding table is read a few
        # rows at a time instead.
        for t in self.spec.tensors:
            if t.name != "token_embd.weight" or self.spec.tied_output:
                self.w.dense(t.name)
        self.reset()

    def reset(self) -> None:
        self.seqs.reset()
        self.kv = {0: self._new_cache()}

    def _new_cache(self) -> KVCache:
        hp = self.spec.hparams
        return KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, hp.head_dim_v, self.seqs.n_ctx_seq)

    # -- Engine API (prefill, decode and the calls of several sequences: SequenceCalls) ---------

    def _added(self, seq: int) -> None:
        self.kv[seq] = self._new_cache()

    def _removed(self, seq: int) -> None:
        del self.kv[seq]

    # -- the forward pass ------------------------------------------------------------------------

    def _forward(self, ub: Ubatch, all_logits: bool, rec, record) -> np.ndarray:
        spec, hp, tr, w = self.spec, self.spec.hparams, self.spec.arch, self.w
        n_tok, pos = ub.size, ub.pos

        x = w.rows("token_embd.weight", ub.tokens)  # [T, d]
        if tr.embed_scale:
            x = x * np.float32(math.sqrt(hp.n_embd))

        for il in range(hp.n_layer):
            p = f"blk.{il}."
            _keep(rec, record, p + "inp", x)
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
            a = np.empty((n_tok, hp.n_head, hp.head_dim_v), np.float32)
            for seq, first, n in ub.segments:  # each sequence over its own keys only
                sl = slice(first, first + n)
                k_all, v_all = self.kv[seq].append(il, k[sl], v[sl], int(pos[first]))
                a[sl] = ref.attention(
                    q[sl],
                    k_all,
                    v_all,
                    pos[sl],
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
                _keep(rec, record, p + "ffn_moe_ids", ids)
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

        if ub.logit_rows.size == 0 and rec is None:
            return np.empty((0, hp.n_vocab), np.float32)
        x = ref.rms_norm(x, w.dense("output_norm.weight"), hp.rms_eps)
        _keep(rec, record, "output_norm", x)
        return ref.matmul(x[ub.logit_rows], w.dense(self.output_name))

    def _linear(self, x: np.ndarray, base: str) -> np.ndarray:
        y = ref.matmul(x, self.w.dense(base + ".weight"))
        if self.w.has(base + ".bias"):
            y = y + self.w.dense(base + ".bias")
        return y


def split_rows(rows: np.ndarray, entries, all_logits: bool) -> list[np.ndarray]:
    """The logit rows of a call (each entry's last token, or all its tokens, in order) per entry."""
    if not all_logits:
        return list(rows)
    cuts = np.cumsum([ids.size for _, ids in entries])[:-1]
    return np.split(rows, cuts)


def single(result):
    """A one-entry call's result (logits, or (logits, activations)) without the list."""
    return _reshape(result, lambda rows: rows[0])


def stack(result):
    """A decode step's result with its rows stacked [n, n_vocab]."""
    return _reshape(result, np.stack)


def _reshape(result, how):
    if not isinstance(result, tuple):
        return how(result)
    logits, rec = result
    out = how(logits)
    if "logits" in rec:
        rec["logits"] = out
    return out, rec
