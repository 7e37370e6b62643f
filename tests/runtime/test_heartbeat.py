"""Heartbeats on their own clock (runtime/heartbeat.py): a real child process under run_child,
a real supervisor ROUTER socket (test_child's), and the supervisor's own two rules
(``liveness.silent_child``: no heartbeat for run.heartbeat_timeout_s; ``liveness.stalled_child``:
heartbeats whose loop age passed run.stall_timeout_s) applied to what arrives.

* A loop busy for longer than the heartbeat timeout (here a pure-Python loop holding the GIL
  between switches, as a compiling first step does) still heartbeats: never silent, and its
  loop age says how long it has been busy.
* A loop truly stuck afterwards (blocked for good) still heartbeats, and the stall rule names it.
"""

from __future__ import annotations

import time

import pytest
from test_child import FakeSupervisor, _wait_for, role_processes

from dflash_ipc.control.protocol import Heartbeat
from dflash_ipc.runtime import liveness
from dflash_ipc.runtime.children import Child

INTERVAL_S = 0.1
HEARTBEAT_TIMEOUT_S = 0.5  # 5 intervals; the busy loop runs 3x as long
BUSY_S = 1.5

ROLE_SCRIPT = f"""
import sys, threading, time
from dflash_ipc.control import channels
from dflash_ipc.control.protocol import Heartbeat
from dflash_ipc.control.stats import DrafterStats, DrafterWork, Vitals
from dflash_ipc.runtime.child import Placement, run_child

def main_fn(child):
    out = child.run_dir / "out"
    stats = DrafterStats(Vitals("running", 0.0, 0, 0, {{}}), DrafterWork(step=0, loss=None, acc=None, tau=None, tokens_per_s=0.0,
                         tokens=0, params=1, train_elapsed_s=None, gpu=None), queue_depth=0, outstanding=0, copying=0, wait_pct=0.0,
                         slots_per_target=[0])
    child.start_heartbeats({INTERVAL_S})
    child.report(Heartbeat(role="drafter", rank=0, drafter=stats))
    child.progressed()
    (out / "busy").write_text("1")
    deadline = time.monotonic() + {BUSY_S}
    n = 0
    while time.monotonic() < deadline:  # one long iteration of the loop: Python work, the GIL held between switches
        n = (n * 31 + 7) % 1000003
    child.progressed()
    (out / "stuck").write_text("1")
    threading.Event().wait()  # then an iteration that never ends (a deadlock)
    return 0

sys.exit(run_child("drafter", main_fn, place=lambda a: Placement("cpu", 1), pull_endpoint=channels.drafter_endpoint))
"""


@pytest.fixture
def child(tmp_path, shared_forkserver):
    with role_processes(tmp_path, ROLE_SCRIPT, shared_forkserver) as started:
        yield started


def beats_until(sup: FakeSupervisor, record: Child, until, timeout_s: float = 60.0) -> list[tuple[float, Heartbeat]]:
    """Heartbeats as the supervisor records them (last_beat, loop_age_s), until ``until()``."""
    got = []
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "safety net: the child never got there"
        msg = sup.recv()
        assert isinstance(msg, Heartbeat) and (msg.role, msg.rank) == ("drafter", 0)
        record.last_beat, record.loop_age_s = time.monotonic(), msg.loop_age_s
        got.append((record.last_beat, msg))
        assert liveness.silent_child([record], time.monotonic(), HEARTBEAT_TIMEOUT_S) is None
    return got


def test_a_loop_busy_longer_than_the_heartbeat_timeout_still_heartbeats_and_a_stalled_one_is_caught(child):
    """One child (its start-up, torch imported by run_child, is the expensive part): a loop busy
    3x the heartbeat timeout, then a loop stuck for good."""
    start, sup, run_dir = child
    proc = start()
    record = Child("drafter", 0, "cpu", popen=proc)
    _wait_for(run_dir / "out" / "busy", proc)
    busy = beats_until(sup, record, lambda: (run_dir / "out" / "stuck").exists())
    ages = [msg.loop_age_s for _, msg in busy]
    assert max(ages) > HEARTBEAT_TIMEOUT_S, f"the loop was busy {BUSY_S} s; loop ages seen: {ages}"
    assert liveness.stalled_child([record], time.monotonic(), 10 * BUSY_S) is None  # busy within the stall timeout

    stall_timeout_s = 0.75
    beats_until(sup, record, lambda: record.loop_age_s > stall_timeout_s)  # beats go on: never silent
    blamed, text = liveness.stalled_child([record], time.monotonic(), stall_timeout_s)
    assert blamed is record
    assert "drafter-0" in text and "made no progress" in text and "run.stall_timeout_s = 0.75" in text
