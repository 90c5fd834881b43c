"""Compile every CUDA kernel to PTX for a real GPU architecture, without a GPU.

The simulator runs the kernels' Python, which accepts code that Numba cannot compile for a device
(typing, local array shapes, unsupported calls); this compiles each kernel with the argument types
the runtime launches it with, through NVVM (the `nvidia-nvvm` and `nvidia-cuda-nvrtc` wheels),
so such code fails in CI rather than on the GPU machine. Run it with the simulator off:

    NUMBA_ENABLE_CUDASIM=0 python -m cudarun.ptx_check
"""

from __future__ import annotations

import sys

from numba import types as t

from . import compat  # noqa: F401  (before numba.cuda)

CC = (9, 0)  # the H100 of GPU_NOTES.md


def arr(dtype, ndim):
    return t.Array(dtype, ndim, "C")


def kernels():
    """(name, python function, argument types) for every kernel."""
    from .blocks import LAYOUTS
    from .kernels import attention, elementwise, glue, matvec, moe, prefill

    u8, f32, f16, i64, i32 = t.uint8, t.float32, t.float16, t.int64, t.int32
    raw = arr(u8, 1)
    out = [
        (
            "rms_norm",
            elementwise.rms_norm,
            (arr(f32, 2), arr(f32, 1), arr(f32, 2), t.float64, t.boolean),
        ),
        ("softmax", elementwise.softmax, (arr(f32, 2), arr(f32, 2))),
        (
            "rope",
            elementwise.rope,
            (arr(f32, 3), arr(i64, 1), arr(f32, 3), i64, t.float64, t.float64, t.boolean),
        ),
        ("gated", elementwise.gated, (arr(f32, 2), arr(f32, 2), arr(f32, 2), t.boolean)),
        ("add", elementwise.add, (arr(f32, 2),) * 3),
        (
            "attention",
            attention.attention,
            (
                arr(f32, 3),
                arr(f16, 3),
                arr(f16, 3),
                arr(i64, 1),
                arr(i64, 1),
                arr(f32, 3),
                t.float64,
                i64,
            ),
        ),
        (
            "decode_partial",
            attention.decode_partial,
            (
                arr(f32, 3),
                arr(f16, 3),
                arr(f16, 3),
                arr(i64, 1),
                arr(i64, 1),
                t.float64,
                i64,
                i64,
                arr(f32, 4),
            ),
        ),
        ("decode_merge", attention.decode_merge, (arr(f32, 4), arr(f32, 3))),
        ("route", moe.route, (arr(f32, 2), i64, t.boolean, arr(i32, 2), arr(f32, 2))),
        ("combine", moe.combine, (arr(f32, 2), arr(f32, 2), arr(f32, 2))),
        ("to_half", prefill.to_half, (arr(f32, 2), arr(f16, 2))),
        ("scale_rows", glue.scale_rows, (arr(f32, 2), t.float64)),
        ("add_bias", glue.add_bias, (arr(f32, 2), arr(f32, 1))),
        (
            "store_kv",
            glue.store_kv,
            (
                arr(f32, 2),
                arr(f32, 2),
                arr(i64, 1),
                arr(f16, 2),
                arr(f16, 2),
                arr(f16, 2),
                arr(f16, 2),
            ),
        ),  # fmt: skip
    ]
    for qtype in sorted(LAYOUTS, key=lambda q: q.name):
        name = qtype.name
        out += [
            (
                f"matvec[{name}]",
                matvec.gpu_kernel(qtype),
                (raw, arr(f32, 2), arr(f32, 2), i64, i64),
            ),
            (
                f"get_rows[{name}]",
                elementwise.get_rows_kernel(qtype),
                (raw, arr(i64, 1), arr(f32, 2), i64),
            ),
            (
                f"expert_matvec[{name}]",
                moe.expert_matvec_kernel(qtype),
                (raw, arr(f32, 2), arr(i32, 2), arr(f32, 2), i64, i64, t.boolean),
            ),
            (
                f"dequantize[{name}]",
                prefill.dequantize_kernel(qtype),
                (raw, t.Array(f16, 2, "A"), i64),
            ),
        ]
    return out


def main() -> int:
    from numba import config, cuda

    if config.ENABLE_CUDASIM:
        print("ptx_check: the simulator is on (NUMBA_ENABLE_CUDASIM=1); nothing to compile")
        return 2
    # A kernel's device functions are compiled for "the current device", which needs a driver;
    # here that device is the target architecture.
    from numba.cuda import dispatcher

    dispatcher.get_current_device = lambda: type("Target", (), {"compute_capability": CC})()
    failed = 0
    for name, kernel, argtypes in kernels():
        try:
            cuda.compile_ptx(kernel.py_func, argtypes, cc=CC)
        except Exception as e:  # report every kernel, not just the first
            failed += 1
            print(f"FAILED {name}: {type(e).__name__}: {str(e).splitlines()[0]}")
    print(
        f"ptx_check: {len(kernels()) - failed} kernels compiled for sm_{CC[0]}{CC[1]}, {failed} failed"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
