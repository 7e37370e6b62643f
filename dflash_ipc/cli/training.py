"""The commands of a training run: `check-config` and `plan` (before it), `up` (the run), `status` (during and after it)."""

from __future__ import annotations

import json
import sys

import click

from dflash_ipc.cli.common import load_or_exit
from dflash_ipc.cli.options import config_option, int_option, json_option, set_option
from dflash_ipc.config import ConfigError, blame_sets


@click.command("check-config")
@config_option(help="Run configuration (TOML) to validate.")
@click.option("--file-only", is_flag=True, help="Check the file alone, not the model, devices and data files it names on this machine.")
@set_option()
def check_config(config_path: str, file_only: bool, set_values: tuple[str, ...]) -> None:
    """Validate a config file (and the model, devices, tokenizer and data it names) and print it resolved."""
    from dflash_ipc.data.run_length import DataLength, run_length_text

    cfg = load_or_exit(config_path, set_values, check_environment=not file_only)
    data = None
    if not file_only:  # the tokenizer imports transformers and torch: seconds a refused or file-only check never needs
        from dflash_ipc.data.plan import plan_report
        from dflash_ipc.data.tokenizer import TokenizerError, check_target_tokenizer, config_tokenizer

        try:
            tok = config_tokenizer(cfg)
            check_target_tokenizer(cfg.target, tok)
            plan = plan_report(cfg, config_path, tok)  # the data counted as `plan` counts it (cached like it)
        except (TokenizerError, OSError, ValueError) as e:
            click.echo(f"error: {config_path}: {e}", err=True)
            sys.exit(2)
        from dflash_ipc.runtime.family_check import describe_target

        click.echo(f"target: {describe_target(cfg)}", err=True)
        epochs = cfg.data.num_epochs
        data = DataLength(plan["n_batches"] * epochs, plan["data"]["samples"], epochs, len(cfg.topology.drafters))
    click.echo(json.dumps(cfg.to_dict(), indent=2))
    # on stderr: stdout stays the resolved config as JSON
    click.echo(f"run length: {run_length_text(cfg.training.max_steps, cfg.training.max_seconds, data)}", err=True)


@click.command("up")
@config_option()
@click.option("--run-dir", default=None, help="Run directory (default: run.run_dir or runs/<run.name>).")
@click.option(
    "--max-steps", type=click.IntRange(0), default=None, help="Override training.max_steps (0: train until the data is exhausted)."
)
@click.option(
    "--resume", is_flag=True, help="Continue from the last checkpoint in the run directory (fresh if it holds none; it must exist)."
)
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

    if sys.stdout is None:  # `up ... >&-`: its progress and its end have nowhere to go, and fd 1 would be the next file opened
        click.echo("error: stdout is closed: `up` reports its progress and how the run ended there; redirect it (>/dev/null)", err=True)
        sys.exit(2)

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
    from dflash_ipc.runtime import stop_signals
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
    stop_signals.install(sup.request_stop)  # from here to the exit, whoever sends one: a stop, never a crash
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
            if not sup.stop_requested:  # else the probe had the stop signal too: it ended, and so does the run
                sup.abandon()  # a refused run leaves no directory behind
                click.echo(f"error: {blame_sets(e, set_values) if isinstance(e, ConfigError) else e}", err=True)
                sys.exit(2)
        if sup.stop_requested:
            sup.abandon()
            click.echo(f"[up] {sup.stop_requested}: stopping before training started (nothing to checkpoint)")
            sys.exit(0)
        sys.exit(sup.run())
    finally:
        if os.environ.get("DFLASH_IPC_DEBUG_IMPORTS"):  # debug switch: the supervisor stays free of torch (runtime.probe)
            heavy = ", ".join(m for m in ("torch", "transformers") if m in sys.modules) or "neither torch nor transformers"
            click.echo(f"[up] debug: supervisor pid {os.getpid()} imported: {heavy}", err=True)


@click.command("status")
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


@click.command("plan")
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

    load_or_exit(config_path, set_values)
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
