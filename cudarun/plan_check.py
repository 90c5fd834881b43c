"""Whether this runtime can execute a plan on a model: one line that says what to do when not."""

from __future__ import annotations

from refengine.errors import UserError
from refengine.spec import ModelSpec
from solver.cost import CPU, ROUTED
from solver.groups import tensor_groups
from solver.plan import fingerprint_hash, placements_from_json
from solver.targets import traits


class PlanError(UserError):
    pass


def check_plan(plan: dict, spec: ModelSpec) -> None:
    """One line for a plan this runtime cannot execute on this model."""
    fp = plan["fingerprint"]
    if fp["model"] != spec.name or fp["model_nbytes"] != spec.file_nbytes:
        raise PlanError(
            f"the plan was solved for {fp['model']} ({fp['model_nbytes']} B), not this file "
            f"{spec.name} ({spec.file_nbytes} B); solve again for it"
        )
    if fingerprint_hash(fp) != plan.get("fingerprint_hash"):
        raise PlanError("the plan's fingerprint does not match its contents; solve again")
    if not traits(plan["target"]).our_runtime:
        raise PlanError(f"this plan targets {plan['target']}; the runtime executes `--target "
                        "refengine` plans: solve with that")  # fmt: skip
    if fp["kv_type"] != "f16":
        raise PlanError("the runtime keeps an f16 KV cache; solve with --kv-type f16")
    if plan["split_mode"] == "tensor":
        return
    for t, place in placements_from_json(plan, spec).items():
        routed = {}
        for g in tensor_groups(spec):
            loc = place.groups[g.name]
            if loc.kind == ROUTED:
                routed.setdefault(g.layer, set()).add((loc.cache, loc.prefetch))
                attn = place.groups[f"blk.{g.layer}.attn"]
                if loc.prefetch and attn.kind == CPU:
                    raise PlanError(f"tier {t}: {g.name} prefetches, but its layer's attention "
                                    "is on the CPU; solve again")  # fmt: skip
        if any(len(v) > 1 for v in routed.values()):
            raise PlanError(f"tier {t}: a layer's routed stacks must share one expert cache; "
                            "solve again")  # fmt: skip


def check_users(plan: dict, n_seq: int) -> None:
    """One line when a plan's KV (its sliding-window cells, its logit rows) was sized for fewer
    sequences than asked for."""
    users = plan["fingerprint"]["users"]
    if n_seq > users:
        raise PlanError(f"the plan was solved for {users} user(s), not {n_seq} sequences; solve "
                        f"again with --users {n_seq}")  # fmt: skip
