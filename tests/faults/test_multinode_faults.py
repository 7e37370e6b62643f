"""Two `dflash-ipc up` processes on localhost as two nodes (gloo): node 0, which serves the supervisors' store, hangs.

A hang: every process of one node (its supervisor and each child of it) is SIGSTOPped mid-training.
The other node must end non-zero naming the hung node ("node 1 missed heartbeats", or "lost node 0"
when the hung node serves the supervisors' store), tear its own processes down and sweep its shared
memory. Then the stopped node is SIGKILLed, continued and reaped.

Node 1 hanging, after the nodes restarted together (--max-restarts), is tested in tests/end_to_end/test_multinode.py.
Helpers come from tests/end_to_end/test_multinode.py. Timeouts are safety nets; the measured detection times
are printed as ``NODES:`` lines (pytest -s).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from end_to_end.test_multinode import hang_node, run_both, wait_training, write_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("hung_rank", [0], ids=["node0-the-store-hangs"])
def test_a_hung_node_ends_the_run_on_the_other(tmp_path: Path, hung_rank: int) -> None:
    """Node 1 hanging is tested after a restart, in tests/end_to_end/test_multinode.py."""
    config = write_config(tmp_path / "two-nodes.toml", num_epochs=40, checkpoint_every=2, max_steps=400)
    shared = tmp_path / "shared"
    nodes = run_both(tmp_path, config, shared)
    try:
        wait_training(nodes, shared)
    except BaseException:
        for n in nodes:
            n.proc.kill()
            n.proc.wait()
        raise
    hang_node(nodes, hung_rank)
