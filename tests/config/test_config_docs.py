"""docs/CONFIG.md is generated from the field docstrings (dflash_ipc.config.docs) and must be current:
a field doc, type or default changed without `python -m dflash_ipc.config.docs` fails here."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_ipc.config import SECTIONS
from dflash_ipc.config.docs import render, render_section
from dflash_ipc.config.fields import field_docs

REPO = Path(__file__).resolve().parents[2]


def test_config_md_is_current():
    committed = (REPO / "docs" / "CONFIG.md").read_text()
    assert committed == render(), "docs/CONFIG.md is stale: run `python -m dflash_ipc.config.docs` and commit it"


def test_check_command_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "CONFIG.md"
    stale.write_text(render().replace("Peak learning rate", "Top learning rate"))
    cmd = [sys.executable, "-m", "dflash_ipc.config.docs", "--check", "--out", str(stale)]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 1
    subprocess.run([sys.executable, "-m", "dflash_ipc.config.docs", "--out", str(stale)], check=True, capture_output=True)
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0


def test_every_key_is_documented():
    text = render()
    for name, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name, "").strip(), f"{name}.{f.name} has no docstring under it in {cls.__module__}"
            assert f"`{name}.{f.name}`" in text


def test_a_key_shows_its_type_default_and_doc():
    @dataclass
    class Example:
        sizes: list[int] = field(default_factory=lambda: [1, 2])
        """How big.

        Over two lines."""
        mode: str = "x"
        undocumented: bool = False

    text = render_section("ex", Example)
    assert "- **`ex.sizes`** (list of int; default `[1, 2]`): How big. Over two lines." in text
    assert '- **`ex.mode`** (str; default `"x"`): ' in text
    assert field_docs(Example) == {"sizes": "How big.\n\nOver two lines."}
