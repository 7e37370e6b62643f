"""Checkpoints: bit-exact resume, atomicity under crashes, fallback, retention; the batch ledger."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import free_port, process_group_rank, spawn_ranks
from torch import nn

from dflash_ipc.config import TrainingConfig
from dflash_ipc.drafter.checkpoint import store as ck
from dflash_ipc.drafter.checkpoint.store import (
    BatchLedger,
    gather_ledger,
    load_latest_checkpoint,
    read_latest_pointer,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash_ipc.drafter.training.trainer import DrafterTrainer

CFG = TrainingConfig(lr=1e-2, warmup_steps=2, max_steps=50, grad_clip=0.5)


class Noisy(nn.Module):
    """Uses torch and python RNG in forward, so a resume must restore both to be bit-exact."""

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(16, 7, bias=False)
        self.lm_head.weight.requires_grad_(False)
        self.fc = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x):
        h = self.fc(x.to(self.fc.weight.dtype))
        h = h + 0.1 * torch.randn_like(h) * random.random()
        return self.lm_head(self.norm(h).float())


def make_trainer(dtype=torch.bfloat16) -> DrafterTrainer:
    torch.manual_seed(0)
    return DrafterTrainer(Noisy(), CFG, compute_dtype=dtype)


def train_step(tr: DrafterTrainer, i: int):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(9 + i, 6, generator=g)
    y = torch.randint(0, 7, (9 + i,), generator=g)
    w = torch.rand(9 + i, generator=g)
    loss = (nn.functional.cross_entropy(tr.model(x), y, reduction="none") * w).sum()
    return tr.step(loss, w.sum())


def snapshot(tr: DrafterTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in tr.master_params] + [p.detach().clone() for p in tr.params]


def save(tr: DrafterTrainer, root: Path, ledger: BatchLedger, keep: int = 2, **kw) -> Path:
    return save_checkpoint(
        root,
        tr.step_count,
        model_state=tr.trainable_state_dict(tr.compute_dtype),
        trainer_state=tr.state_dict(),
        rng_state=rng_state(),
        ledger=ledger,
        extra={"epoch": 0, "note": "test"},
        config_hash="abc123",
        keep=keep,
        **kw,
    )


# --------------------------------------------------------------------------- ledger


def test_ledger_wire_round_trip_and_merge():
    led = BatchLedger([(0, 1, 2), [0, 1, 3]])
    led.add([(1, 0, 0)])
    assert (0, 1, 2) in led and [0, 1, 3] in led and (9, 9, 9) not in led and "x" not in led
    wire = led.to_wire()
    assert wire["ids"] == [[0, 1, 2], [0, 1, 3], [1, 0, 0]]
    assert BatchLedger.from_wire(json.loads(json.dumps(wire))) == led
    assert BatchLedger.from_wire(msgpack.unpackb(msgpack.packb(wire))) == led
    assert BatchLedger.from_wire(wire["ids"]) == led
    other = BatchLedger([(2, 0, 0), (0, 1, 2)])
    assert len(led.copy().merge(other)) == 4 and len(led) == 3
    with pytest.raises(ValueError):
        BatchLedger.from_wire({"format": "nope", "ids": []})
    assert gather_ledger([(3, 1), (1, 2), (3, 1)], None) == [(1, 2), (3, 1)]


def _gather_worker(rank: int, port: int, out_dir: str) -> None:
    with process_group_rank(rank, port) as world:
        ids = [(0, 0, rank), (0, 5, 5)] if rank == 0 else []  # rank 1 consumed nothing
        if rank == 1:
            ids = [(1, 1, 1)]
        got = gather_ledger(ids, world)
        Path(out_dir, f"r{rank}.json").write_text(json.dumps(got))


@pytest.mark.slow  # two gloo ranks
def test_gather_ledger_two_gloo_ranks(tmp_path):
    spawn_ranks(_gather_worker, args=(free_port(), str(tmp_path)))
    expected = [[0, 0, 0], [0, 5, 5], [1, 1, 1]]
    assert json.loads((tmp_path / "r0.json").read_text()) == expected
    assert json.loads((tmp_path / "r1.json").read_text()) == expected


def test_rng_round_trip():
    state = rng_state()
    a = (random.random(), torch.rand(3))
    set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_resume_is_bit_exact(tmp_path, dtype):
    random.seed(1)
    tr = make_trainer(dtype)
    ledger = BatchLedger()
    for i in range(3):
        train_step(tr, i)
        ledger.add([(0, 0, i)])
    path = save(tr, tmp_path, ledger)
    assert path.name == "step-000003" and read_latest_pointer(tmp_path) == "step-000003"
    for i in range(3, 6):
        train_step(tr, i)
    uninterrupted = snapshot(tr)
    for _ in range(4):  # scramble the RNGs as a fresh process would have them
        random.random(), torch.rand(5)

    ckpt = load_latest_checkpoint(tmp_path, expected_config_hash="abc123")
    assert ckpt is not None and ckpt.step == 3 and ckpt.notes == []
    assert ckpt.ledger == ledger and ckpt.extra == {"epoch": 0, "note": "test"}
    tr2 = make_trainer(dtype)
    tr2.load_state_dict(ckpt.trainer_state)
    set_rng_state(ckpt.rng_state)
    assert tr2.step_count == 3
    for name, p in zip(tr2.names, tr2.params):
        assert torch.equal(ckpt.model_state[name], p.detach())  # model.safetensors = compute weights
        assert ckpt.model_state[name].dtype == dtype
    for i in range(3, 6):
        train_step(tr2, i)
    resumed = snapshot(tr2)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))


# --------------------------------------------------------------------------- atomicity


def _setup_two(tmp_path: Path) -> DrafterTrainer:
    tr = make_trainer(torch.float32)
    train_step(tr, 0)
    save(tr, tmp_path, BatchLedger([(0, 0, 0)]))
    train_step(tr, 1)
    return tr


def test_exception_mid_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    tr = _setup_two(tmp_path)
    real = ck._write_json

    def boom(path, obj):
        if Path(path).name == ck.LEDGER_FILE:  # model.safetensors and trainer.pt are already written
            raise OSError("disk full (simulated)")
        return real(path, obj)

    monkeypatch.setattr(ck, "_write_json", boom)
    with pytest.raises(OSError, match="simulated"):
        save(tr, tmp_path, BatchLedger([(0, 0, 0), (0, 0, 1)]))
    assert read_latest_pointer(tmp_path) == "step-000001"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001"]
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.step == 1 and ckpt.notes == []


def test_crash_between_commit_and_pointer_update(tmp_path, monkeypatch):
    tr = _setup_two(tmp_path)
    monkeypatch.setattr(ck, "_replace_pointer", lambda root, name: (_ for _ in ()).throw(OSError("crash")))
    with pytest.raises(OSError):
        save(tr, tmp_path, BatchLedger([(0, 0, 0), (0, 0, 1)]))
    assert read_latest_pointer(tmp_path) == "step-000001"
    ckpt = load_latest_checkpoint(tmp_path)  # the renamed directory is complete: it is used
    assert ckpt.step == 2 and any("newer complete checkpoint" in n for n in ckpt.notes)


def test_killed_mid_save_and_leftover_tmp(tmp_path):
    tr = _setup_two(tmp_path)
    ready = tmp_path.parent / f"{tmp_path.name}.ready"
    script = textwrap.dedent(f"""
        import time, torch
        from pathlib import Path
        from dflash_ipc.drafter.checkpoint import store as ck
        real = ck._write_torch
        def slow(path, obj):
            with open(path, "wb") as f:
                f.write(b"partial trainer state")
                f.flush()
            Path({str(ready)!r}).write_text("x")
            time.sleep(60)
        ck._write_torch = slow
        ck.save_checkpoint({str(tmp_path)!r}, 2, model_state={{"w": torch.ones(4)}}, trainer_state={{}},
                           rng_state=None, ledger=ck.BatchLedger(), keep=1)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 50
        while not ready.exists():
            assert proc.poll() is None, "saver exited early"
            assert time.monotonic() < deadline, "saver never reached the write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1  # the half-written directory is there ...
    assert read_latest_pointer(tmp_path) == "step-000001"
    ckpt = load_latest_checkpoint(tmp_path)  # ... and never treated as a checkpoint
    assert ckpt.step == 1 and ckpt.notes == []
    save(tr, tmp_path, BatchLedger())  # the next good save cleans it up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000001", "step-000002"]


