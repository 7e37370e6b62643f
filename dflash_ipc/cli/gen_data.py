"""`dflash-ipc gen-data`: the target writes the answers a drafter trains on (self-distillation data)."""

from __future__ import annotations

import json
import sys

import click

from dflash_ipc.cli.common import check_device_option, load_or_exit
from dflash_ipc.cli.options import choice_option, config_option, int_option, json_option, set_option


@click.command("gen-data")
@config_option(help="Run configuration (TOML): the target that writes the answers.")
@click.option(
    "--out", "out_path", required=True, type=click.Path(dir_okay=False), help="Output JSONL (appended to; held-out split beside it)."
)
@click.option(
    "--prompts",
    "prompts_path",
    default=None,
    help="Chat records (JSONL, Parquet, saved dataset), or synth:N (N requests the target writes itself, [synth]); default: data.paths.",
)
@click.option(
    "--holdout-fraction",
    type=click.FloatRange(0, 1, max_open=True),
    default=0.0,
    show_default=True,
    help="Share of ids (by hash) written to OUT.holdout.jsonl instead, for eval.",
)
@int_option(
    "--batch-size",
    minimum=1,
    default=16,
    help="Prompts per generate call. On a GPU the batch sets the rate (a small target's decode step costs about the same at "
    "any batch): as large as the KV cache fits, e.g. 2048 for SmolLM2-135M on one H200 (docs/EVAL.md).",
)
@int_option("--max-new", minimum=1, default=512, help="New tokens per answer.")
@click.option("--temperature", type=click.FloatRange(0), default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True)
@int_option("--limit", minimum=0, default=0, help="Use only the first N prompts (0: all).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="Default: topology.targets[0].")
@choice_option(
    "--decode",
    choices=("dynamic", "static", "compiled"),
    help="KV cache of generate: dynamic, static, or static with a torch.compile'd decode step (CUDA graphs on a GPU).",
)
@set_option()
@json_option()
def gen_data_cmd(config_path, out_path, prompts_path, device, set_values, as_json, **options):
    """The target answers the first user turn of every chat record (resumable self-distillation data)."""
    from pathlib import Path

    from dflash_ipc.datagen.gen import GenOptions, run_gen_data
    from dflash_ipc.datagen.synth import parse_synth_spec, run_synth_gen_data

    cfg = load_or_exit(config_path, set_values)
    check_device_option("--device", device, cfg.topology.targets[0], f"topology.targets[0] of {config_path}")
    opts = GenOptions(**options)  # every other option is a field of GenOptions, by name

    def echo(line: str) -> None:
        click.echo(line, err=True)

    try:
        n_synth = parse_synth_spec(prompts_path)
        if n_synth is not None:
            result = run_synth_gen_data(cfg, Path(out_path), opts, n_synth, device=device, echo=echo)
        else:
            result = run_gen_data(cfg, Path(out_path), opts, prompts_path=prompts_path, device=device, echo=echo)
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))
