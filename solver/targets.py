"""What differs between the systems a plan can be for, said once: our runtime (`refengine`),
llama.cpp (`llamacpp`, whose flags a plan exports) and pshard's runtime as its authors measured it
(`pshard`, for predicting their results only). Code asks a trait, never a target's name."""

from __future__ import annotations

from dataclasses import dataclass

from refengine.errors import UserError


@dataclass(frozen=True)
class TargetTraits:
    name: str
    our_runtime: bool  # executed by refengine's own runtime (memory maps, plan checks)
    llamacpp_flags: bool  # exported as llama.cpp flags, checked by `verify`, drives RPC servers
    per_tier: bool  # a placement per tier (llama.cpp: one for every ubatch)
    streams: bool  # weights streamed into a scratch ring, routed experts copied by their router
    overlaps_copies: bool  # copies run under compute (prefetch)
    pageable_copies: bool  # copies from pageable host memory (pshard as measured)
    op_offload: bool  # CPU-held weights computed on the GPU from 32 tokens on (ggml-backend)
    ggml_cpu: bool  # CPU-held parts on ggml's CPU kernels: the profile's llamacpp_* rows
    ggml_memory: bool  # llama.cpp's memory terms (compute buffer, pipeline copies), not our arena
    shares_one_cache: bool  # users share one KV cache (-np N -kvu)
    panel_launches: bool  # a product past the matvec tokens launches once per fp16 panel
    embd_on_cpu: bool  # the token embedding always stays on the CPU


TARGETS = {t.name: t for t in (
    TargetTraits("refengine", our_runtime=True, llamacpp_flags=False, per_tier=True, streams=True,
                 overlaps_copies=True, pageable_copies=False, op_offload=False, ggml_cpu=False,
                 ggml_memory=False, shares_one_cache=False, panel_launches=True,
                 embd_on_cpu=False),
    TargetTraits("llamacpp", our_runtime=False, llamacpp_flags=True, per_tier=False,
                 streams=False, overlaps_copies=False, pageable_copies=False, op_offload=True,
                 ggml_cpu=True, ggml_memory=True, shares_one_cache=True, panel_launches=False,
                 embd_on_cpu=True),
    TargetTraits("pshard", our_runtime=False, llamacpp_flags=False, per_tier=True, streams=True,
                 overlaps_copies=True, pageable_copies=True, op_offload=False, ggml_cpu=False,
                 ggml_memory=False, shares_one_cache=False, panel_launches=False,
                 embd_on_cpu=False),
)}  # fmt: skip


def traits(target: str) -> TargetTraits:
    try:
        return TARGETS[target]
    except KeyError:
        raise UserError(f"unknown target {target!r} (known: {', '.join(TARGETS)})") from None
