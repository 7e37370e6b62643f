"""``dflash-ipc bench gen-decode``: the command line of :mod:`dflash_ipc.bench.gen_decode` (imports torch only when run)."""

from __future__ import annotations

import json

import click

from dflash_ipc.cli.options import int_option, json_option


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated whole numbers") from None


@click.command("gen-decode")
@click.option("--model", default="", help="A Hugging Face model folder; without it, SmolLM2-135M's shapes with random weights.")
@int_option("--layers", minimum=1, default=30, help="Layers of the random model.")
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True)
@click.option("--modes", default="dynamic,static,compiled", show_default=True, help="gen-data --decode modes; dynamic is the baseline.")
@click.option("--batch-sizes", default="512", show_default=True, help="Comma-separated.")
@int_option("--max-new", minimum=1, default=64, help="Tokens decoded per row (no stop token: every row runs them all).")
@click.option("--prompt-len", default="24,96", show_default=True, help="MIN,MAX prompt tokens.")
@int_option("--batches", minimum=1, default=2, help="Timed batches per (mode, batch size).")
@click.option("--budget-s", type=click.FloatRange(0, min_open=True), default=None, help="Also pick the mode for a gen-data run this long.")
@int_option("--graphs", minimum=1, default=4, help="Compiled graphs a gen-data process pays (with --budget-s).")
@click.option("--min-gain", type=float, default=1.15, show_default=True, help="Compiled must answer this many times dynamic's prompts.")
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False), help="Write the result as JSON here (after each row).")
@json_option()
def gen_decode_cmd(
    model, layers, device, dtype, modes, batch_sizes, max_new, prompt_len, batches, budget_s, graphs, min_gain, out_path, as_json
):
    """Time gen-data's decoding per KV-cache mode (dynamic, static, compiled) and batch size, against dynamic."""
    from dflash_ipc.bench.gen_decode import GenDecodeArgs, pick_decode, run_gen_decode_bench

    lens = _ints(prompt_len)
    try:
        args = GenDecodeArgs(model, layers, device, dtype, tuple(m.strip() for m in modes.split(",") if m.strip()), _ints(batch_sizes),
                             max_new, (lens + (0, 0))[:2], batches)  # fmt: skip
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    result: dict = {"rows": []}

    def on_row(row: dict) -> None:
        result["rows"].append(row)
        click.echo(json.dumps(row), err=as_json)
        if out_path:  # after every row: a run stopped at its timeout keeps what it measured
            with open(out_path, "w") as f:
                json.dump(result, f, indent=1)

    result = run_gen_decode_bench(args, on_row)
    if budget_s is not None:
        picks = {bs: pick_decode(result["rows"], bs, budget_s, graphs, min_gain) for bs in args.batch_sizes}
        result["pick"] = {str(bs): {"mode": mode, "reason": why} for bs, (mode, why) in picks.items()}
        for _, why in picks.values():
            click.echo(f"pick: {why}", err=as_json)
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    if as_json:
        click.echo(json.dumps(result))
