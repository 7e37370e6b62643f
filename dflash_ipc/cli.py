"""The `dflash-ipc` command line: a thin layer over the library."""

from __future__ import annotations

import json
import logging
import sys

import click

from dflash_ipc.bench.drafter_serve import drafter_serve_command
from dflash_ipc.bench.drafter_step_cli import drafter_step_cmd
from dflash_ipc.bench.gen_decode_cli import gen_decode_cmd
from dflash_ipc.cli_options import choice_option, config_option, int_option, json_option, set_option
from dflash_ipc.config import ConfigError, blame_sets
from dflash_ipc.control.ring_descriptor import BACKENDS
from dflash_ipc.eval.prompts import HUMANEVAL_AS, MT_BENCH_TURNS


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Train DFlash drafters at the speed of the target model."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")


@main.group()
def bench() -> None:
    """Benchmarks that report ratios against a baseline measured in the same run."""


bench.add_command(drafter_step_cmd)
bench.add_command(gen_decode_cmd)
bench.add_command(drafter_serve_command())


@bench.command("transport")
@choice_option("--backend", choices=BACKENDS)
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

    gpu = backend != "cpu-shm"
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
        _check_device_option(option, given[option], device, f"--backend {backend}")
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
    _load_or_exit(config_path, set_values, check_host=True)
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


def _load_or_exit(path: str, sets: tuple[str, ...] = (), *, check_environment: bool = False, check_host: bool = False):
    """The validated config (``sets``: the ``--set`` items over the file), or exit 2 with ``FILE: dotted.key: what
    to change`` (``--set dotted.key: ...`` for a key set there) on stderr.

    ``check_environment``: also the model, devices and data files it names (imports torch and
    transformers here: one-shot commands); ``check_host``: only what needs neither."""
    from dflash_ipc.config import load_config
    from dflash_ipc.runtime import preflight

    try:
        cfg = load_config(path, sets=sets)
        if check_environment:
            preflight.check_environment(cfg)
        elif check_host:
            preflight.check_host(cfg)
    except ConfigError as e:
        click.echo(f"error: {blame_sets(e, sets)}", err=True)
        sys.exit(2)
    for w in cfg.ignored_value_warnings():
        click.echo(f"warning: {path}: {w}", err=True)
    return cfg


def _check_device_option(option: str, value: str | None, default: str, default_from: str) -> None:
    """Exit 2 naming ``option`` unless every device it lists (comma-separated; left out: ``default``,
    from ``default_from``) is "cpu" or a CUDA device visible here: torch would fail later, with a traceback."""
    from dflash_ipc.runtime.preflight import device_problem, visible_cuda_devices

    names = [d.strip() for d in (value or default).split(",") if d.strip()] or [value or default]
    n_cuda = visible_cuda_devices() if any(d.startswith("cuda:") for d in names) else 0
    for name in names:
        if problem := device_problem(name, n_cuda):
            click.echo(f"error: {option if value else f'{option} (default: {default_from})'}: {problem}", err=True)
            sys.exit(2)


@main.command("check-config")
@config_option(help="Run configuration (TOML) to validate.")
@click.option("--file-only", is_flag=True, help="Check the file alone, not the model, devices and data files it names on this machine.")
@set_option()
def check_config(config_path: str, file_only: bool, set_values: tuple[str, ...]) -> None:
    """Validate a config file (and the model, devices, tokenizer and data it names) and print it resolved."""
    cfg = _load_or_exit(config_path, set_values, check_environment=not file_only)
    if not file_only:  # the tokenizer imports transformers and torch: seconds a refused or file-only check never needs
        from dflash_ipc.data.tokenizer import TokenizerError, check_target_tokenizer, load_tokenizer

        try:
            check_target_tokenizer(cfg.target, load_tokenizer(cfg.target.tokenizer))
        except (TokenizerError, OSError) as e:
            click.echo(f"error: {config_path}: {e}", err=True)
            sys.exit(2)
    click.echo(json.dumps(cfg.to_dict(), indent=2))


