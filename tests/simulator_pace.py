"""The CUDA simulator's block runner, paced: numba-cuda runs a block's threads as Python threads and
polls them in a loop that never sleeps, so the poller holds the GIL the threads need (the CUDA
engine's tensor-split test: 26.5 s as shipped, 7.6 s paced). This runner does what the shipped one
does — a thread a thread index, all released together once all wait at `syncthreads`, the first
exception raised after aborting the others — and sleeps 10 us between polls. Used only where the
simulator's `BlockManager` has the thread attributes it reads (numba-cuda 0.20 to 0.30 at least);
elsewhere the shipped runner stays."""

from __future__ import annotations

import time

import numpy as np

POLL_SECONDS = 1e-5
_READS = ("syncthreads_blocked", "syncthreads_event", "exception", "abort")


def pace() -> bool:
    import inspect

    from numba.cuda.simulator import kernel

    source = inspect.getsource(kernel.BlockThread)
    if not all(f"self.{a} =" in source for a in _READS) or not hasattr(kernel.BlockManager, "run"):
        return False

    def run(self, grid_point, *args):
        threads = []
        for block_point in np.ndindex(*self._block_dim):
            t = kernel.BlockThread(lambda: self._f(*args), self, grid_point, block_point,
                                   self._debug)  # fmt: skip
            t.start()
            threads.append(t)
        live = list(threads)
        while live:
            failed = next((t for t in live if t.exception), None)
            if failed is not None:
                _abort(threads)
                raise failed.exception[0].with_traceback(failed.exception[1])
            if all(t.syncthreads_blocked for t in live):  # every live thread at the barrier
                for t in live:
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
            live = [t for t in live if t.is_alive()]
            if live:
                time.sleep(POLL_SECONDS)
        failed = next((t for t in threads if t.exception), None)
        if failed is not None:
            raise failed.exception[0].with_traceback(failed.exception[1])

    kernel.BlockManager.run = run
    return True


def _abort(threads) -> None:
    for t in threads:
        t.abort = True
        t.syncthreads_blocked = False
        t.syncthreads_event.set()
