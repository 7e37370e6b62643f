"""The `dflash-ipc` command line: a thin layer over the library."""

from __future__ import annotations

import json
import logging
import sys

import click

from dflash_ipc.config import ConfigError


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Train DFlash drafters at the speed of the target model."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@main.group()
def bench() -> None:
    """Benchmarks that report ratios against a baseline measured in the same run."""


@bench.command("transport")
@click.option("--backend", type=click.Choice(["cpu-shm", "cuda-ipc", "host-pinned"]), default="cpu-shm", show_default=True)
@click.option("--producers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--consumers", type=click.IntRange(1, 16), default=2, show_default=True)
@click.option("--slots", type=click.IntRange(2, 64), default=4, show_default=True)
@click.option("--slot-mib", type=click.FloatRange(0.004, 8192), default=64, show_default=True)
@click.option("--seconds", type=click.FloatRange(0.2, 3600), default=5, show_default=True)
@click.option("--slow-consumer", type=int, default=None, help="Consumer rank that sleeps per slot.")
@click.option("--slow-ms", type=float, default=None, help="Sleep per slot of the slow consumer (default: 4x a copy).")
@click.option("--producer-device", default=None, help="cpu, or cuda:N (default by backend).")
@click.option("--consumer-device", default=None, help="cpu, cuda:N, or 'same' (the producer's GPU).")
@click.option("--max-outstanding", type=click.IntRange(1, 64), default=2, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")
def bench_transport_cmd(backend, producers, consumers, slots, slot_mib, seconds, slow_consumer, slow_ms, producer_device, consumer_device, max_outstanding, as_json):
    """Move real data through the slot rings between real processes; verify every slot."""
    from dflash_ipc.bench_transport import BenchArgs, run_transport_bench

    gpu = backend != "cpu-shm"
    producer_device = producer_device or ("cuda:0" if gpu else "cpu")
    if consumer_device in (None, "other"):
        consumer_device = "cuda:1" if gpu else "cpu"
    elif consumer_device == "same":
        consumer_device = producer_device
    if slow_consumer is not None and not 0 <= slow_consumer < consumers:
        raise click.BadParameter(f"must be a consumer rank in [0, {consumers})", param_hint="--slow-consumer")
    if slow_ms is None:
        slow_ms = max(5.0, slot_mib / 64 * 40.0) if slow_consumer is not None else 0.0
    args = BenchArgs(backend=backend, producers=producers, consumers=consumers, slots=slots, slot_mib=slot_mib, seconds=seconds,
                     slow_consumer=slow_consumer, slow_ms=slow_ms, producer_device=producer_device, consumer_device=consumer_device,
                     max_outstanding=max_outstanding)
    result = run_transport_bench(args, progress=lambda s: click.echo(s, err=as_json))
    if as_json:
        click.echo(json.dumps(result))
    else:
        for k, v in result.items():
            click.echo(f"{k:>20}: {v}")
    sys.exit(0 if result["verified"] else 1)


def _load_or_exit(path: str):
    from dflash_ipc.config import load_config

    try:
        cfg = load_config(path)
    except ConfigError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    for w in cfg.ignored_value_warnings():
        click.echo(f"warning: {path}: {w}", err=True)
    return cfg


@main.command("check-config")
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False))
def check_config(config_path: str) -> None:
    """Validate a config file and print it resolved."""
    cfg = _load_or_exit(config_path)
    click.echo(json.dumps(cfg.to_dict(), indent=2))


if __name__ == "__main__":
    main()