@main.command("up")
@config_option()
@click.option("--run-dir", default=None, help="Run directory (default: run.run_dir or runs/<run.name>).")
@click.option(
    "--max-steps", type=click.IntRange(0), default=None, help="Override training.max_steps (0: train until the data is exhausted)."
)
@click.option("--resume", is_flag=True, help="Continue from the last checkpoint in the run directory (fresh if none).")
@click.option(
    "--replan",
    is_flag=True,
    help="With --resume: the data changed since the checkpoint; plan it anew (weights and optimizer continue, every batch is new).",
)
@int_option(
    "--max-restarts",
    minimum=0,
    default=0,
    help="Restart the group from the last checkpoint after a failure, at most K times (with --nnodes: every node together).",
)
@click.option(
    "--nnodes", type=int, default=None, help="Nodes in the run, each running `up` with the same config (default: NNODES, else 1)."
)
@click.option("--node-rank", type=int, default=None, help="This node's rank in [0, nnodes) (default: NODE_RANK, else 0).")
@click.option("--master-addr", default=None, help="Node 0's host, reachable from every node (default: MASTER_ADDR).")
@click.option(
    "--master-port", type=int, default=None, help="Drafter rendezvous port on node 0; the supervisors use it +1 (default: MASTER_PORT)."
)
@click.option(
    "--shared-dir",
    default=None,
    type=click.Path(file_okay=False),
    help="Checkpoints (with the batch ledger) and the export, written by global rank 0 and read by every node on --resume "
    "(default: the run dir; with several nodes put it on storage every node reads).",
)
@set_option()
def up(
    config_path: str,
    run_dir: str | None,
    max_steps: int | None,
    resume: bool,
    replan: bool,
    max_restarts: int,
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    shared_dir: str | None,
    set_values: tuple[str, ...],
) -> None:
    """Start the whole pipeline: one process per target and per drafter (per node, with --nnodes)."""
    import os

    from dflash_ipc.runtime.nodes import NodeOptionError, resolve_node_spec
    from dflash_ipc.runtime.preflight import validate_for_up
    from dflash_ipc.runtime.run_lock import RunDirBusy

    try:  # before anything is created: a bad node option names itself and starts nothing
        node = resolve_node_spec(nnodes, node_rank, master_addr, master_port, shared_dir, os.environ)
    except NodeOptionError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)

    if replan and not resume:
        click.echo("error: --replan re-plans the data of a resumed run: pass it with --resume", err=True)
        sys.exit(2)
    overrides = {"training.max_steps": max_steps} if max_steps is not None else None
    try:
        # Before the run directory is created or chmodded: a refused run leaves no trace.
        cfg, resolved_run_dir = validate_for_up(config_path, run_dir, resume=resume, overrides=overrides, sets=set_values, replan=replan)
    except (ConfigError, RunDirBusy) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    for w in cfg.ignored_value_warnings():
        click.echo(f"warning: {config_path}: {w}", err=True)
    from dflash_ipc.runtime.probe import ProbeFailed
    from dflash_ipc.runtime.supervisor import GroupFailed, Supervisor

    sup = Supervisor(
        cfg,
        resolved_run_dir,
        resume=resume,
        replan=replan,
        max_restarts=max_restarts,
        echo=click.echo,
        live_progress=sys.stdout.isatty(),
        node=node,
    )
    try:
        try:  # held until this process exits, across every restart: nothing below runs on a directory it does not own
            sup.dir_lock.take()
        except (RunDirBusy, OSError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        done = sup.finished_already()
        if done:
            click.echo(f"[up] finished already: {done}")
            sys.exit(0)
        try:
            sup.prepare()
        except (GroupFailed, ProbeFailed, ValueError, OSError) as e:  # ConfigError is a ValueError
            sup.abandon()  # a refused run leaves no directory behind
            click.echo(f"error: {blame_sets(e, set_values) if isinstance(e, ConfigError) else e}", err=True)
            sys.exit(2)
        sys.exit(sup.run())
    finally:
        if os.environ.get("DFLASH_IPC_DEBUG_IMPORTS"):  # debug switch: the supervisor stays free of torch (runtime.probe)
            heavy = ", ".join(m for m in ("torch", "transformers") if m in sys.modules) or "neither torch nor transformers"
            click.echo(f"[up] debug: supervisor pid {os.getpid()} imported: {heavy}", err=True)


@main.command("status")
@click.option("--run-dir", default="runs", show_default=True, help="Run directory (or a folder of runs: the newest).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object with a `processes` list.")
@click.option("--prometheus", is_flag=True, help="Prometheus text exposition format.")
@click.option("--watch", is_flag=True, help="Refresh every second until interrupted.")
def status(run_dir: str, as_json: bool, prometheus: bool, watch: bool) -> None:
    """What every process of a run is doing (live, or the last snapshot after it ended)."""
    import os
    import time
    from pathlib import Path

    from dflash_ipc.ops.status_client import StatusUnavailable, read_status
    from dflash_ipc.ops.status_view import render_status

    while True:
        try:
            snap = read_status(Path(run_dir))
        except StatusUnavailable as e:
            if as_json:  # a script reading --json gets JSON either way
                click.echo(json.dumps({"error": str(e), "run_dir": os.fsencode(run_dir).decode("utf-8", "backslashreplace")}))
            else:
                click.echo(f"error: {e}", err=True)
            sys.exit(1)
        if as_json:
            out = render_status(snap, "json", indent=None)
        elif prometheus:
            out = render_status(snap, "prometheus")
        else:
            out = render_status(snap, "table")
        if watch:
            click.clear()
        click.echo(out, nl=False)  # every rendering ends in exactly one newline: `| tail -1` is the JSON
        if not watch:
            return
        time.sleep(1.0)


# A node's GPUs: every split of N is scored and printed, so N stays a size a node has.
MAX_TOPOLOGY_GPUS = 1024


@main.command("plan")
@config_option(required=False, help="Run configuration (TOML): its batch plan.")
@click.option(
    "--topology",
    "n_gpus",
    type=click.IntRange(2, MAX_TOPOLOGY_GPUS),
    default=None,
    help=f"Instead: the target:drafter split of this many GPUs of one node (2..{MAX_TOPOLOGY_GPUS}) with the most tokens/s "
    "(needs --profile).",
)
@click.option(
    "--profile",
    "profile_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Measured rates (JSON): a `bench pipeline` result, or {tokens_per_batch, target_batch_s, drafter_step_s}.",
)
@set_option()
@json_option()
def plan(config_path: str | None, n_gpus: int | None, profile_path: str | None, set_values: tuple[str, ...], as_json: bool) -> None:
    """Length-bucketed batch plan statistics for a config (no model is loaded), or with --topology
    the best target:drafter split of N GPUs from a measured profile."""
    if n_gpus is not None or profile_path is not None:
        _plan_topology(n_gpus, profile_path, as_json)
        return
    if config_path is None:
        raise click.UsageError("give --config FILE (batch plan), or --topology N --profile FILE (GPU split)")
    from dflash_ipc.data.plan import plan_command

    _load_or_exit(config_path, set_values)
    stats = plan_command(config_path, sets=set_values)
    if as_json:
        click.echo(json.dumps(stats))
    else:
        for k, v in stats.items():
            click.echo(f"{k:>32}: {v}")


def _plan_topology(n_gpus: int | None, profile_path: str | None, as_json: bool) -> None:
    from dflash_ipc.bench.topology import Profile, advice, format_table

    if n_gpus is None or profile_path is None:
        raise click.UsageError("--topology N and --profile FILE go together")
    try:
        profile = Profile.load(profile_path)
    except ValueError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(json.dumps(advice(profile, n_gpus)) if as_json else format_table(profile, n_gpus))


@main.command("eval")
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
    cfg = _load_or_exit(config_path, set_values)
    target_device, drafter_device = options["target_device"], options["drafter_device"]
    _check_device_option("--target-device", target_device, cfg.topology.targets[0], f"topology.targets[0] of {config_path}")
    if drafter_device or len([d for d in (target_device or "").split(",") if d.strip()]) <= 1:  # else: each target's own device
        _check_device_option("--drafter-device", drafter_device, cfg.topology.drafters[0], f"topology.drafters[0] of {config_path}")
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


@main.command("export")
@click.option("--from", "source", required=True, type=click.Path(file_okay=False), help="A run directory, or one checkpoints/step-N.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for the export (files 0644).")
@choice_option("--for", "client", choices=("all", "vllm", "sglang", "zlab"), help="Serving client ('all': one layout all read).")
@click.option("--device", default="cpu", show_default=True, help="Where to rebuild the drafter (the target's embedding and head are read).")
@json_option()
def export_cmd(source: str, out_dir: str, client: str, device: str, as_json: bool) -> None:
    """Export a run's newest complete checkpoint for a serving engine; print the command that serves it."""
    from dflash_ipc.drafter.export_run import export_checkpoint

    _check_device_option("--device", device, "cpu", "cpu")
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
    click.echo(f"exported step {res.step} ({res.checkpoint}) for {client} -> {res.out}\n")
    for cmd in res.commands.values():
        click.echo(cmd + "\n")


@main.command("export-untrained")
@config_option(help="Run configuration (TOML): the drafter to build and the target it reads.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder for config.json + model.safetensors.")
@click.option("--device", default="cpu", show_default=True, help="Where to build it (the target's embedding and LM head are read).")
@set_option()
def export_untrained_cmd(config_path: str, out_dir: str, device: str, set_values: tuple[str, ...]) -> None:
    """Export a freshly initialised drafter (as `up` starts it) in the trained export's layout: eval's untrained floor."""
    from pathlib import Path

    from dflash_ipc.drafter.core import export_untrained

    cfg = _load_or_exit(config_path, set_values)
    _check_device_option("--device", device, "cpu", "cpu")
    try:
        out = export_untrained(cfg, Path(out_dir), device)
    except (ValueError, OSError) as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    click.echo(str(out))


@main.command("gen-data")
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

    cfg = _load_or_exit(config_path, set_values)
    _check_device_option("--device", device, cfg.topology.targets[0], f"topology.targets[0] of {config_path}")
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


def _add_systemd() -> None:
    from dflash_ipc.ops.systemd_cli import systemd_group

    main.add_command(systemd_group, "systemd")


_add_systemd()


if __name__ == "__main__":
    main()
