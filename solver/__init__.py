"""The planner: hardware profiles, the cost model, the OR-Tools placement program, plans and
their exports. Built by the planner issue on top of `refengine.spec.ModelSpec`."""
