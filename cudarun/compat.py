"""The one numpy/numba compatibility shim (GPU_NOTES.md). numba-cuda 0.30.4 calls `numpy.row_stack`,
which numpy 2.5 removed, at the first kernel compile; the alias restores it. Every module that
imports numba.cuda imports this first."""

import numpy as np

if not hasattr(np, "row_stack"):
    np.row_stack = np.vstack
