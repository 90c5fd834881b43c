"""`refengine synth`: a random-weight GGUF of any supported architecture and size
(`refengine.synthetic`)."""

from __future__ import annotations

from pathlib import Path

import click

from .base import cli


@cli.command()
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--preset", help="Shape of a real model (e.g. smollm2-135m, gemma3-270m).")
@click.option("--arch", default="llama", show_default=True)
@click.option("--layers", "n_layer", type=int)
@click.option("--embd", "n_embd", type=int)
@click.option("--ff", "n_ff", type=int)
@click.option("--heads", "n_head", type=int)
@click.option("--kv-heads", "n_head_kv", type=int)
@click.option("--head-dim", type=int)
@click.option("--vocab", "n_vocab", type=int)
@click.option("--experts", "n_expert", type=int)
@click.option("--experts-used", "n_expert_used", type=int)
@click.option("--expert-ff", "n_ff_exp", type=int)
@click.option("--shared-experts", "n_expert_shared", type=int, help="glm4moe")
@click.option("--dense-lead", "n_dense_lead", type=int, help="Leading dense layers (glm4moe).")
@click.option("--nextn", "n_nextn", type=int, help="NextN blocks, not loaded (glm4moe).")
@click.option("--rope-dim", "n_rot", type=int, help="Dimensions RoPE rotates (head size).")
@click.option("--head-dim-v", type=int, help="Value head size (head size).")
@click.option("--q-lora", "q_lora_rank", type=int, help="Q's rank (deepseek2).")
@click.option("--kv-lora", "kv_lora_rank", type=int, help="The cached latent's rank (deepseek2).")
@click.option("--shared-ff", "n_ff_shexp", type=int, help="Gated shared expert's width.")
@click.option("--full-attention-interval", type=int, help="qwen35moe: every Nth layer attends.")
@click.option("--ssm-state", type=int, help="Delta net head size (qwen35moe).")
@click.option("--ssm-groups", type=int, help="Delta net key heads (qwen35moe).")
@click.option("--ssm-v-heads", type=int, help="Delta net value heads (qwen35moe).")
@click.option("--moe-every", type=int, help="llama4: every Nth layer routes.")
@click.option("--rope-freqs", is_flag=True, default=None, help="llama4: write rope_freqs.")
@click.option("--swa", "n_swa", type=int, help="Sliding window (gemma3).")
@click.option("--qtype", help="Type of the matrices (Q4_K, Q8_0, F16, ...).")
@click.option("--seed", type=int)
def synth(out: Path, preset: str | None, arch: str, **sizes) -> None:
    """Write a random-weight GGUF of any supported architecture, size and quant type."""
    from ..synthetic import config_for, write_synthetic

    changes = {k: v for k, v in sizes.items() if v is not None}
    path = write_synthetic(out, config_for(preset, arch, **changes))
    click.echo(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")
