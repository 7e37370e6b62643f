"""Which limit ends a run (dflash_ipc/data/run_length.py), as `check-config` states it: training.max_steps,
training.max_seconds or the data (samples x epochs), with the data counted as `plan` counts it. `up`'s line:
tests/end_to_end/test_up.py, on the session's shared run."""

from __future__ import annotations

import json
import math

from click.testing import CliRunner
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.cli import main


def _check_config(config, *sets: str):
    argv = ["check-config", "--config", str(config), *(a for s in sets for a in ("--set", s))]
    r = CliRunner().invoke(main, argv)
    assert r.exit_code == 0, r.output
    json.loads(r.stdout)  # stdout stays the resolved config alone
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("run length: ")]
    return line


def test_check_config_names_the_limit_that_ends_the_run(tmp_path):
    config = write_toml(tmp_path / "c.toml", tiny_cpu_config(data={"builtin_samples": 64}, training={"max_steps": 4}))
    plan = json.loads(CliRunner().invoke(main, ["plan", "--config", str(config), "--json"]).stdout.strip().splitlines()[-1])
    data_steps = math.ceil(plan["n_batches"] / 2)  # configs/tiny-cpu.toml: 2 drafters, one batch each per step
    assert data_steps > 4

    # the case a time budget does not change: max_steps still comes first unless steps are very slow
    line = _check_config(config, "training.max_seconds=360")
    assert line.startswith("run length: training.max_steps = 4 ends the run unless training.max_seconds = 360 runs out first")
    assert "steps slower than 90 s each" in line and f"the data lasts about {data_steps} steps (64 samples x 1 epoch" in line

    # no step limit, one epoch: the data ends it, and the time budget would need its pace
    line = _check_config(config, "training.max_steps=0")
    assert line == (
        f"run length: the data ends the run at about step {data_steps}; the data lasts about {data_steps} steps "
        f"(64 samples x 1 epoch: {plan['n_batches']} batches over 2 drafter(s))"
    )
    # more steps than the data holds: the data still ends it first, and says so
    line = _check_config(config, "training.max_steps=100000", "data.num_epochs=2")
    two_epochs = math.ceil(2 * plan["n_batches"] / 2)
    assert line.startswith(f"run length: the data ends the run at about step {two_epochs}, before training.max_steps = 100000")
