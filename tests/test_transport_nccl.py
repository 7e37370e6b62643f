"""The ``nccl`` transport on CPU (gloo, the same code path as NCCL on GPUs), end to end.

* ``dflash-ipc up`` with ``transport.backend = "nccl"``: real target and drafter processes, one
  two-rank pair group per target-drafter pair, every planned batch trained exactly once.
* ``dflash-ipc bench transport --backend nccl`` on CPU: verified slots between real processes,
  several producers and consumers (the cpu-shm harness of tests/test_transport_procs.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_up, tiny_cpu_config, write_toml

from dflash_ipc.bench import transport as bench_transport
from dflash_ipc.drafter.checkpoint import LEDGER_FILE, read_latest_pointer

REPO = Path(__file__).resolve().parents[1]


def _small_config(path: Path, **sections) -> Path:
    raw = tiny_cpu_config(
        data={"builtin_samples": 120, "max_seq_len": 256, "bucket_edges": [64, 128, 256], "token_budget": 1024},
        run={"teardown_grace_s": 3.0},
        transport={"backend": "nccl"},
        training={"checkpoint_every": 0, "max_steps": 0, "checkpoint_on_finish": True, "export_on_finish": False},
    )
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    return write_toml(path, raw)


def _plan_ids(run_dir: Path) -> list[tuple[int, int, int]]:
    plan = json.loads((run_dir / "plan.json").read_text())
    return sorted((0, s, i) for s, n in enumerate(plan["n_batches_per_shard"]) for i in range(n))


def _ledger(run_dir: Path) -> list[tuple[int, ...]]:
    name = read_latest_pointer(run_dir / "checkpoints")
    assert name, f"no checkpoint under {run_dir}/checkpoints"
    return sorted(tuple(i) for i in json.loads((run_dir / "checkpoints" / name / LEDGER_FILE).read_text())["ids"])


@pytest.mark.slow
def test_up_with_the_nccl_transport_trains_every_planned_batch_once(tmp_path):
    cfg = _small_config(tmp_path / "nccl.toml")
    run_dir = tmp_path / "run"
    proc = run_up(cfg, run_dir, 0, REPO)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:]
    assert "finished (data exhausted)" in out, out[-2000:]
    logs = "".join(p.read_text() for p in (run_dir / "logs").glob("target-*.log"))
    assert re.search(r"ring: nccl \(transport\.backend\), 4 slots", logs), logs[-2000:]
    planned = _plan_ids(run_dir)
    ledger = _ledger(run_dir)
    assert len(planned) > 4
    assert ledger == planned  # sorted lists: no batch twice, none missing


def test_bench_ring_nccl_over_gloo_two_by_two_verified(tmp_path, monkeypatch):
    """Two producer and two consumer processes: four pair groups, least-busy routing, every slot
    verified after its receive completed, every slot back at its producer at the end."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    args = bench_transport.BenchArgs(backend="nccl", producers=2, consumers=2, slots=3, slot_mib=0.25, seconds=1.5)
    res = bench_transport.run_ring(args, 1 << 18, args.seconds)
    summ = res["summaries"]
    ring = bench_transport._ring_result(res, args)
    assert ring["verified"] is True and ring["rejected"] == 0, ring
    assert all(n > 0 for n in ring["per_consumer_slots"]), ring
    for p in range(2):
        ps = summ[("producer", p)]
        slots = ps.plane.slots
        assert ps.rejected == 0 and slots.ready == 0 and slots.queued == 0 and slots.free == args.slots
        # every slot was reused, and each batch sent was received and verified by exactly one consumer
        assert ps.batches > 2 * args.slots
        assert ps.batches == sum(summ[("consumer", c)].per_producer[p] for c in range(2))
