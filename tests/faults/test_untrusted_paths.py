"""Nothing outside the private run directory is trusted, and nothing inside it is written through a link.

One real `dflash-ipc up` trains once for the module under umask 000, on a JSONL data file, with its
token cache in ``data.cache_dir`` (two directories that do not exist yet) and a run directory whose
path is too long for a socket address (its sockets live in a ``/tmp/dfi-*`` directory that
``RUN_DIR/sock`` links to). Each case resumes a copy of that run directory.

* The token cache is made private whatever the umask (directories 0700, files 0600); a cache
  directory or file of another user, or one other users can write, is refused by
  ``data.cache_dir`` before any process starts.
* A socket directory made again by another user (after a /tmp clean-up) is never used: the run
  makes a new private one and links it; nothing is created in the planted one.
* Symbolic links planted in the run directory (at plan.json, run_id, node.json, logs, the export,
  ...) are refused, each named, before anything is written; one planted while the run trains
  (``RUN_DIR/export``) is refused when the drafter comes to write there: the run fails naming it.
  No file a link points at changes.
* The token cache is keyed by content: a data file edited in place, its size and mtime kept, is
  not trained "from cache": `up --resume` names the file as changed.

"Another user" is uid 65534 (made by chown: the cases that need it skip without root).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import zmq
from conftest import tiny_cpu_config, write_toml
from fault_harness import CLI, RUN_TIMEOUT_S, Up, report

from dflash_ipc.data.builtin_corpus import builtin_conversations
from dflash_ipc.runtime.forkserver import SHARED_FORKSERVER_ENV

STEPS = 8
OTHER_UID = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")


def up(config: Path, run_dir: Path, *extra: str, umask: int | None = None) -> subprocess.CompletedProcess:
    """`dflash-ipc up` to its end; with ``umask``, its own fork server (the worker's shared one has the worker's umask)."""
    argv = [*CLI, "up", "--config", str(config), "--run-dir", str(run_dir), *extra]
    env = None
    if umask is not None:
        argv = ["sh", "-c", f'umask {umask:03o} && exec "$@"', "sh", *argv]
        env = {k: v for k, v in os.environ.items() if k != SHARED_FORKSERVER_ENV}
    out = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    return subprocess.run(argv, **out, timeout=RUN_TIMEOUT_S, cwd=run_dir.parent, env=env)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run (checkpoints at steps 4 and 8, its export) made under umask 000."""
    base = tmp_path_factory.mktemp("untrusted")
    data = base / "train.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in builtin_conversations(140, 256)))
    raw = tiny_cpu_config(
        data={"paths": [str(data)], "cache_dir": str(base / "cache" / "tokens"), "max_seq_len": 128, "bucket_edges": [64, 128]},
        run={"teardown_grace_s": 3.0},
        training={"checkpoint_every": 4, "max_steps": STEPS},
    )
    raw["data"]["token_budget"] = 512
    del raw["data"]["builtin_samples"]
    write_toml(base / "c.toml", raw)
    run_dir = base / ("run-" + "x" * 90)  # sockets go to /tmp/dfi-* through RUN_DIR/sock
    proc = up(base / "c.toml", run_dir, umask=0o000)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert (run_dir / "sock").is_symlink()
    return base


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the trained run directory (its config, data and cache stay where they are)."""
    src = next(trained.glob("run-*"))
    shutil.copytree(src, tmp_path / src.name, symlinks=True)
    return tmp_path / src.name


# --------------------------------------------------------------------------- item: the token cache and sockets


def test_the_token_cache_is_private_whatever_the_umask(trained):
    cache = trained / "cache" / "tokens"
    files = sorted(cache.iterdir())
    modes = ", ".join(f"{mode(f):04o}" for f in files)
    report(f"token cache under umask 000: {cache.parent.name}/ {mode(cache.parent):04o}, {cache.name}/ {mode(cache):04o}, files {modes}")
    assert mode(cache.parent) == 0o700 and mode(cache) == 0o700
    assert files and all(re.fullmatch(r"tokens-[0-9a-f]{24}\.pt", f.name) and mode(f) == 0o600 for f in files), files


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pytest.param("directory of another user", marks=needs_root),
        "directory others can write",
        pytest.param("file of another user", marks=needs_root),
    ],
)
def test_a_token_cache_another_user_could_have_written_is_refused(trained, tmp_path, case):
    cache = tmp_path / "cache"
    shutil.copytree(trained / "cache" / "tokens", cache)
    if case == "directory of another user":
        os.chown(cache, OTHER_UID, OTHER_UID)
    elif case == "directory others can write":
        cache.chmod(0o1777)
    else:
        for f in cache.iterdir():
            os.chown(f, OTHER_UID, OTHER_UID)
    proc = up(trained / "c.toml", tmp_path / "run", "--max-steps", "1", "--set", f"data.cache_dir={json.dumps(str(cache))}")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("error:")), proc.stdout[-300:])
    report(f"token cache, {case}: exit {proc.returncode}: {line[:220]}")
    assert proc.returncode == 2 and "data.cache_dir" in line and str(cache) in line, proc.stdout[-3000:]
    why = "other users can write it" if case == "directory others can write" else f"belongs to uid {OTHER_UID}"
    assert why in line and "Traceback" not in proc.stdout and "[up] started" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.slow
def test_a_socket_directory_another_user_made_is_never_used(trained, run):
    """/tmp was cleaned and another user made the directory ``RUN_DIR/sock`` names, open to all."""
    planted = Path(tempfile.mkdtemp(prefix="dfi-"))
    new_target = None
    try:
        if os.geteuid() == 0:
            os.chown(planted, OTHER_UID, OTHER_UID)
        planted.chmod(0o777)
        (run / "sock").unlink()
        (run / "sock").symlink_to(planted)
        planted_mtime = planted.stat().st_mtime_ns
        proc = up(trained / "c.toml", run, "--resume", "--max-steps", str(STEPS + 2))
        assert proc.returncode == 0, proc.stdout[-3000:]
        new_target = Path(os.readlink(run / "sock"))
        report(f"socket dir made by another user: the run used {new_target} ({mode(new_target):04o}), not {planted}")
        assert new_target != planted and os.lstat(new_target).st_uid == os.geteuid() and mode(new_target) == 0o700
        assert not new_target.is_symlink() and new_target.is_dir()
        assert os.listdir(planted) == [] and planted.stat().st_mtime_ns == planted_mtime  # no socket was ever made there
    finally:
        shutil.rmtree(planted, ignore_errors=True)
        if new_target is not None:
            shutil.rmtree(new_target, ignore_errors=True)


def test_status_never_asks_a_socket_another_user_could_have_bound(run):
    """A status socket in a socket directory open to all (made again after /tmp was cleaned) is never
    asked: `status` shows the run's last snapshot."""
    planted = Path(tempfile.mkdtemp(prefix="dfi-"))
    ctx = zmq.Context()
    try:
        planted.chmod(0o777)
        (run / "sock").unlink()
        (run / "sock").symlink_to(planted)
        impostor = ctx.socket(zmq.REP)
        impostor.bind(f"ipc://{planted / 'status'}")
        proc = subprocess.run([*CLI, "status", "--run-dir", str(run), "--json"], capture_output=True, text=True, timeout=60)
        asked = impostor.poll(0)
        impostor.close(linger=0)
        report(f"status with a socket directory open to all: exit {proc.returncode}, the socket there asked: {bool(asked)}")
        assert not asked
        assert proc.returncode == 0 and json.loads(proc.stdout)["state"] == json.loads((run / "status.json").read_text())["state"]
    finally:
        ctx.term()
        shutil.rmtree(planted, ignore_errors=True)