def test_damaged_latest_falls_back_with_reason(tmp_path):
    tr = _setup_two(tmp_path)
    save(tr, tmp_path, BatchLedger())
    trainer_pt = tmp_path / "step-000002" / ck.TRAINER_FILE
    data = trainer_pt.read_bytes()
    trainer_pt.write_bytes(data[: len(data) // 2])  # truncated
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.step == 1
    assert any("trainer.pt" in n and "step-000002" in n for n in ckpt.notes)
    # said as it is: an older checkpoint, not a "newer" one
    assert ckpt.notes[-1] == (
        "latest says 'step-000002', which is missing or damaged; falling back to the older complete checkpoint step-000001: "
        "the steps after it are trained again"
    ), ckpt.notes
    # Same size but garbage also fails validation: its sha256 is not the one meta.json recorded.
    trainer_pt.write_bytes(b"\0" * len(data))
    ckpt = load_latest_checkpoint(tmp_path)
    assert ckpt.step == 1 and any("trainer.pt does not match the sha256" in n for n in ckpt.notes), ckpt.notes
    (tmp_path / "step-000001" / ck.META_FILE).unlink()
    assert load_latest_checkpoint(tmp_path) is None
    # A save at a lower step removes the damaged newer directory so it cannot shadow it.
    save(tr, tmp_path, BatchLedger())  # tr is at step 2 again: replaces the damaged one
    assert load_latest_checkpoint(tmp_path).step == 2


def test_retention_keeps_newest(tmp_path):
    tr = make_trainer(torch.float32)
    for i in range(5):
        train_step(tr, i)
        save(tr, tmp_path, BatchLedger([(0, 0, i)]), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004", "step-000005"]
    assert read_latest_pointer(tmp_path) == "step-000005"
    assert load_latest_checkpoint(tmp_path).step == 5
    # Resuming from step 4 (say step 5 was damaged) and saving step-4 again drops step 5.
    ck._remove_dir(tmp_path / "step-000005")
    (tmp_path / "step-000006").mkdir()  # stray newer directory without meta.json
    tr2 = make_trainer(torch.float32)
    tr2.load_state_dict(load_latest_checkpoint(tmp_path).trainer_state)
    save(tr2, tmp_path, BatchLedger(), keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000004"]
    assert load_latest_checkpoint(tmp_path).ledger == BatchLedger()


def test_empty_root(tmp_path):
    assert load_latest_checkpoint(tmp_path / "missing") is None
    assert load_latest_checkpoint(tmp_path) is None


@pytest.mark.gpu
def test_resume_with_the_checkpoint_mapped_to_the_gpu_restores_rng(tmp_path):
    """The drafter loads its checkpoint with map_location = its device, so the RNG states arrive
    as CUDA tensors; torch only takes CPU byte tensors (before: "TypeError: RNG state must be a
    torch.ByteTensor" on every GPU --resume)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    torch.cuda.init()
    tr = make_trainer(torch.float32)
    train_step(tr, 0)
    save(tr, tmp_path, BatchLedger())
    expected = (random.random(), torch.rand(3), torch.rand(3, device="cuda"))
    ckpt = load_latest_checkpoint(tmp_path, map_location="cuda")
    assert ckpt is not None and ckpt.rng_state["torch"].device.type == "cuda"
    set_rng_state(ckpt.rng_state)
    again = (random.random(), torch.rand(3), torch.rand(3, device="cuda"))
    assert expected[0] == again[0] and torch.equal(expected[1], again[1]) and torch.equal(expected[2], again[2])


def test_big_tensors_streamed_to_safetensors_resume_bit_exact(tmp_path):
    """The drafter's layout: model.safetensors holds the master weights (fp32), optimizer.safetensors
    the AdamW moments, both written from the live tensors; trainer.pt holds neither (placeholders
    for the moments); resuming takes them from the two files."""
    tr = make_trainer(torch.bfloat16)
    for i in range(3):
        train_step(tr, i)
    save_checkpoint(
        tmp_path,
        tr.step_count,
        model_state=dict(tr.trainable_tensors()),
        trainer_state=tr.state_dict(include_master=False, include_moments=False),
        rng_state=rng_state(),
        ledger=BatchLedger(),
        optimizer_tensors=tr.moment_tensors(),
    )
    for i in range(3, 5):
        train_step(tr, i)
    uninterrupted = snapshot(tr)

    ckpt = load_latest_checkpoint(tmp_path)
    assert "master" not in ckpt.trainer_state
    assert {t.dtype for t in ckpt.model_state.values()} == {torch.float32}
    per_param = ckpt.trainer_state["optimizer"]["state"]
    assert per_param and all(v == f"moment:{i}.{k}" for i, d in per_param.items() for k, v in d.items() if k != "step")
    assert sorted(ckpt.optimizer_tensors) == sorted(tr.moment_tensors()) and len(ckpt.optimizer_tensors) == 2 * len(per_param)
    tr2 = make_trainer(torch.bfloat16)
    with pytest.raises(ValueError, match="master="):
        tr2.load_state_dict(ckpt.trainer_state, moments=ckpt.optimizer_tensors)
    with pytest.raises(ValueError, match="master weights in torch.float32"):
        tr2.load_state_dict(ckpt.trainer_state, master={n: t.to(torch.bfloat16) for n, t in ckpt.model_state.items()})
    with pytest.raises(ValueError, match="optimizer moment"):
        tr2.load_state_dict(ckpt.trainer_state, master=ckpt.model_state)
    tr2 = make_trainer(torch.bfloat16)  # a refused load may have restored the weights already: start clean
    tr2.load_state_dict(ckpt.trainer_state, master=ckpt.model_state, moments=ckpt.optimizer_tensors)
    set_rng_state(ckpt.rng_state)
    for i in range(3, 5):
        train_step(tr2, i)
    assert all(torch.equal(a, b) for a, b in zip(uninterrupted, snapshot(tr2)))


def test_latest_committed_step_reads_the_pointer_and_meta_without_torch(tmp_path):
    from dflash_ipc.drafter.checkpoint.layout import latest_committed_step

    assert latest_committed_step(tmp_path) is None  # nothing saved
    tr = make_trainer(torch.float32)
    train_step(tr, 0)
    save(tr, tmp_path, BatchLedger([(0, 0, 0)]))
    assert latest_committed_step(tmp_path) == 1
    (tmp_path / "step-000001" / ck.META_FILE).write_text("{torn")
    assert latest_committed_step(tmp_path) is None  # unreadable: the caller falls back to a full load
    (tmp_path / ck.LATEST_FILE).write_text("elsewhere\n")
    assert latest_committed_step(tmp_path) is None
    code = "import sys, dflash_ipc.drafter.checkpoint.layout; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
