"""Third-party import notes a user cannot act on (dflash_ipc.platform.third_party_logs) stay out of a process's
output, and nothing else those loggers say does: real processes, real logging to stderr."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

LOG_BOTH = """
import logging, sys
{quiet}
logging.getLogger("torchao").warning("Failed to load /x/_C_mxfp8.so: Could not load this library")
logging.getLogger("torch.utils._pytree").warning("<enum 'E'> is an Enum subclass and is now natively supported by torch.compile")
logging.getLogger("torchao").warning("a note a user needs")
"""
QUIET = "from dflash_ipc.platform.third_party_logs import quiet_import_notes; quiet_import_notes(); quiet_import_notes()"


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stderr


def test_the_import_notes_are_dropped_and_every_other_message_shows():
    loud = _stderr(LOG_BOTH.format(quiet=""))
    assert "Failed to load" in loud and "Enum subclass" in loud  # the control: logged, they print
    quiet = _stderr(LOG_BOTH.format(quiet=QUIET))
    assert "Failed to load" not in quiet and "Enum subclass" not in quiet
    assert "a note a user needs" in quiet


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_every_note_torchao_logs_while_transformers_builds_a_model_is_one_the_filter_drops():
    build = """
import logging, sys
from dflash_ipc.platform.third_party_logs import IMPORT_NOTES, _DropImportNotes
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record)
for name in IMPORT_NOTES:
    logging.getLogger(name).addHandler(Keep())
from transformers import AutoModelForCausalLM, LlamaConfig
AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
assert "torchao" in sys.modules, "transformers no longer imports torchao with a model"
records = [r for r in records if r.name in IMPORT_NOTES]  # a filter acts on its own logger's records
kept = [r.getMessage() for r in records if _DropImportNotes(IMPORT_NOTES[r.name]).filter(r)]
print(len(records), kept)
"""
    out = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    if out[0] == "0":
        pytest.skip("this torchao loads its C++ kernels here: it logs nothing at import")
    assert out[1:] == ["[]"], f"notes the filter lets through: {out[1:]}"


def test_an_execd_child_drops_the_notes_before_it_imports_its_role():
    """run.launcher "exec" (every CUDA run): each child is a new Python whose stderr the user reads; the launcher
    installs the filters before the role's modules (and their model's torchao) load."""
    child = """
import logging
from dflash_ipc.runtime import launch
try:
    launch.main(["no_such_role"])  # the filters go in first, then the role's import fails
except ModuleNotFoundError:
    pass
logging.getLogger("torch.utils._pytree").warning("<enum 'E'> is an Enum subclass and is now natively supported by torch.compile")
logging.getLogger("torchao").warning("a note a user needs")
"""
    stderr = _stderr(child)
    assert "Enum subclass" not in stderr and "a note a user needs" in stderr
