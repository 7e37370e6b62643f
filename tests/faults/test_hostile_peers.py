"""Hostile peers: a process without the run key sends every shape of bad
message into every socket of a live run (supervisor ROUTER, status REP, each target's and each
drafter's PULL), from before the handshake into training (until its frame budget is spent, within
the first steps, or training ends). The run must still train
every planned batch exactly once, exit 0, count what it refused (``status --json``), and leave
nothing behind.

The run moves its slots with ``transport.backend = "nccl"`` (gloo on CPU: one two-rank pair group
per target-drafter pair, the code path of NCCL on GPUs), so the same run is the nccl transport's
end-to-end test (tests/transport/test_transport_nccl.py has its ring harness): the control sockets are the
same whatever moves the slots, and every planned batch trained exactly once is what both assert.

Before: a two-part message to sock/sup ended the supervisor (ValueError: too many values to
unpack), a forged EndOfData made the run "finish" with 0 batches trained, a forged SlotReady
crashed a drafter, a Dead from an unknown identity during the handshake ended the run, and a
two-part status request broke the REP socket.
"""

from __future__ import annotations

import json
import re
import time

import pytest
from fault_harness import FULL, HostilePeer, Up, leftovers, rejected_total, report, status_json, write_config

from dflash_ipc.control import channels
from dflash_ipc.drafter.checkpoint.store import LEDGER_FILE, read_latest_pointer

pytestmark = pytest.mark.slow


def _plan_ids(run_dir) -> set[tuple[int, int, int]]:
    plan = json.loads((run_dir / "plan.json").read_text())
    return {(0, s, i) for s, n in enumerate(plan["n_batches_per_shard"]) for i in range(n)}


def test_hostile_frames_into_every_socket_are_counted_and_the_run_trains_every_batch_once(tmp_path):
    seed = 1515
    target_frames = 20000 if FULL else 10000
    # 100 samples (10 steps, 20 batches): the frame budget is spent within the first step anyway, and
    # "every planned batch once" needs batches after the attack, not 30 steps of them
    data = {"builtin_samples": 100}
    cfg = write_config(tmp_path / "c.toml", data=data, training={"checkpoint_on_finish": True}, transport={"backend": "nccl"})
    run_dir = tmp_path / "run"
    up = Up(cfg, run_dir)
    peer = None
    try:
        sup_sock = lambda: (channels.socket_dir(run_dir) / "sup").exists() if (run_dir / "sock").exists() else False  # noqa: E731
        up.wait_until(sup_sock, "the supervisor socket", poll_s=0.005)
        peer = HostilePeer(run_dir, 2, 2, seed)
        peer.connect()
        # During the handshake: multi-part, forged Dead/Hello/Ready from a member's name, garbage.
        while "all 4 processes ready" not in up.output and up.proc.poll() is None:
            if peer.sent < target_frames // 5:  # the rest goes to every socket once the data plane is up
                peer.burst(include_data_plane=False)
            time.sleep(0.05)
        answered = peer.status_requests()
        # While training: every socket, until the frame budget is spent (or training ends).
        while peer.sent < target_frames and up.proc.poll() is None:
            peer.burst()
            time.sleep(0.002)
        rc_status, snap = status_json(run_dir)
        code = up.wait()
    finally:
        if peer is not None:
            peer.close()
        up.close()
    out = up.output
    assert code == 0, out[-4000:]
    assert "finished" in out
    assert answered == 3  # every bad status request got an (error) reply; the REP socket still works
    assert rc_status == 0 and snap is not None, "status --json failed while the run was up"
    # exactly once: the final checkpoint's ledger is every planned batch, no duplicate
    ckpt = run_dir / "checkpoints" / read_latest_pointer(run_dir / "checkpoints")
    ids = [tuple(i) for i in json.loads((ckpt / LEDGER_FILE).read_text())["ids"]]
    assert len(ids) == len(set(ids)) and set(ids) == _plan_ids(run_dir) and len(ids) > 4
    assert "finished (data exhausted)" in out, out[-2000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("target-*.log"))
    assert re.search(r"ring: nccl \(transport\.backend\), 4 slots", logs), logs[-2000:]
    final = json.loads((run_dir / "status.json").read_text())
    rejected = rejected_total(final)
    sup_kinds = final["supervisor_rejected_by_kind"]
    report(
        f"hostile peers (seed {seed}): {peer.sent} frames sent, {rejected} rejected and counted "
        f"(supervisor {sum(sup_kinds.values())}: {sup_kinds}; processes: "
        f"{ {p['role'] + '-' + str(p['rank']): p['rejected_messages'] for p in final['processes']} })"
    )
    assert peer.sent >= 10000 or "finished" in out
    # the supervisor refused them all: no intruder holds a member's routing identity (derived
    # from the run key), so every frame, whatever its shape, is from an unexpected peer
    for kind in ("unexpected_peer", "bad_status_request"):
        assert sup_kinds.get(kind, 0) > 0, (kind, sup_kinds)
    for p in final["processes"]:
        assert p["rejected_messages"] > 0, p  # every target and drafter was hit and counted
        assert p["rejected_by_kind"].get("bad_auth", 0) + p["rejected_by_kind"].get("bad_frame_count", 0) > 0, p
    # every frame that reached a socket was counted (ZeroMQ may drop some at the high-water mark)
    assert 0 < rejected <= peer.sent
    assert leftovers(up) == []
