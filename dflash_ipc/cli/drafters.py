"""What is done with a trained drafter: `eval` (speculative decoding against the target), `export` (for a
serving engine) and `export-untrained` (eval's untrained floor)."""

from __future__ import annotations

import json
import sys

import click

from dflash_ipc.cli.common import check_device_option, load_or_exit
from dflash_ipc.cli.options import choice_option, config_option, int_option, json_option, set_option
from dflash_ipc.eval.prompts import HUMANEVAL_AS, MT_BENCH_TURNS


@click.command("eval")
@config_option(help="Run configuration (TOML): its target, tokenizer and drafter settings.")
@click.option(
    "--drafter",
    "drafter_dir",
    required=True,
    type=click.Path(file_okay=False, exists=True),
    help="An exported drafter (export/drafter: config.json + model.safetensors).",
)
@click.option(
    "--prompts",
    "prompts_path",
    default=None,
    help="Prompts file (JSONL, .jsonl.gz, Parquet, saved dataset; chat, MT-Bench, HumanEval, GSM8K, Alpaca or plain "
    "prompt records, by their fields) or `humaneval` (needs the [bench] extra); default: data.paths.",
)
@click.option(
    "--suite",
    default=None,
    help="Comma-separated prompt sets (PATH, NAME=PATH or humaneval), decoded by the same processes: one table, one row per set.",
)
@int_option("--n", minimum=1, default=16, help="Prompts to decode (per set).")
@int_option("--max-new", minimum=1, default=128, help="New tokens per prompt.")
@click.option("--block-size", type=click.IntRange(0), default=0, help="Block size (1..the drafter's; default: the drafter's).")
@choice_option(
    "--dtype",
    choices=("float32", "bfloat16"),
    help="Target and drafter dtype. float32 keeps the lossless check exact: bf16 flips near-ties between "
    "a block verification and one-token steps.",
)
@click.option("--target-device", default=None, help="Default: topology.targets[0]; a comma-separated list spreads the workers.")
@click.option("--drafter-device", default=None, help="Default: topology.drafters[0] (several target devices: each worker's own).")
@int_option("--workers", minimum=1, default=1, help="Decoding processes per target device.")
@int_option("--speed-prompts", minimum=1, default=4, help="With workers: prompts per set timed alone.")
@choice_option(
    "--humaneval-as",
    choices=HUMANEVAL_AS,
    help="HumanEval prompts as a user turn asking for the solution (chat template, as DFlash reports it) or as raw code to continue.",
)
@choice_option(
    "--mt-bench-turns",
    choices=MT_BENCH_TURNS,
    help="MT-Bench records: the first turn, or every turn after the target's own answers to the turns before it.",
)
@click.option(
    "--target-quantization",
    type=click.Choice(["none", "fp8"]),
    default=None,
    help="The target's linear layers (default: target.quantization). fp8 needs --dtype bfloat16 on a CUDA GPU >= 8.9.",
)
@click.option(
    "--temperature",
    type=click.FloatRange(0),
    default=0.0,
    show_default=True,
    help="0: greedy, lossless token for token. > 0: speculative sampling (drafts sampled from the drafter at T, accepted "
    "with min(1, p/q), residual resampling), against plain sampling; lossless in distribution.",
)
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True, help="Nucleus, applied to p and q.")
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed (each prompt's draws depend on it and its place only).")
@set_option()
@json_option()
def eval_cmd(config_path, drafter_dir, prompts_path, suite, set_values, as_json, **options) -> None:
    """DFlash speculative decoding with an exported drafter: tau, acceptance, speed, lossless (per set with --suite)."""
    from dflash_ipc.eval.prompts import set_name
    from dflash_ipc.eval.run import format_suite_table, run_eval, run_suite

    if suite and prompts_path:
        raise click.UsageError("--suite and --prompts are exclusive: put the file in the suite")
    cfg = load_or_exit(config_path, set_values)
    target_device, drafter_device = options["target_device"], options["drafter_device"]
    check_device_option("--target-device", target_device, cfg.topology.targets[0], f"topology.targets[0] of {config_path}")
    if drafter_device or len([d for d in (target_device or "").split(",") if d.strip()]) <= 1:  # else: each target's own device
        check_device_option("--drafter-device", drafter_device, cfg.topology.drafters[0], f"topology.drafters[0] of {config_path}")
    if not any(d.strip().startswith("cuda") for d in (target_device or cfg.topology.targets[0]).split(",")):
        from dflash_ipc.target.fast_path import quiet_kernel_advice_on_cpu

        quiet_kernel_advice_on_cpu()

    def echo(line: str) -> None:
        click.echo(line, err=True)

    try:
        if suite:
            sets = [set_name(entry) for entry in suite.split(",") if entry.strip()]
            report = run_suite(cfg, drafter_dir, sets, echo=echo, **options)
            click.echo(format_suite_table(report), err=as_json)
            ok = all(r["lossless"] is not False for r in report["sets"].values())
        else:
            report = run_eval(cfg, drafter_dir, prompts_path=prompts_path, echo=echo, **options)
            ok = report["lossless"] is not False
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if as_json or not suite:
        click.echo(json.dumps(report) if as_json else json.dumps(report, indent=2))
    sys.exit(0 if ok else 1)


@click.command("export")
@click.option("--from", "source", required=True, type=click.Path(file_okay=False), help="A run directory, or one checkpoints/step-N.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the export (files 0644).")
@choice_option("--for", "client", choices=("all", "vllm", "sglang", "zlab"), help="Serving client ('all': one layout all read).")
@click.option("--device", default="cpu", show_default=True, help="Where to rebuild the drafter (the target's embedding and head are read).")
@json_option()
def export_cmd(source: str, out_dir: str, client: str, device: str, as_json: bool) -> None:
    """Export a run's newest complete checkpoint for a serving engine; print the command that serves it."""
    from dflash_ipc.drafter.export.from_checkpoint import export_checkpoint

    check_device_option("--device", device, "cpu", "cpu")
    try:
        res = export_checkpoint(source, out_dir, client, device)
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(res.to_json()))
        return
    for note in res.notes:
        click.echo(f"note: {note}", err=True)
    click.echo(f"exported step {res.step} ({res.checkpoint}) for {client} -> {res.out}\n{res.drafter_tau_line}\n")
    for cmd in res.commands.values():
        click.echo(cmd + "\n")


@click.command("export-untrained")
@config_option(help="Run configuration (TOML): the drafter to build and the target it reads.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for config.json + model.safetensors.")
@click.option("--device", default="cpu", show_default=True, help="Where to build it (the target's embedding and LM head are read).")
@set_option()
def export_untrained_cmd(config_path: str, out_dir: str, device: str, set_values: tuple[str, ...]) -> None:
    """Export a freshly initialised drafter (as `up` starts it) in the trained export's layout: eval's untrained floor."""
    from pathlib import Path

    from dflash_ipc.drafter.export.untrained import export_untrained

    cfg = load_or_exit(config_path, set_values)
    check_device_option("--device", device, "cpu", "cpu")
    try:
        out = export_untrained(cfg, Path(out_dir), device)
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(str(out))
