import re

from refengine.synthetic import SyntheticConfig, spec_from_hparams
from solver.cost import PINNED, STREAMED, Loc, TierPlacement, Workload
from solver.groups import tensor_groups
from solver.registry import fingerprint, parse_registry, registry_text
from solver.strategies import STRATEGIES, Problem

from .test_strategies import PROFILE


def test_fingerprint_matches_pshards_test_vector():
    # docs/pshard.md: values (4096, 1, 8, -1, 1, 1, 123456789, -1) -> 0xebbb9f302b757df5
    assert fingerprint([4096, 1, 8, -1, 1, 1, 123456789, -1]) == 0xEBBB9F302B757DF5


def test_registry_parses_back_to_the_plan():
    spec = spec_from_hparams(
        SyntheticConfig(
            "llama",
            n_layer=12,
            n_embd=2048,
            n_ff=8192,
            n_head=16,
            n_head_kv=4,
            head_dim=128,
            n_vocab=32000,
            qtype="Q4_K",
        )
    )
    w = Workload(n_ctx=4096, prompt_tokens=3000, gen_tokens=100)
    plan = STRATEGIES["layerpin-layerstream"](Problem(spec, PROFILE, w, (1, 512), 1 << 30))
    text = registry_text(
        spec,
        w,
        8,
        1 << 30,
        {t: (p, 12.5, 900 << 20) for t, p in plan.items()},
        "layerpin-layerstream",
    )
    reg = parse_registry(text)
    assert text.startswith("# Generated file. Edit at your own risk.\n")
    assert reg["budget_mib"] == 1024 and reg["cache_ubatch"] == 512
    values = [4096, 1, 8, 1, 1, 1, spec.file_nbytes, -1]
    assert reg["fingerprint"] == fingerprint(values)
    groups = tensor_groups(spec)
    for tier, place in plan.items():
        got = reg["tiers"][tier]
        assert got["strategy"] == "GPUONLY_LAYERPIN_LAYERSTREAM" and got["tps"] == "12.50"
        for g in groups:
            for name in g.tensors:
                ident = next(i for pat, i in got["ot"].items() if re.search(pat, name))
                loc = place.groups[g.name]
                if loc == Loc(PINNED):
                    assert ident == 0
                elif loc == Loc(STREAMED):
                    assert ident == 1 + (g.layer or 0) % 2
                else:
                    assert ident == 3
        assert int(got["n_pinned"]) == sum(
            1
            for il in range(12)
            if all(place.groups[g.name] == Loc(PINNED) for g in groups if g.layer == il)
        )


def test_partial_boundary_layers_and_disabled_variants_are_written_as_pshard_does():
    spec = spec_from_hparams(
        SyntheticConfig("llama", n_layer=4, n_embd=256, n_ff=1024, n_head=4, n_head_kv=2)
    )
    w = Workload(n_ctx=1024, prompt_tokens=500, gen_tokens=10)
    groups = tensor_groups(spec)
    for keep, want in (
        ({"attn"}, "ATTN"),
        ({"attn", "ffn_up"}, "UP"),
        ({"attn", "ffn_up", "ffn_gate"}, "GATE"),
        ({"attn", "ffn_gate"}, "NONE"),  # not a partial layer pshard writes
    ):
        locs = {g.name: Loc(PINNED) if (g.layer or 0) < 1 else Loc(STREAMED) for g in groups}
        for g in groups:
            if g.layer == 1 and g.name.split(".", 2)[2] in keep:
                locs[g.name] = Loc(PINNED)
        place = TierPlacement(locs, {il: Loc(PINNED) for il in range(4)})
        reg = parse_registry(registry_text(spec, w, 8, 1 << 30, {512: (place, 1.0, 1)}, "x"))
        assert reg["tiers"][512]["overflow"] == want and reg["tiers"][512]["n_pinned"] == "1"
    text = registry_text(spec, w, 8, 1 << 30, {512: (place, 1.0, 300 << 20)}, "x", True)
    reg = parse_registry(text)
    assert reg["disabled"] and reg["baseline_vram_mib"] == 300.0 and reg["cache_ubatch"] == 512
    assert not reg["tiers"]
