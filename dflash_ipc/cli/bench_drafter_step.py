"""``dflash-ipc bench drafter-step``: the command line of :mod:`dflash_ipc.bench.drafter_step` (imports torch only when run)."""

from __future__ import annotations

import json
import sys

import click

from dflash_ipc.cli.options import config_option, int_option, json_option, set_option
from dflash_ipc.config import ConfigError


@click.command("drafter-step")
@config_option(help="Run configuration (TOML): its drafter, target and data.")
@click.option("--variants", default="base", show_default=True, help="Comma-separated; the first is the baseline (bench/drafter_step.py).")
@int_option("--steps", minimum=1, default=10, help="Timed steps per variant.")
@int_option("--batches", "n_batches", minimum=1, default=3, help="Synthetic batches (each its own shape).")
@click.option("--tokens", type=click.IntRange(0), default=0, help="Tokens per batch (0: data.token_budget).")
@click.option("--doc-len", type=click.IntRange(0), default=0, help="Mean document length (0: data.max_seq_len / 4).")
@click.option("--supervised", type=click.FloatRange(0.05, 1.0), default=0.7, show_default=True, help="Loss-masked share of each document.")
@click.option("--random-target", is_flag=True, help="A random target's shapes and heads (--target-shape) instead of the config's target.")
@click.option(
    "--target-shape",
    type=click.Choice(["smollm2-135m", "qwen3-8b", "qwen3.6-27b"]),
    default="smollm2-135m",
    show_default=True,
    help="With --random-target: whose widths.",
)
@click.option("--profile", is_flag=True, help="One more step per variant under torch.profiler, by op class.")
@click.option("--device", default="", help="Default: topology.drafters[0].")
@click.option(
    "--out", "out_path", default=None, type=click.Path(dir_okay=False), help="Write the result as JSON here (after each variant)."
)
@set_option()
@json_option()
def drafter_step_cmd(config_path, variants, out_path, set_values, as_json, **options):
    """Time the drafter's training step (forward, loss, backward, optimizer) in variants of its speed options."""
    from dflash_ipc.bench.drafter_step import run_drafter_step_bench, variant_config
    from dflash_ipc.config import load_config

    try:
        cfg = load_config(config_path, sets=set_values)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    names = [v.strip() for v in variants.split(",") if v.strip()]
    for name in names:  # a misspelt or invalid variant is refused before any model is built
        try:
            variant_config(cfg, name)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--variants") from None

    def save(result: dict) -> None:
        if out_path:
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)

    # the other options are its keywords, by name
    result = run_drafter_step_bench(config_path, names, save=save, sets=set_values, **options)
    click.echo(json.dumps(result) if as_json else json.dumps(result["ratios"], indent=1))
