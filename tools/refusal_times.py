"""Time to refusal of the real `dflash-ipc up` for issue 25's bad configs (docs/FAULTS.md).

Run from the repository root with the package and its test extra installed:
``python tools/refusal_times.py``; one JSON line per case (seconds to exit, exit code, the error
line). The /dev/shm case needs root and ``unshare -m`` (a private mount namespace with an 8 MiB
tmpfs on /dev/shm); the `--resume` case writes its checkpoint with the test suite's helper.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = ["tests", "tests/faults"]  # the test suite's config helpers (conftest, test_bad_configs)

from conftest import write_toml  # noqa: E402
from test_bad_configs import DELETE, apply, base_config  # noqa: E402
from test_bad_resume import THREE_LAYERS, write_checkpoint  # noqa: E402

CASES = {
    "target.spec.rms_norm_eps = inf": {"target.spec.rms_norm_eps": float("inf")},
    "target.spec.initializer_range = nan": {"target.spec.initializer_range": float("nan")},
    "target.spec.rope_parameters.rope_thetaa": {"target.spec.rope_parameters.rope_thetaa": 1e4},
    "data.max_batch_size = 2**63-1": {"data.max_batch_size": 2**63 - 1},
    "target.spec.hidden_size = 10**9": {"target.spec.hidden_size": 10**9},
    "drafter.num_layers = 100000": {"drafter.num_layers": 100000, "drafter.layer_types": DELETE},
    "training.max_steps = 99999999999999999999": {"training.max_steps": 99999999999999999999},
    "data.holdout_paths missing": {"data.holdout_paths": ["/nonexistent/h.jsonl"]},
}
SMALL_SHM = ("unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=8m tmpfs /dev/shm && exec "$@"', "sh")


def time_up(name: str, config: Path, run_dir: Path, *extra: str, prefix: tuple[str, ...] = ()) -> None:
    argv = [*prefix, sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(config), "--run-dir", str(run_dir), *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    print(json.dumps({"case": name, "seconds": round(seconds, 2), "rc": proc.returncode, "stderr": last[:240]}), flush=True)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="refusal-times-"))
    for i, (name, patch) in enumerate(CASES.items()):
        time_up(name, write_toml(tmp / f"case{i}.toml", apply(base_config(), patch)), tmp / f"run{i}")
    empty = tmp / "empty.toml"
    empty.write_text("")
    time_up("empty config file", empty, tmp / "run-empty")
    write_checkpoint(tmp / "run-ckpt", apply(base_config(), THREE_LAYERS))
    time_up("--resume from drafter.num_layers 3, now 2", write_toml(tmp / "now.toml", base_config()), tmp / "run-ckpt", "--resume")
    time_up("8 MiB /dev/shm", write_toml(tmp / "shm.toml", base_config()), tmp / "run-shm", prefix=SMALL_SHM)


if __name__ == "__main__":
    main()
