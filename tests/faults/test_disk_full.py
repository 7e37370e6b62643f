"""A checkpoint on a full disk: named as such, and the previous checkpoint stays loadable.

The run directory is a real 4 MiB tmpfs (mounting needs root and CAP_SYS_ADMIN; the tests skip
without them), so the writers fail the way they do on a full disk: torch.save with "enforce fail
... unexpected pos", safetensors with "IoError ... StorageFull".
"""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest
import torch

from dflash_ipc.drafter.checkpoint.store import (
    BatchLedger,
    CheckpointDiskFull,
    _free_bytes,
    _is_disk_full,
    load_latest_checkpoint,
    read_latest_pointer,
    save_checkpoint,
)

FS_BYTES = 4 << 20


@pytest.fixture
def run_dir(tmp_path):
    """RUN_DIR on a 4 MiB tmpfs, unmounted afterwards."""
    mnt = tmp_path / "run"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs", str(mnt)], check=False, capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def save(root: Path, step: int, *, model_floats: int = 25_000, rng: object = None) -> Path:
    torch.manual_seed(step)
    return save_checkpoint(
        root,
        step,
        model_state={"w": torch.randn(model_floats)},
        trainer_state={"step": step, "exp_avg": torch.randn(25_000)},
        rng_state=rng,
        ledger=BatchLedger([(0, 0, i) for i in range(step)]),
    )


def assert_previous_intact(root: Path) -> None:
    assert read_latest_pointer(root) == "step-000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]  # no .tmp-* left behind
    ckpt = load_latest_checkpoint(root)
    torch.manual_seed(1)
    assert ckpt is not None and ckpt.step == 1 and ckpt.notes == []
    assert torch.equal(ckpt.model_state["w"], torch.randn(25_000))


def test_checkpoint_larger_than_free_space_is_refused_up_front(run_dir):
    root = run_dir / "checkpoints"
    save(root, 1)
    with pytest.raises(CheckpointDiskFull) as ei:
        save(root, 2, model_floats=2_000_000)  # 8 MB of weights on a 4 MiB file system
    msg = str(ei.value)
    assert msg.startswith(f"no space left on RUN_DIR ({run_dir}) writing checkpoint step 2: need ~8.7 MiB (9148640 bytes)"), msg
    assert "free" in msg and ei.value.errno == errno.ENOSPC
    assert_previous_intact(root)


def test_write_that_runs_out_of_space_is_named_not_torch_internal(run_dir):
    """The size estimate counts tensors; 6 MB of pickled RNG state passes it and fills the disk
    inside torch.save, which says "enforce fail ... unexpected pos": reported as a full disk."""
    root = run_dir / "checkpoints"
    save(root, 1)
    with pytest.raises(CheckpointDiskFull) as ei:
        save(root, 2, rng=os.urandom(6 << 20))
    assert str(ei.value).startswith(f"no space left on RUN_DIR ({run_dir}) writing checkpoint step 2: need ~")
    assert ei.value.__cause__ is not None  # the writer's own error, kept for the log
    assert_previous_intact(root)
    save(root, 2)  # with the space back, the next save works
    assert read_latest_pointer(root) == "step-000002"


def test_safetensors_storage_full_is_recognised(run_dir):
    from safetensors.torch import save_file

    filler = run_dir / "filler"
    filler.write_bytes(b"\0" * (FS_BYTES - (256 << 10)))
    with pytest.raises(Exception) as ei:  # whatever safetensors raises on a full disk
        save_file({"w": torch.zeros(1 << 20)}, str(run_dir / "m.safetensors"))
    assert _is_disk_full(ei.value, _free_bytes(run_dir), 4 << 20), repr(ei.value)
    assert not _is_disk_full(ValueError("unexpected pos"), 1 << 30, 4 << 20)  # plenty free: not a full disk