# --------------------------------------------------------------------------- item: planted links


#: files the run writes (at the door, while it trains, at its end), each made a link to a file of the user's
PLANTED = [
    "plan.json",
    "run_id",
    "node.json",
    "config.json",
    "metrics.jsonl",
    "logs/drafter-0.log",
    "logs/target-1.stdout",
    "export/drafter/model.safetensors",
    "checkpoints/latest",
]


@pytest.mark.slow
def test_links_planted_in_the_run_directory_are_refused_before_anything_is_written(trained, run, tmp_path):
    victims = tmp_path / "victims"
    victims.mkdir()
    for i, name in enumerate(PLANTED):
        victim = victims / f"victim-{i}"
        victim.write_text(f"the victim of {name}\n")
        (run / name).unlink()
        (run / name).symlink_to(victim)
    before = {v.name: (v.read_bytes(), v.stat().st_mtime_ns) for v in victims.iterdir()}
    proc = up(trained / "c.toml", run, "--resume", "--max-steps", str(STEPS + 2))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("error:")), proc.stdout[-300:])
    report(f"{len(PLANTED)} planted links: exit {proc.returncode}: {line[:200]}")
    assert {v.name: (v.read_bytes(), v.stat().st_mtime_ns) for v in victims.iterdir()} == before
    assert proc.returncode == 2 and f"holds {len(PLANTED)} symbolic links" in line, proc.stdout[-3000:]
    assert all(f"{name} -> {victims}" in line for name in PLANTED), line


