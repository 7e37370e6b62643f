"""Third-party import notes a user cannot act on (dflash_ipc.third_party_logs) stay out of a process's
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
QUIET = "from dflash_ipc.third_party_logs import quiet_import_notes; quiet_import_notes(); quiet_import_notes()"


def _stderr(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stderr


def test_the_import_notes_are_dropped_and_every_other_message_shows():
    loud = _stderr(LOG_BOTH.format(quiet=""))
    assert "Failed to load" in loud and "Enum subclass" in loud  # the control: logged, they print
    quiet = _stderr(LOG_BOTH.format(quiet=QUIET))
    assert "Failed to load" not in quiet and "Enum subclass" not in quiet
    assert "a note a user needs" in quiet


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
def test_building_a_transformers_model_with_torchao_installed_prints_none_of_them():
    build = """
import sys
{quiet}
from transformers import AutoModelForCausalLM, LlamaConfig
AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, vocab_size=64))
assert "torchao" in sys.modules, "transformers no longer imports torchao with a model"
"""
    loud = _stderr(build.format(quiet=""))
    if "Failed to load" not in loud:
        pytest.skip("this torchao loads its C++ kernels here: nothing to drop")
    assert "Failed to load" not in _stderr(build.format(quiet=QUIET))
