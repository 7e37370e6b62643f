"""Shared test plumbing: GPU skips in one place, and run configs written from dicts.

Markers (registered in pyproject.toml):

* ``gpu``: needs CUDA; ``gpu(2)``: needs at least two CUDA GPUs. Skipped here, with the reason,
  when the machine has fewer; ``-m gpu`` selects both.
* ``faults_full``: the long trials of tests/faults/, skipped unless DFLASH_IPC_FAULTS_FULL=1.
* ``slow``: spawns process groups (``dflash-ipc up``, torch.distributed ranks).

Run configs: tests build them as dicts (``tiny_cpu_config(data={...})``) and write them with
``write_toml``; test modules import these with ``from conftest import ...`` (tests/ has no
``__init__.py``, so pytest's default import mode puts it on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import functools
import importlib.util
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_CPU = REPO / "configs" / "tiny-cpu.toml"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    full_faults = bool(os.environ.get("DFLASH_IPC_FAULTS_FULL"))
    for item in items:
        if item.get_closest_marker("faults_full") is not None and not full_faults:
            item.add_marker(pytest.mark.skip(reason="long fault trial: set DFLASH_IPC_FAULTS_FULL=1 (docs/FAULTS.md)"))
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = int(marker.args[0]) if marker.args else 1
        if have < need:
            what = "CUDA" if need == 1 else f"{need} CUDA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"needs {what} (this machine has {have})"))


# --------------------------------------------------------------------------- TOML from dicts


def toml_text(data: dict[str, Any]) -> str:
    """TOML for a config dict (tomli-w; inf and nan written as TOML inf / nan, so bad values reach the loader as written)."""
    return tomli_w.dumps(data)


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(toml_text(data))
    return path


@functools.cache
def _tiny_cpu() -> dict[str, Any]:
    return tomllib.loads(TINY_CPU.read_text())


def tiny_cpu_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """configs/tiny-cpu.toml as a fresh dict, each ``section={key: value}`` merged into it."""
    raw = copy.deepcopy(_tiny_cpu())
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    return raw


def run_up(config: Path, run_dir: Path, max_steps: int, cwd: Path) -> subprocess.CompletedProcess:
    """`dflash-ipc up` to completion in a subprocess (not a TTY), its output captured as text."""
    argv = [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(config), "--max-steps", str(max_steps), "--run-dir", str(run_dir)]
    return subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, cwd=cwd)


def free_port() -> int:
    """A loopback port free at the moment of asking (the rendezvous of a test's process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group_rank(rank: int, port: int, backend: str = "gloo", timeout_s: float = 120.0) -> Iterator[Any]:
    """One rank of a two-rank test process group, started by ``torch.multiprocessing.spawn``.

    faulthandler is on, because spawn reports a rank that a C++ abort ends only by its signal
    (the one CI failure of this kind, a SIGABRT "terminate called without an active exception",
    left no stack). A rank that finished its body meets the other at a barrier before the group
    is destroyed: no rank tears its connections down while the peer's last collective is still
    in flight. A rank that raised skips the barrier (the peer may never come)."""
    from dflash_ipc.drafter.distributed import init_distributed

    faulthandler.enable()
    if backend == "gloo":
        torch.set_num_threads(1)  # two ranks on a 2-core machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    world = init_distributed(backend, timeout_s)
    finished = False
    try:
        yield world
        finished = True
    finally:
        if finished:
            world.barrier()
        torch.distributed.destroy_process_group()


TINY_RUN_STEPS = 6


def tensorboard_config(path: Path, tensorboard: bool = True) -> Path:
    """configs/tiny-cpu.toml as it is, with run.tensorboard set."""
    return write_toml(path, tiny_cpu_config(run={"tensorboard": tensorboard}))


@pytest.fixture(scope="session")
def tiny_cpu_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """One `dflash-ipc up` of configs/tiny-cpu.toml for TINY_RUN_STEPS steps, not on a TTY, with
    TensorBoard events on: test_progress reads its output, test_tensorboard its event files (one
    process group instead of two; neither property depends on the other's setting). Without the
    optional tensorboard package the run still happens, with TensorBoard off."""
    work = tmp_path_factory.mktemp("tiny-cpu-run")
    run_dir = work / "run"
    config = tensorboard_config(work / "tiny-cpu.toml", tensorboard=importlib.util.find_spec("tensorboard") is not None)
    return run_up(config, run_dir, TINY_RUN_STEPS, cwd=work), run_dir
