"""Decode ubatches as CUDA graphs: a tier whose work is all on the device and whose KV is
resident is captured once per (tier, tokens), its streamed-weight copies included, after one
eager ubatch compiled its kernels, and then replayed with one launch per token.

The capture issues the tier's schedule (`issue`) on the first device's raw streams, the copy
stream forked from and joined back into the compute stream's capture, with the attention over
every cell (EMPTY ones masked: a replay runs with other cells in use) and the head's last row.
"""

from __future__ import annotations

from . import counts
from .cuda_device import simulated
from .cuda_ubatch import CudaUbatch
from .issue import issue


class DecodeGraphs:
    def __init__(self, engine):
        self.e = engine
        self.graphs: dict[tuple[int, int], object] = {}  # (tier, tokens) -> captured decode
        self.nodes: dict[tuple[int, int], int | None] = {}
        self.ran_eagerly: set[tuple[int, int]] = set()
        self.enabled = not simulated()

    def replays(self, tier, st) -> bool:
        """Whether this ubatch runs as a graph: a decode ubatch whose work is all on the device,
        its KV resident, whose kernels an eager run compiled."""
        e = self.e
        return (
            self.enabled
            and (tier.tier, st.tokens.size) in self.ran_eagerly
            and counts.graphable(tier.parts, tier.place, st.tokens.size)
            and not st.all_logits
            and list(st.logit_rows) == [st.tokens.size - 1]  # the head's one captured row
            and not e.requested
            and e.trace_events is None  # a traced run is timed op by op, eagerly
        )

    def launch(self, tier, st) -> None:
        key = (tier.tier, st.tokens.size)
        if key not in self.graphs:
            with counts.counting(None):  # the capture's kernels run in the replays
                self.graphs[key] = self._capture(tier, st)
        self.graphs[key].launch(self.e.devices[0].streams[0])
        self.e.counter.launches += 1

    def _capture(self, tier, st):
        from . import driver

        compute, copy = self.e.devices[0].streams
        # Numba frees what it holds pending in batches; a cuMemFree inside a capture invalidates it
        with self.e.cuda.current_context().deallocations.disable():
            compute.begin_capture()
            fork, join = driver.Event(timing=False), driver.Event(timing=False)
            fork.record(compute)
            copy.wait(fork)  # the copy stream joins the capture
            issue(tier.schedule, CudaUbatch(self.e, tier, st, capturing=True))
            join.record(copy)
            compute.wait(join)
            graph = compute.end_capture()
        self.nodes[(tier.tier, st.tokens.size)] = graph.node_count()
        return graph

    def report(self, launch_seconds: float) -> list[str]:
        out = []
        for (tier, n), nodes in sorted(self.nodes.items()):
            out.append(f"tier {tier}, {n} token(s): 1 CUDA graph launch per ubatch replays {nodes} "
                       f"kernels and copies, which at the profile's {launch_seconds * 1e6:.1f} us "
                       f"per launch would cost {nodes * launch_seconds * 1e3:.2f} ms")  # fmt: skip
        if not self.nodes:
            out.append("no tier ran as a CUDA graph (a decode tier qualifies when all its work is "
                       "on the GPU and its KV resident)")  # fmt: skip
        return out

    def close(self) -> None:
        for graph in self.graphs.values():
            graph.close()
        self.graphs = {}
