"""The family zoo's checkpoints, built once per test session (per pytest-xdist worker) and shared by every test
under tests/families that needs them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
from family_zoo import build_checkpoint


@pytest.fixture(scope="session")
def zoo_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``zoo_checkpoint(name)``: the tiny random checkpoint of family ``name`` (family_zoo.py), built on first use."""
    return functools.partial(build_checkpoint, root=tmp_path_factory.mktemp("family-zoo"))
