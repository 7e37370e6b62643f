"""Fixtures of the family tests: the zoo's checkpoints, built once per pytest worker and on demand."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from family_zoo import build_checkpoint


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``family_checkpoint(name)``: the directory of family ``name``'s tiny checkpoint (tests/families/family_zoo.py)."""
    root = tmp_path_factory.mktemp("families")
    return lambda name: build_checkpoint(name, root)
