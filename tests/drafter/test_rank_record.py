"""The drafter's rank record: its weights digest is sha256 over (name, fp32 bytes) in name order,
computed one tensor at a time (at 27B shapes copying the whole state to the host first was the
drafter's 9.8 GB peak host RSS), and it tells weights apart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from conftest import tiny_cpu_config, write_toml

from dflash_ipc.config import load_config
from dflash_ipc.drafter.core import DrafterCore
from dflash_ipc.drafter.training.distributed import DistInfo


def make_core(tmp_path: Path, name: str) -> DrafterCore:
    cfg = load_config(write_toml(tmp_path / f"{name}.toml", tiny_cpu_config()))
    run_dir = tmp_path / name
    run_dir.mkdir()
    return DrafterCore(cfg, run_dir, DistInfo.single("cpu"), torch.device("cpu"), total_steps=10, resume=False)


def test_weights_digest_is_the_documented_sha256_and_tells_weights_apart(tmp_path):
    a, b = make_core(tmp_path, "a"), make_core(tmp_path, "b")
    h = hashlib.sha256()
    state = a.trainer.trainable_state_dict()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].to(torch.float32).numpy().tobytes())
    assert a.weights_digest() == h.hexdigest()
    assert b.weights_digest() == a.weights_digest()  # same run.seed: same initial weights
    name, t = next(iter(b.trainer.trainable_tensors()))
    with torch.no_grad():
        t.view(-1)[0] += 1.0
    assert b.weights_digest() != a.weights_digest(), name

    rec = json.loads(a.write_rank_record().read_text())
    assert rec["weights_sha256"] == h.hexdigest() and rec["rank"] == 0 and rec["step"] == 0
    a.close()
    b.close()