def resumed_steps(run: Path) -> int:
    """Steps trained since the resume (metrics.jsonl lines past STEPS)."""
    path = run / "metrics.jsonl"
    return sum(1 for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] > STEPS) if path.exists() else 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["export", "checkpoints"])
def test_a_link_planted_while_the_run_trains_is_never_written_through(trained, run, tmp_path, name):
    """Once the resumed run has trained a step, ``RUN_DIR/NAME`` is moved aside and a link to a directory of
    the user's takes its place; the drafter writes there at the run's end (the last checkpoint, the export)."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("mine\n")
    proc = Up(trained / "c.toml", run, "--resume", "--max-steps", str(STEPS + 6))
    try:
        proc.wait_until(lambda: resumed_steps(run) >= 1, "a step trained after the resume")
        (run / name).rename(run / f"{name}.moved")
        (run / name).symlink_to(victim)
        code = proc.wait()
    finally:
        proc.close()
    failed = re.search(r"\[up\] FAILED: .*", proc.output)
    report(f"{name} linked away while the run trained: exit {code}: {failed.group(0)[:200] if failed else proc.output[-300:]}")
    assert sorted(os.listdir(victim)) == ["keep"] and (victim / "keep").read_text() == "mine\n"
    assert code == 1 and failed and "drafter-0" in failed.group(0), proc.output[-3000:]
    assert f"{run / name} is a symbolic link" in failed.group(0)


# --------------------------------------------------------------------------- item: the cache key


@pytest.mark.slow
def test_data_edited_in_place_keeping_size_and_mtime_is_not_trained_from_the_cache(trained, run):
    data = trained / "train.jsonl"
    original, st = data.read_bytes(), data.stat()
    at = original.index(b'"content": "') + len(b'"content": "')
    a, b = original[at : at + 1], original[at + 1 : at + 2]
    assert a != b and a.isalpha() and b.isalpha(), original[at : at + 20]
    try:
        with open(data, "r+b") as f:  # in place: same inode, same size
            f.seek(at)
            f.write(b + a)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns
        proc = up(trained / "c.toml", run, "--resume", "--max-steps", str(STEPS + 2))
    finally:
        data.write_bytes(original)
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("error:")), proc.stdout[-300:])
    report(f"data edited in place, size and mtime kept: exit {proc.returncode}: {line[:240]}")
    assert proc.returncode == 2 and "from cache" not in proc.stdout, proc.stdout[-3000:]
    assert f"{data}: its content changed (same size and modification time)" in line, line
