"""`dflash-ipc bench ...`: benchmarks that report ratios against a baseline measured in the same run
(transport rings, GPU rings, pipeline variants, family forwards here; drafter-step, gen-decode, drafter-serve and
target-forward in their own ``cli.bench_*`` modules)."""

from __future__ import annotations

import json
import sys

import click

from dflash_ipc.cli.bench_drafter_serve import drafter_serve_cmd
from dflash_ipc.cli.bench_drafter_step import drafter_step_cmd
from dflash_ipc.cli.bench_gen_decode import gen_decode_cmd
from dflash_ipc.cli.bench_target_forward import target_forward_cmd
from dflash_ipc.cli.common import check_device_option, load_or_exit
from dflash_ipc.cli.options import choice_option, config_option, int_option, json_option, set_option
from dflash_ipc.config import ConfigError, blame_sets
from dflash_ipc.config.transport import BACKENDS


@click.group()
def bench() -> None:
    """Benchmarks that report ratios against a baseline measured in the same run."""


for command in (drafter_step_cmd, gen_decode_cmd, drafter_serve_cmd, target_forward_cmd):
    bench.add_command(command)


@bench.command("transport")
@choice_option("--backend", choices=tuple(BACKENDS))
@click.option("--producers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--consumers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--slots", type=click.IntRange(2, 64), default=4, show_default=True)
@click.option("--slot-mib", type=click.FloatRange(0.004, 8192), default=64, show_default=True)
@click.option("--seconds", type=click.FloatRange(0.2, 3600), default=5, show_default=True)
@click.option("--slow-consumer", type=int, default=None, help="Consumer rank that sleeps per slot.")
@click.option("--slow-ms", type=float, default=None, help="Sleep per slot of the slow consumer (default: 4x a copy).")
@click.option("--producer-device", default=None, help="cpu, or cuda:N (default by backend).")
@click.option("--consumer-device", default=None, help="cpu, cuda:N, or 'same' (the producer's GPU).")
@click.option(
    "--max-outstanding",
    type=click.IntRange(1, 64),
    default=None,
    help="Credits per consumer (default: 2 on cpu-shm; 3 on GPU, so copies queue behind each other).",
)
@click.option(
    "--prefetch",
    type=click.IntRange(1, 16),
    default=None,
    help="Copied-out batches a consumer may hold beyond the one in use (default: 1 on cpu-shm, 2 on GPU).",
)
@json_option()
def bench_transport_cmd(
    backend,
    producers,
    consumers,
    slots,
    slot_mib,
    seconds,
    slow_consumer,
    slow_ms,
    producer_device,
    consumer_device,
    max_outstanding,
    prefetch,
    as_json,
):
    """Move real data through the slot rings between real processes; verify every slot."""
    from dflash_ipc.bench.transport import BenchArgs, run_transport_bench

    gpu = BACKENDS[backend].devices != "cpu"
    given = {
        "--producer-device": producer_device,
        "--consumer-device": consumer_device if consumer_device not in (None, "other", "same") else None,
    }
    producer_device = producer_device or ("cuda:0" if gpu else "cpu")
    if consumer_device in (None, "other"):
        consumer_device = "cuda:1" if gpu else "cpu"
    elif consumer_device == "same":
        consumer_device = producer_device
    if slow_consumer is not None and not 0 <= slow_consumer < consumers:
        raise click.BadParameter(f"must be a consumer rank in [0, {consumers})", param_hint="--slow-consumer")
    # Before a directory or process exists: a GPU backend on a machine without one is a one-line refusal.
    for option, device in (("--producer-device", producer_device), ("--consumer-device", consumer_device)):
        check_device_option(option, given[option], device, f"--backend {backend}")
    if gpu and not (producer_device.startswith("cuda:") or consumer_device.startswith("cuda:")):
        raise click.BadParameter(
            f"{backend} moves data from or to a CUDA device; give a cuda:N device, or --backend cpu-shm", param_hint="--backend"
        )
    if slow_ms is None:
        slow_ms = max(5.0, slot_mib / 64 * 40.0) if slow_consumer is not None else 0.0
    args = BenchArgs(
        backend=backend,
        producers=producers,
        consumers=consumers,
        slots=slots,
        slot_mib=slot_mib,
        seconds=seconds,
        slow_consumer=slow_consumer,
        slow_ms=slow_ms,
        producer_device=producer_device,
        consumer_device=consumer_device,
        # On GPU a slot's round trip (SlotFree, next SlotReady, verify) is as long as a
        # 256 MiB copy: with two credits the link idles between copies.
        max_outstanding=max_outstanding or (3 if gpu else 2),
        prefetch=prefetch or (2 if gpu else 1),
    )
    result = run_transport_bench(args, progress=lambda s: click.echo(s, err=as_json))
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k, v in result.items():
            click.echo(f"{k:>20}: {v}")
    sys.exit(0 if result["verified"] else 1)


