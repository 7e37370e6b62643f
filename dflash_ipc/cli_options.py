"""Click options that several command lines declare alike (``dflash-ipc`` and its bench and systemd
commands): one definition each, so the same option reads and behaves the same everywhere."""

from __future__ import annotations

from collections.abc import Sequence

import click


def choice_option(*decls: str, choices: Sequence[str], help: str | None = None):
    """One of ``choices``; the first is the default, shown in ``--help``."""
    return click.option(*decls, type=click.Choice(list(choices)), default=choices[0], show_default=True, help=help)


def int_option(*decls: str, minimum: int, default: int, help: str | None = None):
    """A whole number of at least ``minimum``; its default shown in ``--help``."""
    return click.option(*decls, type=click.IntRange(minimum), default=default, show_default=True, help=help)


def json_option():
    """``--json``: the result as one JSON object on the last line of stdout."""
    return click.option("--json", "as_json", is_flag=True, help="Print one JSON object as the last line.")


def set_option():
    """``--set SECTION.KEY=VALUE`` (repeatable): one config key over the file's, checked like the file."""
    return click.option(
        "--set",
        "set_values",
        multiple=True,
        metavar="SECTION.KEY=VALUE",
        help="Override one config key (repeatable), checked like the file: --set training.lr=3e-4. "
        'VALUE is a TOML value (numbers, true/false, [arrays], "strings"); other text is taken as a string.',
    )
