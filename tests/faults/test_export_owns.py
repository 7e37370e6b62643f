"""An export owns only what it writes, and a kill never tears it.

One real `dflash-ipc up` (tiny CPU config, checkpoints at steps 4 and 8, the export `up` writes at
its end) trains once for the module; each case works on a copy of its run directory.

* `dflash-ipc export --out D` takes D only when it is missing, empty or a previous export (its
  marker ``.dflash-ipc-export`` lists what it wrote): a directory with a ``.netrc`` of mode 0600 is
  refused and the file keeps its mode and bytes; the run directory and its checkpoints are refused
  and every byte of them stays.
* A SIGKILL at the moment an export replaces the previous one (`dflash-ipc export`, and drafter-0 in
  the export at the end of `up --resume`) leaves the previous export as it was, every file. The
  kill is made exact by ``strace --inject``: SIGKILL at the first write into the export directory's
  own files or the first rename over it (the writer that swaps a directory written beside it in
  whole reaches only the rename; one that writes in place dies with the weights truncated). Skipped,
  with the reason, where strace cannot trace (not installed, ptrace not allowed).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_up
from fault_harness import CLI, RUN_TIMEOUT_S, Up, report, write_config

from dflash_ipc.drafter.export.destination import EXPORT_MARKER

STEPS = 8
EXPORT = Path("export") / "drafter"


def tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``root`` (links not followed): its sha256 and mode."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            out[str(path.relative_to(root))] = (hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mode & 0o7777)
    return out


def export(src: Path, out: Path, *wrapper: str) -> subprocess.CompletedProcess:
    argv = [*wrapper, *CLI, "export", "--from", str(src), "--out", str(out)]
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)


def strace_problem() -> str | None:
    """Why ``strace --inject`` cannot be used here (None: it can)."""
    if shutil.which("strace") is None:
        return "strace is not installed"
    probe = subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", "trace=none", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"strace cannot trace here: {probe.stderr.strip()[:200]}"
    return None


def attach_problem() -> str | None:
    """Why strace cannot attach to a running process of this user here (None: it can)."""
    problem = strace_problem()
    if problem or os.geteuid() == 0:
        return problem
    try:
        scope = int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text())
    except (OSError, ValueError):
        return None
    return f"kernel.yama.ptrace_scope is {scope}: only a parent may trace a process" if scope > 0 else None


def kill_at_export(out: Path) -> list[str]:
    """strace options that SIGKILL the traced process at its first write into ``out``'s files or its first
    rename over ``out`` (a rename in ``out``'s parent or naming ``out``)."""
    paths = [out.parent, out, *(out / name for name in ("config.json", "model.safetensors", "modeling_dflash_ipc.py"))]
    calls = "write,pwrite64,writev,rename,renameat,renameat2"
    return [*(f"--trace-path={p}" for p in paths), "-f", "-qq", "-o", "/dev/null", f"--trace={calls}", f"--inject={calls}:signal=KILL"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("exported")
    config = write_config(base / "c.toml", training={"checkpoint_every": 4})
    proc = run_up(config, base / "run", STEPS, base)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return base


@pytest.fixture
def run(trained, tmp_path) -> Path:
    shutil.copytree(trained / "run", tmp_path / "run", symlinks=True)
    return tmp_path / "run"


@pytest.mark.slow
def test_export_into_a_directory_of_other_files_touches_none_of_them(run, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".netrc").write_text("machine example.com login me password secret\n")
    (home / ".netrc").chmod(0o600)
    before = tree_digest(home)
    proc = export(run, home)
    report(f"export into a directory with a .netrc: exit {proc.returncode}: {proc.stdout.strip()[:200]}")
    assert proc.returncode == 2 and "holds .netrc, which no dflash-ipc export wrote" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout
    assert tree_digest(home) == before and before[".netrc"][1] == 0o600
    assert sorted(os.listdir(tmp_path)) == ["home", "run"]  # nothing staged beside it either


def test_a_marker_nested_past_the_parser_is_no_marker_and_refused_by_name(run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / EXPORT_MARKER).write_text("[" * 200_000 + "]" * 200_000)
    (out / "notes.txt").write_text("mine\n")
    before = tree_digest(out)
    proc = export(run, out)
    assert proc.returncode == 2 and "holds notes.txt, which no dflash-ipc export wrote" in proc.stdout, proc.stdout[-2000:]
    assert "Traceback" not in proc.stdout and "RecursionError" not in proc.stdout
    assert tree_digest(out) == before


@pytest.mark.slow
@pytest.mark.parametrize("target", ["", "checkpoints/step-000008", "checkpoints", "logs", "fresh"])
def test_export_into_the_run_or_its_checkpoints_is_refused_and_changes_nothing(run, target):
    out = run / target if target else run
    before = tree_digest(run)
    proc = export(run / "checkpoints" / "step-000008", out)
    report(f"export --out RUN_DIR/{target}: exit {proc.returncode}: {proc.stdout.strip()[:160]}")
    assert proc.returncode == 2 and f"--out {out}" in proc.stdout and "Traceback" not in proc.stdout, proc.stdout[-2000:]
    assert tree_digest(run) == before
    assert not (run / "fresh").exists()


@pytest.mark.slow
def test_a_killed_export_leaves_the_previous_export_whole(run, tmp_path):
    problem = strace_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path / "drafter"
    first = export(run, out)
    assert first.returncode == 0, first.stdout[-2000:]
    before = tree_digest(out)
    killed = export(run / "checkpoints" / "step-000004", out, "strace", *kill_at_export(out), "--")
    report(f"export killed at its first write or rename over the previous one: exit {killed.returncode}")
    assert killed.returncode == -9 or killed.returncode == 128 + 9, killed.stdout[-2000:]
    assert tree_digest(out) == before
    again = export(run / "checkpoints" / "step-000004", out)
    assert again.returncode == 0 and "exported step 4" in again.stdout, again.stdout[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["drafter", "run"]  # what the killed one staged is gone
    after = tree_digest(out)
    assert after != before and set(after) == set(before) == {"config.json", "model.safetensors", "modeling_dflash_ipc.py", EXPORT_MARKER}
    assert {mode for _, mode in after.values()} == {0o644}


@pytest.mark.slow
def test_the_export_of_up_is_swapped_in_whole_when_its_drafter_is_killed(trained, run):
    problem = attach_problem()
    if problem:
        pytest.skip(problem)
    before = tree_digest(run / EXPORT)
    up = Up(trained / "c.toml", run, "--resume", "--max-steps", str(STEPS + 2))
    tracer = None
    try:
        up.wait_until(lambda: "drafter-0" in up.child_pids(), "drafter-0 started")
        pid = up.child_pids()["drafter-0"]
        tracer = subprocess.Popen(["strace", "-p", str(pid), *kill_at_export(run / EXPORT)], stderr=subprocess.PIPE, text=True)
        code = up.wait()
    finally:
        up.close()
        if tracer is not None:
            tracer.wait(timeout=60)
    failed = re.search(r"\[up\] FAILED: .*", up.output)
    report(f"up's export killed: exit {code}: {failed.group(0)[:160] if failed else up.output[-300:]}")
    assert code == 1 and failed and "drafter-0" in failed.group(0) and "SIGKILL" in failed.group(0), up.output[-3000:]
    assert tree_digest(run / EXPORT) == before
