"""What every command shares: a config loaded (and checked) or a one-line refusal with exit 2, and device
options checked against this machine before anything starts."""

from __future__ import annotations

import sys

import click

from dflash_ipc.config import ConfigError, blame_sets


def load_or_exit(path: str, sets: tuple[str, ...] = (), *, check_environment: bool = False, check_host: bool = False):
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


def check_device_option(option: str, value: str | None, default: str, default_from: str) -> None:
    """Exit 2 naming ``option`` unless every device it lists (comma-separated; left out: ``default``,
    from ``default_from``) is "cpu" or a CUDA device visible here: torch would fail later, with a traceback."""
    from dflash_ipc.runtime.preflight import device_problem, visible_cuda_devices

    names = [d.strip() for d in (value or default).split(",") if d.strip()] or [value or default]
    n_cuda = visible_cuda_devices() if any(d.startswith("cuda:") for d in names) else 0
    for name in names:
        if problem := device_problem(name, n_cuda):
            click.echo(f"error: {option if value else f'{option} (default: {default_from})'}: {problem}", err=True)
            sys.exit(2)
