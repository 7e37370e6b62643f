"""The `dflash-ipc` command line: a thin layer over the library.

Every click command of dflash-ipc lives in this package. ``main`` is the group; each command lives with its
kind: ``cli.training`` (check-config, plan, up, status), ``cli.drafters`` (eval, export, export-untrained),
``cli.gen_data``, ``cli.bench`` (the bench group, its longer commands in ``cli.bench_*``), ``cli.systemd`` (the
systemd group). ``cli.common`` holds what they share at run time, ``cli.options`` the options several declare alike.
"""

from __future__ import annotations

import logging

import click

from dflash_ipc.cli.bench import bench
from dflash_ipc.cli.drafters import eval_cmd, export_cmd, export_untrained_cmd
from dflash_ipc.cli.gen_data import gen_data_cmd
from dflash_ipc.cli.systemd import systemd_group
from dflash_ipc.cli.training import check_config, plan, status, up
from dflash_ipc.platform.third_party_logs import quiet_import_notes


@click.group()
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """Train DFlash drafters at the speed of the target model."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    quiet_import_notes()


for command in (bench, check_config, up, status, plan, eval_cmd, export_cmd, export_untrained_cmd, gen_data_cmd):
    main.add_command(command)
main.add_command(systemd_group, "systemd")
