"""Healthy runs under CPU load: does the supervisor ever call one hung? (issue 25, item 6)

Starts ``--load`` busy processes (default: twice the cores), then runs ``dflash-ipc up`` on the
embedded default (configs/tiny-cpu.toml, ``--max-steps`` steps) ``--runs`` times at each
heartbeat timeout of ``--heartbeat-timeouts`` (default: the config's default, then 4 s), and
writes one JSON line per run plus a summary to ``--out`` (default: $OUT or runs/heartbeat-load).

A run that exits non-zero is a false hang when its output names a silent or stalled child
("stopped answering", "made no progress"); any other failure is reported as such.

    python tools/heartbeat_under_load.py --runs 20 --max-steps 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
HANG_WORDS = ("stopped answering", "made no progress", "missed heartbeats")


def start_load(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def one_run(config: Path, run_dir: Path, max_steps: int) -> dict:
    argv = [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(config), "--run-dir", str(run_dir), "--max-steps", str(max_steps)]
    t0 = time.monotonic()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False, timeout=1800)
    out = proc.stdout
    hang = next((line for line in out.splitlines() if any(w in line for w in HANG_WORDS)), None)
    tail = out[-1500:] if proc.returncode else ""
    return {"exit": proc.returncode, "wall_s": round(time.monotonic() - t0, 1), "false_hang": hang, "tail": tail}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--max-steps", type=int, default=8)
    ap.add_argument("--load", type=int, default=2 * (os.cpu_count() or 1), help="busy processes (default: twice the cores)")
    ap.add_argument("--heartbeat-timeouts", default="default,4", help="comma-separated: 'default' or seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/heartbeat-load"))
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    load = start_load(a.load)
    summary = {"load_processes": a.load, "cores": os.cpu_count(), "runs_per_setting": a.runs, "max_steps": a.max_steps, "settings": {}}
    try:
        with open(out / "runs.jsonl", "w") as log:
            for setting in a.heartbeat_timeouts.split(","):
                raw = json.loads(json.dumps(base))
                if setting != "default":
                    raw.setdefault("run", {})["heartbeat_timeout_s"] = float(setting)
                config = out / f"tiny-cpu-heartbeat-{setting}.toml"
                config.write_text(tomli_w.dumps(raw))
                results = []
                for i in range(a.runs):
                    r = one_run(config, out / f"run-{setting}-{i}", a.max_steps)
                    r |= {"setting": setting, "run": i, "loadavg": os.getloadavg()[0]}
                    results.append(r)
                    log.write(json.dumps(r) + "\n")
                    log.flush()
                    hang = f" FALSE HANG: {r['false_hang']}" if r["false_hang"] else ""
                    print(f"heartbeat_timeout {setting} run {i}: exit {r['exit']} in {r['wall_s']} s{hang}")
                summary["settings"][setting] = {
                    "ok": sum(r["exit"] == 0 for r in results),
                    "false_hangs": sum(bool(r["false_hang"]) for r in results),
                    "other_failures": sum(r["exit"] != 0 and not r["false_hang"] for r in results),
                }
    finally:
        for p in load:
            p.kill()
            p.wait()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0 if all(s["false_hangs"] == 0 and s["other_failures"] == 0 for s in summary["settings"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
