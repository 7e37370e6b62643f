"""Click options that several command lines declare alike (``dflash-ipc`` and its bench and systemd
commands): one definition each, so the same option reads and behaves the same everywhere."""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence

import click

#: A config file larger than this is not a config (a TOML of every option with comments is ~10 KiB).
MAX_CONFIG_BYTES = 4 * 2**20


class ConfigFile(click.Path):
    """A path to a run configuration: a regular file of at most :data:`MAX_CONFIG_BYTES`, so reading
    it can neither block (a FIFO, a terminal) nor run without end (/dev/zero). A missing file passes:
    loading it says "file not found" with the file's name."""

    def __init__(self) -> None:
        super().__init__(dir_okay=False)

    def convert(self, value, param, ctx):
        value = super().convert(value, param, ctx)
        try:
            st = os.stat(value)
        except FileNotFoundError:
            return value
        except OSError as e:
            self.fail(f"{_printable(value)}: cannot read it ({e.strerror or e})", param, ctx)
        if not stat.S_ISREG(st.st_mode):
            self.fail(f"{_printable(value)} is not a regular file (a pipe or device); give a TOML file", param, ctx)
        if st.st_size > MAX_CONFIG_BYTES:
            self.fail(f"{_printable(value)} holds {st.st_size:,} bytes: not a config (at most {MAX_CONFIG_BYTES:,})", param, ctx)
        return value


def _printable(path: str) -> str:
    text = os.fsencode(path).decode("utf-8", "backslashreplace")
    return text if len(text) <= 200 else f"{text[:100]}...{text[-97:]} ({len(text)} characters)"


def config_option(required: bool = True, help: str = "Run configuration (TOML)."):
    """``--config FILE``: the same checks (:class:`ConfigFile`) and a description in every command's ``--help``
    (no default: click enforces ``required`` only for an option without one)."""
    return click.option("--config", "config_path", required=required, type=ConfigFile(), help=help)


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
