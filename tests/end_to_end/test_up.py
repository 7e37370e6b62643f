"""`dflash-ipc up` end to end: real processes, real sockets, real shared memory (CPU only).

Every run uses a smaller copy of configs/tiny-cpu.toml (conftest.SMALL_RUN: same model; 300
samples of <= 128 tokens in 512-token batches: 69 batches over 2 target shards, ~35 steps to exhaust
the data; 150 samples for the Ctrl-C-and-resume run). Runs that several tests read are fixtures: the full run is
the session's shared run (test_progress and test_tensorboard read it too); the others are
module-scoped.
No assertion depends on timing; timeouts are safety nets only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import SHARED_RUN_STEPS, SharedRun, free_port, small_run_config, write_toml
from prometheus_client.parser import text_string_to_metric_families

from dflash_ipc.control import channels
from dflash_ipc.control.status import decode_status
from dflash_ipc.drafter.checkpoint.store import LEDGER_FILE, META_FILE, read_latest_pointer, step_dir_name
from dflash_ipc.transport.shm_names import list_run_shm

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "dflash_ipc.cli"]
RUN_TIMEOUT_S = 240  # safety net per `up` invocation, never expected to be reached
METRIC_KEYS = {"step", "loss", "tokens", "tokens_per_s", "lr", "acc", "wait_s", "copy_s", "forward_s", "backward_s", "optimizer_s"}
METRIC_KEYS |= {"anchors"}


# --------------------------------------------------------------------------- helpers


def write_config(path: Path, raw_overrides: dict | None = None, **overrides) -> Path:
    """The SMALL_RUN config (sizes in the module docstring), plus ``section__key=value`` overrides
    and whole ``raw_overrides`` tables."""
    raw = small_run_config(**(raw_overrides or {}))
    for dotted, value in overrides.items():
        section, key = dotted.split("__")
        raw[section][key] = value
    return write_toml(path, raw)


def child_pids(output: str) -> dict[str, list[int]]:
    """Every child a supervisor started (a restart starts a new group), by name, from its output."""
    pids: dict[str, list[int]] = {}
    for line in output.splitlines():
        if line.startswith("[up] started"):
            for name, pid in re.findall(r"(\w+-\d+)@\S+ pid (\d+)", line):
                pids.setdefault(name, []).append(int(pid))
    return pids


class Up:
    """One `dflash-ipc up` supervisor, its output in a file (progress lines never block it)."""

    def __init__(self, config: Path, run_dir: Path, *extra: str, name: str = "up", own_group: bool = False, env: dict | None = None):
        self.config = config
        self.run_dir = run_dir
        self.out_path = run_dir.parent / f"{run_dir.name}.{name}.out"
        self._out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [*CLI, "up", "--config", str(config), "--run-dir", str(run_dir), *extra],
            stdout=self._out,
            stderr=subprocess.STDOUT,
            cwd=run_dir.parent,
            start_new_session=own_group,  # its own process group, like a terminal's foreground job
            env=env,
        )

    @property
    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def child_pids(self) -> dict[str, list[int]]:
        return child_pids(self.output)

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"`up` did not exit within {timeout} s (safety net); output:\n{self.output[-4000:]}")

    def wait_until(self, pred, what: str, timeout: float = RUN_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if self.proc.poll() is not None:
                pytest.fail(f"`up` exited ({self.proc.returncode}) before {what}; output:\n{self.output[-4000:]}")
            if time.monotonic() > deadline:
                self.kill_all()
                pytest.fail(f"timed out waiting for {what}; output:\n{self.output[-4000:]}")
            time.sleep(0.05)

    def steps_logged(self) -> int:
        return len(read_metrics(self.run_dir)) if (self.run_dir / "metrics.jsonl").exists() else 0

    def kill_all(self) -> None:
        """Safety net for a failing test: end this supervisor and the children it started (by pid)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in (p for ps in self.child_pids().values() for p in ps):
            if _is_pipeline_process(pid):
                psutil.Process(pid).kill()

    def close(self) -> None:
        self.kill_all()
        self._out.close()


