"""The KV between the host mirror (`kvstore.KVMirror`: fp16, every layer, every cell) and the CUDA
engine's device KV buffers of the current tier: each tier's device-resident KV laid out from the
mirror at its switch and written back at the next (`resident`), and a streamed layer's KV copied
up each ubatch (`upload` on the copy stream, as the schedule says).
"""

from __future__ import annotations

import numpy as np

from solver import regions
from solver.cost import PINNED


class DeviceKV:
    def __init__(self, engine):
        self.e = engine

    def resident(self, tier):
        """(layer, device buffer, KV heads it holds; None: all) of a tier's device-resident KV:
        under a tensor split, each device's KV heads of every layer (a head held by several is
        the same on each, so each may write it back)."""
        e = self.e
        if e.shares is None:
            for il, loc in tier.place.kv.items():
                if loc.kind == PINNED:
                    yield il, e.region(tier, regions.kv(il, loc.device)), None
            return
        for d in e.shares.devices:
            heads = e.shares.kv_heads(e.spec, d)
            for il in range(e.spec.hparams.n_layer) if heads[1] > heads[0] else ():
                yield il, e.region(tier, regions.kv(il, d)), heads

    def upload(self, il: int, buf, cells: int, stream, heads=None) -> None:
        """Lay the mirror's keys and values of layer il (of KV `heads` [lo, hi) only, under a
        tensor split) into a device KV buffer `buf` of the current tier
        (`PlanExecutor.kv_rows`): a full-context layer's straight from the mirror; the
        sliding-window pool's gathered into pinned staging first (every copy from it has ended by
        the next ubatch's: each has a reader that a later hand-off or sync waits for)."""
        mirror = self.e.mirror
        k, v = mirror.views(buf, cells, heads)
        dev, host = self.e.kv_rows(il)
        lo, hi = heads or (0, mirror.k_shape[0])
        if isinstance(dev, slice) and heads is None:  # straight from the mirror
            src_k, src_v, n = mirror.k[il], mirror.v[il], dev.stop
        elif isinstance(dev, slice):  # a tier switch's: its heads, gathered
            n = dev.stop
            src_k, src_v = (m[il][:n, lo:hi].copy() for m in (mirror.k, mirror.v))
        else:
            src_k, src_v = mirror.views(self._swa_stage(il, cells), cells, heads)
            src_k[dev], src_v[dev] = (m[il][host, lo:hi] for m in (mirror.k, mirror.v))
            n = self.e.pool.n_used
        if n == 0:  # nothing cached yet (an empty gather's strides are not the buffer's)
            return
        k[:n].copy_to_device(src_k[:n], stream=stream or 0)
        v[:n].copy_to_device(src_v[:n], stream=stream or 0)

    def download(self, il: int, buf, cells: int, heads=None) -> None:
        """A device KV buffer of the current tier (of KV `heads`) back into the mirror."""
        mirror = self.e.mirror
        k, v = mirror.views(buf, cells, heads)
        dev, host = self.e.kv_rows(il)
        if isinstance(dev, slice) and heads is None:  # straight into the mirror
            k[dev].copy_to_host(mirror.k[il][host])
            v[dev].copy_to_host(mirror.v[il][host])
        else:
            lo, hi = heads or (0, mirror.k_shape[0])
            mirror.k[il][host, lo:hi] = k.copy_to_host()[dev]
            mirror.v[il][host, lo:hi] = v.copy_to_host()[dev]

    def _swa_stage(self, il: int, cells: int) -> np.ndarray:
        """Pinned rows, a tier and layer, of the sliding-window pool's gather."""
        nbytes = cells * self.e.cell_nbytes
        return self.e.pinned.array(("swa", self.e.current.tier, il), lambda: ((nbytes,), np.uint8))
