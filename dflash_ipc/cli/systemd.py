"""`dflash-ipc systemd render|verify`: the command line over :mod:`dflash_ipc.ops.systemd_units`."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from dflash_ipc.cli.options import int_option
from dflash_ipc.ops.systemd_units import (
    DEFAULT_TIMEOUT_START_S,
    DEFAULT_TIMEOUT_STOP_S,
    DEFAULT_WATCHDOG_S,
    render_command_impl,
    verify_unit,
)


@click.group("systemd")
def systemd_group() -> None:
    """Run training as a systemd service: dflash-ipc@NAME for configs/NAME.toml."""


def _path_opt(name: str, help_text: str):
    return click.option(name, type=click.Path(path_type=Path), default=None, help=help_text)


@systemd_group.command("render")
@click.option(
    "--out",
    "out",
    required=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory to write dflash-ipc@.service and dflash-ipc.env.example into.",
)
@click.option("--user", "user_mode", is_flag=True, help="Render a user unit (systemctl --user) instead of a system unit.")
@_path_opt("--config-dir", "Directory of NAME.toml configs [/etc/dflash-ipc; --user: ~/.config/dflash-ipc].")
@_path_opt("--runs-dir", "Parent of the run directories [/var/lib/dflash-ipc/runs; --user: ~/.local/share/dflash-ipc/runs].")
@_path_opt("--env-dir", "Directory of the optional NAME.env files [the config dir].")
@_path_opt("--working-dir", "Working directory of the service [parent of the runs dir].")
@click.option("--exec", "exec_cmd", default=None, help="Command that runs dflash-ipc [the dflash-ipc script next to this Python].")
@click.option("--service-user", default=None, help="System units only: run as this user (User=).")
@int_option(
    "--timeout-start",
    "timeout_start_s",
    minimum=1,
    default=DEFAULT_TIMEOUT_START_S,
    help="Seconds allowed from start to READY (model loading, handshakes).",
)
@int_option(
    "--timeout-stop",
    "timeout_stop_s",
    minimum=1,
    default=DEFAULT_TIMEOUT_STOP_S,
    help="Seconds allowed for the shutdown checkpoint before SIGKILL.",
)
@int_option("--watchdog", "watchdog_s", minimum=0, default=DEFAULT_WATCHDOG_S, help="WatchdogSec in seconds; 0 disables it.")
def render_cmd(out: Path, exec_cmd: str | None, **unit_options) -> None:
    """Render the dflash-ipc@.service template unit for this install."""
    try:
        # every other option is a keyword of render_unit_text, by name
        render_command_impl(out, exec_path=shlex.split(exec_cmd) if exec_cmd else None, echo=click.echo, **unit_options)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    except OSError as e:  # a directory that cannot be made or written (/proc/..., read-only, no permission)
        click.echo(f"error: --out {out}: cannot write the units there ({e.strerror or e})", err=True)
        sys.exit(2)


@systemd_group.command("verify")
@click.argument("unit", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--user", "user_mode", is_flag=True, help="Verify as a user unit.")
@click.option("--instance", default="example", show_default=True, help="Instance name to verify with.")
def verify_cmd(unit: Path, user_mode: bool, instance: str) -> None:
    """Check a rendered unit with systemd-analyze verify."""
    try:
        rc, problems = verify_unit(unit, instance, user_mode=user_mode)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    if problems:
        click.echo(problems, err=True)
    if rc != 0 or problems:
        raise SystemExit(1)
    click.echo(f"{unit}: ok")
