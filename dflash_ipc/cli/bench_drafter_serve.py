"""``dflash-ipc bench drafter-serve``: the command line of :mod:`dflash_ipc.bench.drafter_serve` (imports torch only when run)."""

from __future__ import annotations

import json

import click

from dflash_ipc.bench.drafter_serve import ServeShape, run_drafter_serve_bench
from dflash_ipc.cli.options import int_option, json_option


@click.command("drafter-serve")
@click.option("--batches", default="1,32", show_default=True, help="Comma-separated batch sizes (sequences drafted at once).")
@click.option("--device", default="cuda", show_default=True)
@int_option("--steps", minimum=1, default=20, help="Timed steps per cell (median).")
@int_option("--warmup", minimum=0, default=5, help="Untimed steps per cell.")
@click.option("--shape", "overrides", multiple=True, help="FIELD=INT of the drafter's shape (ServeShape), e.g. vocab_size=1024.")
@json_option()
def drafter_serve_cmd(batches, device, steps, warmup, overrides, as_json):
    """Time one served drafter step (one block), reduced head vs the target's whole head."""
    fields = {}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in ServeShape.__dataclass_fields__ or not value.lstrip("-").isdigit():
            raise click.BadParameter(
                f"{item!r}: FIELD=INT, FIELD one of {', '.join(ServeShape.__dataclass_fields__)}", param_hint="--shape"
            )
        fields[key] = int(value)
    try:
        shape = ServeShape(**fields)
        sizes = [int(x) for x in batches.split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    result = run_drafter_serve_bench(shape, sizes, device=device, steps=steps, warmup=warmup)
    if as_json:
        click.echo(json.dumps(result))
        return
    for r in result["rows"]:
        click.echo(f"batch {r['batch']:>3}  {r['head']:<16} {r['ms']:>10.3f} ms  x{r['vs_whole']:.3f} of whole")
    agree = "the same tokens" if result["reduced_routes_agree"] else "DIFFERENT tokens (a bug: they must agree)"
    click.echo(f"reduced and reduced-scatter drafted {agree}")