def _is_pipeline_process(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and "dflash-ipc:" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def read_ledger(ckpt: Path) -> set[tuple[int, ...]]:
    return {tuple(i) for i in json.loads((ckpt / LEDGER_FILE).read_text())["ids"]}


def latest_checkpoint(run_dir: Path) -> Path:
    name = read_latest_pointer(run_dir / "checkpoints")
    assert name, f"no checkpoint under {run_dir}/checkpoints"
    return run_dir / "checkpoints" / name


def checkpoint_step(ckpt: Path) -> int:
    return json.loads((ckpt / META_FILE).read_text())["step"]


def status_cli(run_dir: Path, *flags: str) -> str:
    r = subprocess.run([*CLI, "status", "--run-dir", str(run_dir), *flags], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def assert_no_leftovers(up: Up | SharedRun, started_children: bool = True) -> None:
    """No process of the run alive (pids from the output and status.json), no shm segment left."""
    pids = {p for ps in child_pids(up.output).values() for p in ps}
    assert bool(pids) == started_children, up.output
    status = json.loads((up.run_dir / "status.json").read_text())
    pids |= {p["pid"] for p in status["processes"] if p["pid"]}
    alive = [pid for pid in pids if _is_pipeline_process(pid)]
    assert not alive, f"processes of the run still alive: {alive}"
    run_id = (up.run_dir / "run_id").read_text().strip()
    assert list_run_shm(run_id) == []


def plan_ids(run_dir: Path) -> set[tuple[int, int, int]]:
    plan = json.loads((run_dir / "plan.json").read_text())
    return {(0, s, i) for s, n in enumerate(plan["n_batches_per_shard"]) for i in range(n)}


def corpus_tokens(output: str) -> int:
    """Real tokens of the whole corpus, from the supervisor's `[up] data: N samples, T tokens` line."""
    m = re.search(r"\[up\] data: \d+ samples, (\d+) tokens", output)
    assert m, output
    return int(m.group(1))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("up")


@pytest.fixture(scope="module")
def started():
    """Every Up started by this module; anything left running at the end is killed (by pid)."""
    ups: list[Up] = []
    yield ups
    for up in ups:
        up.close()


# --------------------------------------------------------------------------- 1. a full run

FULL_STEPS = SHARED_RUN_STEPS
# Which way the follow-wait budget (conftest.FOLLOW_WAIT) moves depends on this machine's speed;
# that it starts at 32, moves a chunk of 16 at a time and logs each move does not.
FIRST_DECISION_STEP = 4 + 2 + 2  # transport.ring_slots + 2 settle steps, then one window


def test_full_run_trains_checkpoints_and_exports(shared_run):
    """The session's shared run (conftest.shared_run; test_progress and test_tensorboard read it too)."""
    up = shared_run
    out, run_dir = up.output, up.run_dir
    assert up.returncode == 0, out
    # a CPU topology forks its children from the preloading server (run.launcher = "auto"), and says so
    assert re.search(r"^\[up\] fork server \(run.launcher\) ready after \d+\.\d s", out, re.M), out

    recs = read_metrics(run_dir)
    assert [r["step"] for r in recs] == list(range(1, FULL_STEPS + 1))
    for r in recs:
        assert METRIC_KEYS <= set(r), METRIC_KEYS - set(r)
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["lr"] > 0
        assert all(r[k] >= 0 for k in ("wait_s", "copy_s", "forward_s", "backward_s", "optimizer_s"))
    losses = [r["loss"] for r in recs]
    assert sum(losses[:3]) / 3 > sum(losses[-3:]) / 3, losses
    anchors = [r["anchors"] for r in recs]
    assert anchors[:FIRST_DECISION_STEP] == [32] * FIRST_DECISION_STEP, anchors
    assert set(anchors) <= {32, 48, 64} and all(abs(b - a) in (0, 16) for a, b in zip(anchors, anchors[1:])), anchors
    moves = [(str(a), str(b)) for a, b in zip(anchors, anchors[1:]) if a != b]
    drafter_log = (run_dir / "logs" / "drafter-0.log").read_text()
    assert "warm-up: one forward+backward on a dummy 512-token batch" in drafter_log  # conftest.shared_run warms up
    logged = re.findall(r"anchors per batch (\d+) -> (\d+): wait \d+% over the last 2 steps", drafter_log)
    assert logged[: len(moves)] == moves and len(logged) - len(moves) in (0, 1), (logged, moves)  # + 1: a move after the last step

    ckpt = run_dir / "checkpoints" / step_dir_name(FULL_STEPS)
    assert (ckpt / META_FILE).is_file() and checkpoint_step(ckpt) == FULL_STEPS
    # the run's config rides in the checkpoint, so `up --resume` can name the keys a later config changed
    assert json.loads((ckpt / META_FILE).read_text())["extra"]["config"] == json.loads((run_dir / "config.json").read_text())["config"]
    assert latest_checkpoint(run_dir) == ckpt
    export = run_dir / "export" / "drafter"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()

    # the final summary
    assert f"[up] finished (max_steps {FULL_STEPS})" in out
    assert re.search(rf"steps {FULL_STEPS}, loss {losses[0]:.4f} -> {losses[-1]:.4f}", out), out[-2000:]
    assert re.search(r"\d+ tokens/s", out)
    assert f"checkpoint: {ckpt}" in out
    assert f"exported drafter: {export}" in out
    # the model checks, tokenizing and planning ran in the probe process: the supervisor stays lean
    assert f"[up] debug: supervisor pid {up.pid} imported: neither torch nor transformers" in out, out[-2000:]

    # private directories
    for d in (run_dir, channels.socket_dir(run_dir)):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    assert_no_leftovers(up)


def test_up_states_the_limit_after_planning(shared_run):
    assert shared_run.returncode == 0, shared_run.output[-4000:]
    # conftest.shared_run: `up --max-steps SHARED_RUN_STEPS` over data that lasts longer
    found = re.search(r"^\[up\] run length: (.*)$", shared_run.output, re.M)
    assert found, shared_run.output[-4000:]
    assert found.group(1).startswith(f"training.max_steps = {SHARED_RUN_STEPS} ends the run; the data lasts about ")


def test_resuming_a_finished_run_trains_nothing_more(shared_run, started):
    """What systemd's Restart= does to a finished run: exit 0, no step beyond max_steps."""
    up = shared_run
    assert up.returncode == 0
    ckpt = latest_checkpoint(up.run_dir)
    meta_before = (ckpt / META_FILE).read_text()
    again = Up(up.config, up.run_dir, "--max-steps", str(FULL_STEPS), "--resume", name="again")
    started.append(again)
    assert again.wait() == 0, again.output
    # decided from the checkpoint before any process starts: no probe, no children
    assert f"[up] finished already: the checkpoint is at step {FULL_STEPS}, training.max_steps is {FULL_STEPS}" in again.output
    assert "[up] started" not in again.output and "[up] data:" not in again.output, again.output
    assert [r["step"] for r in read_metrics(up.run_dir)] == list(range(1, FULL_STEPS + 1))
    assert latest_checkpoint(up.run_dir) == ckpt and (ckpt / META_FILE).read_text() == meta_before
    assert_no_leftovers(again, started_children=False)


def test_status_after_the_run_reads_status_json(shared_run):
    up = shared_run
    assert up.returncode == 0
    snap = json.loads(status_cli(up.run_dir, "--json"))
    decode_status(snap)  # every field present and well typed
    assert snap["state"] == "finished" and snap["end_reason"] == f"max_steps {FULL_STEPS}"
    assert snap["totals"]["step"] == FULL_STEPS
    assert sorted((p["role"], p["rank"]) for p in snap["processes"]) == [("drafter", 0), ("drafter", 1), ("target", 0), ("target", 1)]
    assert all(p["exit_code"] == 0 for p in snap["processes"]), snap["processes"]
    # exited: nothing live is left (no heartbeat age, slots, queue, memory), drafters keep their last step
    for p in snap["processes"]:
        assert p["state"] == "exited" and p["heartbeat_age_s"] is None and p["slots"] is None and p["rss_bytes"] is None, p
        assert p["inflight_per_drafter"] is None and p["queue_depth"] is None and p["busy_pct"] is None, p
    assert {p["step"] for p in snap["processes"] if p["role"] == "drafter"} == {FULL_STEPS}
    table = status_cli(up.run_dir)
    assert "FINISHED" in table and f"ended    max_steps {FULL_STEPS}" in table and "exited 0" in table, table


# --------------------------------------------------------------------------- 2 + 3. live status and metrics, Ctrl-C, resume


@pytest.fixture(scope="module")
def stopped_and_resumed(work, started):
    """Run until the data is exhausted, stop it with a Ctrl-C once step 3 is logged, then
    `up --resume` to the end. Half the module's samples (~17 steps to the data's end): the stop
    still lands well before it, and the resumed run has half as far to go. The first run sets
    run.metrics_port and training.checkpoint_on_finish = false; while it trains, GET /metrics,
    `status --json | tail -1` and `status --prometheus` are read; the Ctrl-C is SIGINT to the whole
    process group, children included, as a terminal sends it; the endpoint is tried again after
    the run ended."""
    import urllib.request

    port = free_port()
    cfg = write_config(work / "resume.toml", data__builtin_samples=150)
    endpoint = {"run__metrics_port": port, "training__checkpoint_on_finish": False}
    first_cfg = write_config(work / "resume-first.toml", data__builtin_samples=150, **endpoint)
    run_dir = work / "resume"
    first = Up(first_cfg, run_dir, name="first", own_group=True)
    started.append(first)
    first.wait_until(lambda: first.steps_logged() >= 3, "step 3")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        http_status, http_text = r.status, r.read().decode()
    # the shell idiom the README promises: the last line is the whole JSON object
    live_json = subprocess.run(
        f"{sys.executable} -m dflash_ipc.cli status --run-dir {run_dir} --json | tail -1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    live_prom = status_cli(run_dir, "--prometheus")
    os.killpg(first.proc.pid, signal.SIGINT)
    first_code = first.wait()
    first_status = (status_cli(run_dir, "--json"), status_cli(run_dir))
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
        after: OSError | None = None
    except OSError as e:  # urllib.error.URLError is an OSError
        after = e
    first_metrics = read_metrics(run_dir)
    ckpt1 = latest_checkpoint(run_dir)
    ledger1 = read_ledger(ckpt1)
    first_target_logs = {r: (run_dir / "logs" / f"target-{r}.log").read_text() for r in range(2)}

    second = Up(cfg, run_dir, "--resume", name="second")
    started.append(second)
    second_code = second.wait()
    return dict(
        first=first,
        second=second,
        first_code=first_code,
        second_code=second_code,
        port=port,
        http_status=http_status,
        http_text=http_text,
        after=after,
        live_json=live_json,
        live_prom=live_prom,
        first_metrics=first_metrics,
        ckpt1=ckpt1,
        ledger1=ledger1,
        first_target_logs=first_target_logs,
        first_status=first_status,
    )


def test_status_while_running(stopped_and_resumed):
    r = stopped_and_resumed
    snap = json.loads(r["live_json"].splitlines()[-1])  # the JSON object is the last line
    decode_status(snap)
    assert snap["state"] == "running"
    procs = {(p["role"], p["rank"]): p for p in snap["processes"]}
    assert sorted(procs) == [("drafter", 0), ("drafter", 1), ("target", 0), ("target", 1)]
    pids = r["first"].child_pids()
    for (role, rank), p in procs.items():
        assert [p["pid"]] == pids[f"{role}-{rank}"]
        assert p["exit_code"] is None and p["state"] != "exited"
    assert snap["totals"]["step"] >= 1

    fams = {f.name: f for f in text_string_to_metric_families(r["live_prom"])}
    assert {s.labels["state"]: s.value for s in fams["dflash_ipc_state"].samples}["running"] == 1.0
    by_proc = {
        name: {(s.labels["role"], int(s.labels["rank"])): s.value for s in fams[name].samples}
        for name in ("dflash_ipc_process_up", "dflash_ipc_process_pid")
    }
    for role, rank in procs:
        assert by_proc["dflash_ipc_process_up"][(role, rank)] == 1.0
        assert [int(by_proc["dflash_ipc_process_pid"][(role, rank)])] == pids[f"{role}-{rank}"]
    (step,) = [s.value for s in fams["dflash_ipc_process_step"].samples if s.labels["role"] == "drafter" and s.labels["rank"] == "0"]
    assert step >= 1


def test_a_stopped_run_reads_stopped_at_its_step_not_finished(stopped_and_resumed):
    r = stopped_and_resumed
    snap_json, table = r["first_status"]
    snap = json.loads(snap_json)
    decode_status(snap)
    stop_step = r["first_metrics"][-1]["step"]
    assert snap["state"] == "stopped" and snap["end_reason"] == f"SIGINT at step {stop_step}", snap
    assert all(p["state"] == "exited" and p["heartbeat_age_s"] is None for p in snap["processes"]), snap["processes"]
    assert "STOPPED" in table and f"ended    SIGINT at step {stop_step}" in table and "FINISHED" not in table, table
    assert "[up] stopped (" in r["first"].output and "resume with --resume" in r["first"].output


def test_ctrl_c_checkpoints_and_resume_consumes_every_batch_once(stopped_and_resumed):
    r = stopped_and_resumed
    first, second = r["first"], r["second"]
    run_dir = first.run_dir
    assert r["first_code"] == 0, first.output
    assert "SIGINT: asking drafters to checkpoint and stop" in first.output

    # a fresh checkpoint at the step the first run stopped at
    stop_step = r["first_metrics"][-1]["step"]
    assert [m["step"] for m in r["first_metrics"]] == list(range(1, stop_step + 1))
    assert checkpoint_step(r["ckpt1"]) == stop_step
    assert "SIGINT" in json.loads((r["ckpt1"] / META_FILE).read_text())["extra"]["reason"]
    all_ids = plan_ids(run_dir)
    assert 0 < len(r["ledger1"]) < len(all_ids), "the Ctrl-C landed after the data was exhausted"
    assert r["ledger1"] <= all_ids

    # the resumed run continues from there and exhausts the data
    assert r["second_code"] == 0, second.output
    recs = read_metrics(run_dir)
    final_step = recs[-1]["step"]
    assert [m["step"] for m in recs] == list(range(1, final_step + 1)), "metrics steps do not continue"
    assert final_step > stop_step
    assert "[up] finished (data exhausted)" in second.output
    # `up` says where it resumed, and rates this invocation's steps only
    assert f"[up] resumed from {r['ckpt1']} (step {stop_step})" in second.output, second.output
    session_tokens = sum(m["tokens"] for m in recs if m["step"] > stop_step)
    assert f"this invocation (resumed at step {stop_step}): {final_step - stop_step} steps, {session_tokens} target tokens" in second.output
    ckpt2 = latest_checkpoint(run_dir)
    assert checkpoint_step(ckpt2) == final_step

    # every target skipped exactly the ledgered batches of its shard
    for rank in range(2):
        log = (run_dir / "logs" / f"target-{rank}.log").read_text()[len(r["first_target_logs"][rank]) :]
        m = re.findall(r"schedule: (\d+) batches planned, (\d+) already consumed \(ledger\), (\d+) to run", log)
        assert len(m) == 1, log
        # the target names its forward and its elementwise kernels ("auto" on this CPU: eager)
        assert re.search(r"forward (padded|packed \(varlen\)) \(.*\); elementwise eager", log), log
        planned, consumed, to_run = map(int, m[0])
        mine = sum(1 for bid in r["ledger1"] if bid[1] == rank)
        assert planned == sum(1 for bid in all_ids if bid[1] == rank)
        assert (consumed, to_run) == (mine, planned - mine)

    # none skipped: the final ledger holds every planned batch, and it extends the first one
    ledger2 = read_ledger(ckpt2)
    assert ledger2 == all_ids
    assert r["ledger1"] <= ledger2
    # none trained twice: the tokens trained over both runs are exactly the corpus' tokens once
    assert corpus_tokens(second.output) == corpus_tokens(first.output)
    assert sum(m["tokens"] for m in recs) == corpus_tokens(first.output)
    assert_no_leftovers(second)


# --------------------------------------------------------------------------- 4. a child killed: tests/faults/test_crash_anywhere.py


# --------------------------------------------------------------------------- 5. restart after a failure: tests/faults/test_run_lock.py
# (its live run is started with --max-restarts 1 and loses drafter-1 to SIGKILL after a checkpoint)


# --------------------------------------------------------------------------- 6. bad configs


@pytest.mark.parametrize(
    "section, key, value, expect",
    [
        ("transport", "ring_slotz", 4, "unknown key; did you mean 'ring_slots'?"),
        ("data", "token_budget", "lots", "must be an integer"),
    ],
)
def test_bad_config_is_refused_before_anything_starts(tmp_path, section, key, value, expect):
    cfg = write_config(tmp_path / "bad.toml", raw_overrides={section: {key: value}})
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [*CLI, "up", "--config", str(cfg), "--run-dir", str(run_dir)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{cfg}: {section}.{key}: " in r.stderr and expect in r.stderr, r.stderr
    assert not run_dir.exists()
    assert "[up] started" not in r.stdout


# --------------------------------------------------------------------------- 7. handshake timeout


def test_handshake_timeout_names_the_setting_and_leaves_no_process(work, started):
    # exec: each child imports torch for seconds, longer than the 0.5 s timeout (forked children can be
    # ready within it); this is also the run of `up` on the launcher that CUDA topologies use
    cfg = write_config(work / "hs.toml", run__handshake_timeout_s=0.5, run__teardown_grace_s=0.1, run__launcher="exec")
    up = Up(cfg, work / "hs")
    started.append(up)
    code = up.wait()
    out = up.output
    assert code != 0, out
    assert "handshake timed out" in out and "run.handshake_timeout_s" in out, out
    assert "fork server" not in out, out  # exec: every child a new Python
    assert len(up.child_pids()) == 4
    snap = json.loads(status_cli(work / "hs", "--json"))
    assert snap["state"] == "failed" and "handshake timed out" in snap["end_reason"], snap
    assert_no_leftovers(up)


# --------------------------------------------------------------------------- metrics endpoint, status --json | tail -1


def test_metrics_endpoint_and_json_last_line_during_a_run(stopped_and_resumed):
    """GET /metrics on run.metrics_port while a real run trains; `status --json | tail -1` is the JSON."""
    r = stopped_and_resumed
    up, port, text = r["first"], r["port"], r["http_text"]
    assert r["http_status"] == 200
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    up_samples = {(s.labels["role"], s.labels["rank"]): s.value for s in fams["dflash_ipc_process_up"].samples}
    assert up_samples == {("target", "0"): 1.0, ("target", "1"): 1.0, ("drafter", "0"): 1.0, ("drafter", "1"): 1.0}, text
    pids = up.child_pids()
    for s in fams["dflash_ipc_process_pid"].samples:
        assert [int(s.value)] == pids[f"{s.labels['role']}-{s.labels['rank']}"]
    assert {s.labels["state"]: s.value for s in fams["dflash_ipc_state"].samples}["running"] == 1.0
    assert [s.value for s in fams["dflash_ipc_supervisor_pid"].samples] == [float(up.proc.pid)]

    snap = decode_status(json.loads(r["live_json"]))
    assert snap.state == "running" and sorted((p.role, p.rank) for p in snap.processes) == [
        ("drafter", 0),
        ("drafter", 1),
        ("target", 0),
        ("target", 1),
    ]

    assert r["first_code"] == 0, up.output
    assert f"[up] metrics: http://127.0.0.1:{port}/metrics" in up.output
    assert isinstance(r["after"], OSError), "the endpoint still answered after the run ended"
    assert_no_leftovers(up)


def test_ctrl_c_without_final_checkpoint_setting_still_checkpoints_on_every_rank(stopped_and_resumed):
    """training.checkpoint_on_finish = false (benchmarks) must not split the drafters at a
    requested stop: the checkpoint is collective, so every rank takes the same branch. The stop
    is a Ctrl-C to the process group: the targets get SIGINT too and exit cleanly while the
    drafters checkpoint, which is no failure (before: "FAILED: target-0 ... exit code 0")."""
    r = stopped_and_resumed
    up = r["first"]
    assert r["first_code"] == 0, up.output
    assert "SIGINT: asking drafters to checkpoint and stop" in up.output and "FAILED" not in up.output
    stop_step = r["first_metrics"][-1]["step"]
    assert stop_step >= 3
    assert checkpoint_step(r["ckpt1"]) == stop_step
    assert_no_leftovers(up)
