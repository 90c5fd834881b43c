"""What `refengine info` reports about a model, as plain data: hyperparameters, bytes per role,
one row per layer (bytes by role, tensor types, sliding-window or not) and every tensor. It leaves
out how that is printed."""

from __future__ import annotations

from collections import defaultdict

from .spec import ModelSpec


def layer_rows(spec: ModelSpec) -> list[dict]:
    """The global tensors (layer None), then one row per layer."""
    rows = []
    layers = sorted({t.layer for t in spec.tensors if t.layer is not None})
    for il in [None, *layers]:
        ts = spec.layer_tensors(il)
        by_role = defaultdict(int)
        for t in ts:
            by_role[t.role] += t.nbytes
        rows.append(
            {
                "layer": il,
                "swa": spec.is_swa(il) if il is not None else None,
                "nbytes": sum(by_role.values()),
                "by_role": dict(by_role),
                "types": sorted({t.qtype.name for t in ts}),
            }
        )
    return rows


def info_dict(spec: ModelSpec) -> dict:
    totals = defaultdict(int)
    for t in spec.tensors:
        totals[t.role] += t.nbytes
    return {
        "path": str(spec.path),
        "name": spec.name,
        "arch": spec.arch.name,
        "priced_generically": spec.arch.generic,
        "hparams": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(spec.hparams).items()
        },
        "n_params": spec.n_params,
        "nbytes": spec.weights_nbytes,
        "nbytes_by_role": dict(totals),
        "tied_output": spec.tied_output,
        "unloaded_nbytes": sum(t.nbytes for t in spec.unloaded),
        "layers": layer_rows(spec),
        "tensors": [
            {
                "name": t.name,
                "shape": list(t.shape),
                "type": t.qtype.name,
                "nbytes": t.nbytes,
                "layer": t.layer,
                "role": t.role,
            }
            for t in spec.tensors
        ],
    }