@bench.command("gpu-ring")
@click.option("--out", "out_path", default=None, type=click.Path(dir_okay=False), help="Write the results as JSON here.")
@click.option("--quick", is_flag=True, help="Fewer iterations.")
@json_option()
def bench_gpu_ring_cmd(out_path: str | None, quick: bool, as_json: bool) -> None:
    """Reference copies, then cuda-ipc / host-pinned ring throughput and handoff between two processes (GPU 0 produces)."""
    from dflash_ipc.bench.gpu_suite import run_bench

    result = run_bench(quick=quick, progress=lambda s: click.echo(s, err=as_json))
    if out_path:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)
    if as_json:
        click.echo(json.dumps(result))


@bench.command("pipeline")
@config_option(help="Run configuration (TOML) every variant starts from.")
@int_option("--steps", minimum=3, default=8, help="Optimizer steps per pipeline variant.")
@click.option(
    "--variants",
    default="forward-only,cuda-ipc,host-pinned,depth-2,depth-8",
    show_default=True,
    help="Comma-separated, run in this order: forward-only, cuda-ipc, host-pinned, padded, depth-N, anchors-N, anchors-auto (the anchor "
    "budget follows the drafter's wait), warmup (a 4-layer cut that compiles part of what a cold machine "
    "needs); a pipeline variant times every forward, so name forward-only before it on a cold machine.",
)
@click.option("--peak-tflops", type=float, default=790.0, show_default=True, help="Peak for MFU (bf16 matmul measured on an H200).")
@click.option("--out", "out_path", default=None, help="Append each variant's result to this file (JSON lines) as soon as it is done.")
@set_option()
@json_option()
def bench_pipeline_cmd(
    config_path: str, steps: int, variants: str, peak_tflops: float, out_path: str | None, set_values: tuple[str, ...], as_json: bool
) -> None:
    """Run the pipeline in several variants (transport, ceiling, ring depth) and compare them."""
    from dflash_ipc.bench.pipeline import run_pipeline_bench, variant_overrides

    # This process is the supervisor of every variant and never imports torch: the model and
    # device checks run in the first variant's probe (runtime.probe), still before any process.
    load_or_exit(config_path, set_values, check_host=True)
    names = [v.strip() for v in variants.split(",") if v.strip()]
    for name in names:  # a misspelt variant is refused before any process starts
        try:
            variant_overrides(name, on_cuda=False)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--variants") from None

    def echo(line: str) -> None:
        click.echo(line, err=as_json)

    try:
        result = run_pipeline_bench(config_path, steps, names, peak_tflops, echo=echo, out_path=out_path, sets=set_values)
    except ConfigError as e:
        click.echo(f"error: {blame_sets(e, set_values)}", err=True)
        sys.exit(2)
    click.echo(json.dumps(result) if as_json else json.dumps(result, indent=2))


@bench.command("family-forward")
@click.option("--shapes", default="gpt-oss-20b,qwen3.6-35b-a3b,gemma-3-27b,llama-3.1-8b", show_default=True, help="Comma-separated shapes.")
@click.option("--device", default="cuda:0", show_default=True)
@click.option("--batches", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--batch-tokens", type=click.IntRange(64), default=16384, show_default=True, help="Real tokens per batch (about).")
@click.option("--min-len", type=click.IntRange(1), default=256, show_default=True)
@click.option("--max-len", type=click.IntRange(1), default=4096, show_default=True)
@click.option("--peak-tflops", type=float, default=790.0, show_default=True)
@click.option("--out", "out_path", default="", help="Also write the rows here (JSON lines, one per shape, as each ends).")
def bench_family_forward_cmd(shapes, device, batches, batch_tokens, min_len, max_len, peak_tflops, out_path) -> None:
    """The target's capture forward per family at published shapes with random weights: padded vs packed,
    tokens/s, MFU and their agreement (dflash_ipc/bench/family_forward.py)."""
    check_device_option("--device", device, "cuda:0", "the default")
    from dflash_ipc.bench.family_forward import measure_shape

    for name in [s.strip() for s in shapes.split(",") if s.strip()]:
        try:
            row = measure_shape(
                name, device, lengths=(min_len, max_len), batch_tokens=batch_tokens, batches=batches, peak_tflops=peak_tflops
            )
        except (ValueError, RuntimeError) as e:  # one shape's failure (out of memory, a missing kernel) leaves the others
            row = {"shape": name, "error": f"{type(e).__name__}: {e}"}
        line = json.dumps(row)
        click.echo(line)
        if out_path:
            with open(out_path, "a") as f:
                f.write(line + "\n")
