"""Tier switches: whatever the two memory maps, the steps leave every kept region's content where
the new map says, downloading the KV that leaves the device and uploading what arrives."""

import zlib

import numpy as np
from hypothesis import given, settings, strategies as st

from cudarun.switch import Step, apply_steps, switch_steps
from solver.regions import Region, RegionId, RegionKind

NAMES = [RegionId(RegionKind.WEIGHTS, f"g{i}") for i in range(5)] + [
    RegionId(RegionKind.KV, i) for i in range(4)
]
SIZES = {n: 8 + 4 * i for i, n in enumerate(NAMES)}
ARENA = sum(SIZES.values()) + 64


def content(rid):
    rng = np.random.default_rng(zlib.crc32(str(rid).encode()))
    return rng.integers(0, 256, SIZES[rid], np.uint8)


def layout(names):
    """Weights packed from the left, then a scratch region, KV packed from the right."""
    regions, offset, end = [], 0, ARENA
    for n in names:
        if n.kind is RegionKind.WEIGHTS:
            regions.append(Region(n, offset, SIZES[n]))
            offset += SIZES[n]
    regions.append(Region(RegionId(RegionKind.SCRATCH, 0), offset, 16))
    for n in names:
        if n.kind is RegionKind.KV:
            end -= SIZES[n]
            regions.append(Region(n, end, SIZES[n]))
    return regions


@settings(max_examples=200, deadline=None)
@given(st.permutations(NAMES), st.permutations(NAMES), st.integers(0, 9), st.integers(0, 9))
def test_every_kept_region_arrives_intact(order_a, order_b, keep_a, keep_b):
    before, after = layout(order_a[:keep_a]), layout(order_b[:keep_b])
    arena = np.full(ARENA, 0xAB, np.uint8)
    for r in before:
        if r.kind is not RegionKind.SCRATCH:
            arena[r.offset_bytes : r.offset_bytes + r.nbytes] = content(r.id)
    # the host holds every weight (pinned copies) and the KV of layers not on the device
    host = {n: content(n) for n in NAMES
            if n.kind is RegionKind.WEIGHTS or n not in order_a[:keep_a]}  # fmt: skip
    steps = switch_steps(before, after)
    apply_steps(arena, steps, host)
    for r in after:
        if r.kind is not RegionKind.SCRATCH:
            got = arena[r.offset_bytes : r.offset_bytes + r.nbytes]
            assert np.array_equal(got, content(r.id)), (r.id, steps)
    for r in before:  # KV leaving the device is on the host afterwards
        if r.kind is RegionKind.KV and r.id not in {a.id for a in after}:
            assert np.array_equal(host[r.id], content(r.id))


def test_a_swap_goes_through_the_host():
    kv0, kv1 = RegionId(RegionKind.KV, 0), RegionId(RegionKind.KV, 1)
    before = [Region(kv0, 0, 8), Region(kv1, 8, 8)]
    after = [Region(kv0, 8, 8), Region(kv1, 0, 8)]
    steps = switch_steps(before, after)
    assert [s.kind for s in steps] == ["download", "move", "upload"]
    assert steps[1] == Step("move", kv1, 8, 0, 8)


def test_regions_in_place_cost_nothing():
    same = [Region(RegionId.parse(n), o, 8) for n, o in (("weights:a", 0), ("scratch:0", 8),
                                                           ("kv:0", 24))]  # fmt: skip
    assert switch_steps(same, same) == []
