"""The stand-in's kernels of a tensor-split ubatch (`tensor_program`): each device part on its
shares in its own arena (`shard_math`), the host's sums and gather on the CPU queue."""

from __future__ import annotations

import numpy as np

from solver import regions
from solver.groups import FFN_ORDER

from .hostweights import tensors_of
from .shard_math import Shard, ShardMath
from .shards import share_layout


def split_kernels(engine, tier, st) -> dict:
    """Compute name -> kernel for one ubatch `st` (an `hostmath.Act`: the host's side; each
    device keeps a `Shard`)."""
    spec, shares = engine.spec, engine.shares
    math = ShardMath(spec, shares, engine.math["compute"])
    shards = {d: Shard() for d in shares.devices}
    last = spec.hparams.n_layer - 1
    ffn_dim = shares.ff_exp if spec.arch.moe else shares.ff
    down = "ffn_down_exps" if spec.arch.moe else "ffn_down"  # holds the FFN's post-norm

    def weights(group: str, d: int) -> dict:
        region = engine.region(tier, regions.weights(group, d))
        return tensors_of(share_layout(spec, engine.groups[group], shares, d), region)

    def embed(views) -> None:
        engine.math["cpu"].run("embed", None, st, engine.host.tensors("token_embd"))
        st.total = st.x

    def attn(il: int, d: int):
        def kernel(views) -> None:
            sh, w = shards[d], weights(f"blk.{il}.attn", d)
            if il:
                w_before = weights(f"blk.{il - 1}.{down}", d)
                math.take_in(sh, st.total, w_before, f"blk.{il - 1}.ffn_down.bias",
                             f"blk.{il - 1}.post_ffw_norm.weight", f"blk.{il - 1}.out")  # fmt: skip
            else:
                math.take_in(sh, st.total, w, "", "", None)
            lo, hi = shares.heads[d]
            if hi == lo:  # no query heads here: nothing to add
                sh.partial = np.zeros_like(sh.x)
                return
            math.qkv(sh, w, il, st.pos, d)
            _kq(engine, tier, math, il, d, st, sh)
            math.o(sh, w, il, d)

        return kernel

    def ffn(il: int, d: int):
        def kernel(views) -> None:
            sh, w = shards[d], weights(f"blk.{il}.attn", d)
            math.take_in(sh, st.total, w, f"blk.{il}.attn_output.bias",
                         f"blk.{il}.post_attention_norm.weight", None)  # fmt: skip
            lo, hi = ffn_dim[d]
            if hi == lo:
                sh.partial = np.zeros_like(sh.x)
                return
            w = {}
            for kind in FFN_ORDER:
                if f"blk.{il}.{kind}" in engine.groups:
                    w.update(weights(f"blk.{il}.{kind}", d))
            w.update(weights(f"blk.{il}.attn", d))  # the FFN norm (and a MoE layer's router)
            (math.moe_ffn if spec.arch.moe else math.ffn)(sh, w, il, d)

        return kernel

    def output(d: int):
        def kernel(views) -> None:
            sh = shards[d]
            math.take_in(sh, st.total, weights(f"blk.{last}.{down}", d),
                         f"blk.{last}.ffn_down.bias", f"blk.{last}.post_ffw_norm.weight",
                         f"blk.{last}.out")  # fmt: skip
            math.head(sh, weights("output", d), st.logit_rows, st.all_logits, d)

        return kernel

    def summed(views) -> None:  # the partial outputs, in device order
        total = shards[shares.devices[0]].partial.copy()
        for d in shares.devices[1:]:
            total += shards[d].partial
        st.total = total

    def gather(views) -> None:
        st.logits = np.concatenate([shards[d].partial for d in shares.devices], axis=1)
        st.record.update(shards[shares.devices[0]].record)

    kernels = {}
    for p in tier.parts:
        if p.kind == "embed":
            kernels[p.name] = embed
        elif p.kind == "attn":
            kernels[p.name] = attn(p.layer, p.device)
        elif p.kind == "ffn":
            kernels[p.name] = ffn(p.layer, p.device)
        elif p.kind == "output":
            kernels[p.name] = output(p.device)
        elif p.kind == "logits":
            kernels[p.name] = gather
        else:
            kernels[p.name] = summed
    return kernels


def _kq(engine, tier, math: ShardMath, il: int, d: int, st, sh: Shard) -> None:
    """Device d's KV heads of the ubatch into its KV share (and the heads it owns into the host's
    copy, written through), then its query heads' attention over them."""
    spec, shares, mirror = engine.spec, engine.shares, engine.mirror
    lo, hi = shares.kv_heads(spec, d)
    k16, v16 = sh.k.astype(np.float16), sh.v.astype(np.float16)
    for h in range(lo, hi):
        if shares.kv_owner(spec, h) == d:
            mirror.k[il][st.cells.write, h] = k16[:, h - lo]
            mirror.v[il][st.cells.write, h] = v16[:, h - lo]
    buf = engine.region(tier, regions.kv(il, d))
    k, v = mirror.views(buf, tier.kv_cells[il], (lo, hi))
    dc = st.device
    write, keys = (dc.write_swa, dc.keys_swa) if spec.is_swa(il) else (dc.write, dc.keys)
    k[write], v[write] = k16, v16
    sh.a = np.empty((sh.q.shape[0], sh.q.shape[1], v.shape[2]), np.float32)
    for t0, t1, c0, c1 in engine.attention_ranges(st, il):
        sh.a[t0:t1] = math.attention(sh.q[t0:t1], dc.q_keys[t0:t1], il, k[c0:c1], v[c0:c1],
                                     keys[c0:c1], engine.attention_window(il), d)  # fmt: skip
