"""``dflash-ipc bench target-forward``: the command line of :mod:`dflash_ipc.bench.target_forward` (imports torch only when run)."""

from __future__ import annotations

import sys

import click

from dflash_ipc.cli.options import int_option, set_option
from dflash_ipc.config import ConfigError, load_config


@click.command("target-forward")
@click.option("--config", "config_path", default="", help="A dflash-ipc config (its target and data).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False), help="JSON written here (rewritten as it goes).")
@click.option("--layers", type=click.IntRange(0), default=0, help="Keep the first N decoder layers of a spec target (0: all).")
@int_option("--batches", "n_batches", minimum=3, default=8)
@int_option("--warmup-passes", minimum=1, default=1, help="Untimed passes over every batch before each variant's timed pass.")
@int_option("--agree-batches", minimum=0, default=2)
@click.option("--profile/--no-profile", default=False)
@click.option("--fp8/--no-fp8", default=True)
@click.option("--fuse", is_flag=True, help="Also: packed with the norms and SwiGLU (and FP8 quantizer) fused (target/fused.py).")
@click.option("--peak-tflops", type=float, default=790.0, show_default=True)
@click.option("--device", default="", help="Default: topology.targets[0].")
@click.option("--cache-dir", default="", help="Tokenized corpus cache (default: a folder under the temp dir).")
@click.option("--checkpoint", default="", help="Instead: FP8 vs bf16 agreement on this local checkpoint's real weights.")
@click.option(
    "--fp8-unmerged/--no-fp8-unmerged",
    default=True,
    help="Also FP8 with the sibling projections unmerged (each quantizes its input, its own GEMM): packed, and fused with --fuse.",
)
@click.option("--fp8-off-gpu", is_flag=True, hidden=True, help="Dry runs: FP8 through torch._scaled_mm on any device (CPU: slow).")
@set_option()
def target_forward_cmd(checkpoint: str, **options) -> None:
    """The target's forward alone in this process: padded vs packed, bf16 vs FP8, on the config's own batches."""
    if checkpoint:
        from dflash_ipc.bench.target_forward import checkpoint_agreement

        checkpoint_agreement(checkpoint, options["out_path"], options["device"] or "cuda:0")
        return
    if not options["config_path"]:
        raise click.UsageError("--config is needed (or --checkpoint)")
    try:  # refused before any model is built
        load_config(options["config_path"], sets=options["set_values"])
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    from dflash_ipc.bench.target_forward import run

    run(**options)  # every other option is a keyword of run, by name
