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

import copy
import functools
import json
import math
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {v!r} ({type(v).__name__}) as TOML")


def toml_text(data: dict[str, Any]) -> str:
    """TOML for ``{section: {key: value}}`` (nested tables inline); top-level scalars first."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, table in data.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"] + [f"{k} = {_toml_value(v)}" for k, v in table.items()]
    text = "\n".join(lines).lstrip("\n") + "\n"
    canon = functools.partial(json.dumps, sort_keys=True)  # NaN-safe, keeps 30 and 30.0 apart
    if canon(tomllib.loads(text)) != canon(data):  # the writer is only trusted where it round-trips
        raise ValueError(f"TOML writer does not round-trip {data!r}")
    return text


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
