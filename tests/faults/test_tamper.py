"""Damaged checkpoints, changed data and runs that learn nothing: never trained on, never silent.

One real `dflash-ipc up` (tiny CPU config, a JSONL data file, a checkpoint every 4 steps, 3 kept)
trains once per module; each case damages a copy of its run directory. A case is "accepted
silently" when a reader resumes from the damaged checkpoint, or starts again from step 0 while
checkpoints exist. Every case is read by the readers `up --resume` has, which must agree:

* the supervisor's, before any process starts (``resume_check.check_resume_checkpoints`` with every
  sha256 and the plan; ``preflight.validate_for_up`` at the door),
* the drafter's (``checkpoint.load_latest_checkpoint``, strict, with the plan: also the values).

The end-to-end cases run the real `up --resume`: a damaged newest checkpoint falls back with the
reason in `up`'s output and the run repeats no consumed batch and skips none; all damaged: exit 2,
nothing spawned; changed data: exit 2 naming the file, or re-planned with ``--replan``; and the
configs whose updates are all non-finite exit non-zero with no export.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import tiny_cpu_config, write_toml
from fault_harness import CLI, FULL, RUN_TIMEOUT_S, report
from safetensors.torch import load_file, save_file

from dflash_ipc.config import ConfigError, config_from_dict
from dflash_ipc.data.builtin_corpus import builtin_conversations
from dflash_ipc.drafter.checkpoint.layout import LEDGER_FILE, META_FILE, MODEL_FILE, OPTIM_FILE, TRAINER_FILE
from dflash_ipc.drafter.checkpoint.store import NoUsableCheckpoint, load_latest_checkpoint
from dflash_ipc.drafter.checkpoint.values import ModelShapes
from dflash_ipc.drafter.checkpoint.verify import DIGESTS_KEY, META_DIGEST_KEY, choose_checkpoint, meta_digest, read_plan, sha256_file
from dflash_ipc.runtime.preflight import validate_for_up

STEPS, EVERY = 12, 4
NEWEST, OLDER = "step-000012", "step-000008"


def data_lines(n: int) -> list[str]:
    return [json.dumps(c) for c in builtin_conversations(n, 256)]


def config_raw(data: Path | str, **training) -> dict:
    """The tiny CPU config on ``data`` (relative: to the directory `up` runs in)."""
    raw = tiny_cpu_config(
        data={"paths": [str(data)], "max_seq_len": 128, "bucket_edges": [64, 128], "token_budget": 512},
        run={"teardown_grace_s": 3.0},
        training={"checkpoint_every": EVERY, "keep_checkpoints": 3, "max_steps": STEPS} | training,
    )
    del raw["data"]["builtin_samples"]
    return raw


def up(config: Path, run_dir: Path, *extra: str, timeout: float = RUN_TIMEOUT_S) -> subprocess.CompletedProcess:
    argv = [*CLI, "up", "--config", str(config), "--run-dir", str(run_dir), *extra]
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout, cwd=run_dir.parent)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished run: checkpoints at steps 4, 8 and 12 written by the real drafter."""
    base = tmp_path_factory.mktemp("trained")
    data = base / "train.jsonl"
    data.write_text("\n".join(data_lines(140)) + "\n")  # 32 batches: the data ends at step 16
    config = write_toml(base / "ck4.toml", config_raw("train.jsonl"))
    proc = up(config, base / "run")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert sorted(p.name for p in (base / "run" / "checkpoints").glob("step-*")) == ["step-000004", OLDER, NEWEST]
    return base


@pytest.fixture
def copy(trained, tmp_path, monkeypatch) -> Path:
    """A copy of the trained run (data file and config beside it, the working directory), for one case to damage."""
    shutil.copytree(trained, tmp_path / "t", symlinks=True)
    monkeypatch.chdir(tmp_path / "t")
    return tmp_path / "t"


# --------------------------------------------------------------------------- the damage


def reseal(step_dir: Path) -> None:
    """Record the files as they are now in meta.json (sizes, sha256s, its own digest): damage a
    writer put there itself, which only the values can tell."""
    meta = json.loads((step_dir / META_FILE).read_text())
    for name in meta["files"]:
        meta["files"][name] = (step_dir / name).stat().st_size
        meta[DIGESTS_KEY][name] = sha256_file(step_dir / name)
    meta["num_batches"] = len(json.loads((step_dir / LEDGER_FILE).read_text())["ids"])
    meta[META_DIGEST_KEY] = meta_digest(meta)
    (step_dir / META_FILE).write_text(json.dumps(meta))


def set_tensor(fname: str, pick: Callable[[str], bool], value: float, *, resealed: bool) -> Callable[[Path], None]:
    """Write ``value`` into the first element of the first tensor ``pick`` chooses, file size unchanged."""

    def damage(step_dir: Path) -> None:
        path = step_dir / fname
        header_len = struct.unpack("<Q", path.read_bytes()[:8])[0]
        header = json.loads(path.read_bytes()[8 : 8 + header_len])
        name = next(n for n in sorted(header) if n != "__metadata__" and pick(n) and header[n]["dtype"] == "F32")
        start = 8 + header_len + header[name]["data_offsets"][0]
        with open(path, "r+b") as f:
            f.seek(start)
            f.write(struct.pack("<f", value))
        if resealed:
            reseal(step_dir)

    return damage


def flip_byte(fname: str, where: float = 0.6) -> Callable[[Path], None]:
    def damage(step_dir: Path) -> None:
        path = step_dir / fname
        data = bytearray(path.read_bytes())
        data[int(len(data) * where)] ^= 0x10
        path.write_bytes(bytes(data))

    return damage


def flip_rng_bit(step_dir: Path) -> None:
    """One bit of the saved torch RNG state, trainer.pt rewritten by torch.save (the same size)."""
    path = step_dir / TRAINER_FILE
    payload = torch.load(path, weights_only=True)
    payload["rng"]["torch"][100] ^= 0x04
    torch.save(payload, path)


def ledger_edit(edit: Callable[[list], list], *, resealed: bool = False) -> Callable[[Path], None]:
    """Rewrite ledger.json's ids; padded with spaces back to its size unless ``resealed``."""

    def damage(step_dir: Path) -> None:
        path = step_dir / LEDGER_FILE
        wire = json.loads(path.read_text())
        size = path.stat().st_size
        wire["ids"] = edit(wire["ids"])
        text = json.dumps(wire, indent=1, sort_keys=True)
        path.write_text(text if resealed else text.ljust(size - 1) + "\n")
        assert resealed or path.stat().st_size == size
        if resealed:
            reseal(step_dir)

    return damage


def rewrite_model(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    """model.safetensors rewritten with ``edit`` applied to its tensors, the manifest re-sealed."""

    def damage(step_dir: Path) -> None:
        tensors = load_file(step_dir / MODEL_FILE)
        edit(tensors)
        save_file(tensors, step_dir / MODEL_FILE)
        reseal(step_dir)

    return damage


def add_tensor(tensors: dict[str, torch.Tensor]) -> None:
    tensors["layers.0.extra.weight"] = torch.zeros(4, 4)


def transpose_first_rectangular(tensors: dict[str, torch.Tensor]) -> None:
    name = next(n for n in sorted(tensors) if tensors[n].dim() == 2 and tensors[n].shape[0] != tensors[n].shape[1])
    tensors[name] = tensors[name].t().contiguous()


def set_trainer_step(step: int) -> Callable[[Path], None]:
    def damage(step_dir: Path) -> None:
        payload = torch.load(step_dir / TRAINER_FILE, weights_only=True)
        payload["trainer"]["step"] = step
        torch.save(payload, step_dir / TRAINER_FILE)
        reseal(step_dir)

    return damage


def model_shapes(step_dir: Path) -> ModelShapes:
    """The drafter model's shapes, as the untouched checkpoint ``step_dir`` of the same run holds them."""
    weights = load_file(step_dir / MODEL_FILE)
    moments = load_file(step_dir / OPTIM_FILE)
    params = {int(k.split(".", 1)[0]): tuple(t.shape) for k, t in moments.items()}
    return ModelShapes({n: tuple(t.shape) for n, t in weights.items()}, params)


def nest(fname: str) -> Callable[[Path], None]:
    """``fname`` replaced by 100,000 nested arrays (json.loads raised RecursionError: no fallback, a traceback);
    the manifest records the new file so only its parse tells (meta.json itself has no manifest to record it)."""

    def damage(step_dir: Path) -> None:
        (step_dir / fname).write_text("[" * 100_000)
        if fname != META_FILE:
            meta = json.loads((step_dir / META_FILE).read_text())
            meta["files"][fname] = (step_dir / fname).stat().st_size
            meta[DIGESTS_KEY][fname] = sha256_file(step_dir / fname)
            meta[META_DIGEST_KEY] = meta_digest(meta)
            (step_dir / META_FILE).write_text(json.dumps(meta))

    return damage


def edit_meta_num_batches(step_dir: Path) -> None:
    path = step_dir / META_FILE
    path.write_text(path.read_text().replace('"num_batches": 24', '"num_batches": 23'))


def truncate(fname: str) -> Callable[[Path], None]:
    def damage(step_dir: Path) -> None:
        path = step_dir / fname
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return damage


def remove(fname: str) -> Callable[[Path], None]:
    return lambda step_dir: (step_dir / fname).unlink()


def is_model(name: str) -> bool:
    return name.endswith("weight")


# (case, damage of the newest checkpoint, what the refusal names)
CASES = [
    ("nan-weight-same-size", set_tensor(MODEL_FILE, is_model, float("nan"), resealed=False), "model.safetensors does not match the sha256"),
    ("nan-weight-resealed", set_tensor(MODEL_FILE, is_model, float("nan"), resealed=True), "non-finite value(s)"),
    ("inf-weight-resealed", set_tensor(MODEL_FILE, is_model, float("inf"), resealed=True), "non-finite value(s)"),
    ("1e30-weight", set_tensor(MODEL_FILE, is_model, 1e30, resealed=False), "model.safetensors does not match the sha256"),
    ("1e30-weight-resealed", set_tensor(MODEL_FILE, is_model, 1e30, resealed=True), "holds a value of magnitude 1e+30"),
    (
        "negative-exp-avg-sq",
        set_tensor(OPTIM_FILE, lambda n: n.endswith("exp_avg_sq"), -1.0, resealed=False),
        "optimizer.safetensors does not match",
    ),
    (
        "negative-exp-avg-sq-resealed",
        set_tensor(OPTIM_FILE, lambda n: n.endswith("exp_avg_sq"), -1.0, resealed=True),
        "a mean of squares cannot be negative",
    ),
    ("nan-exp-avg-resealed", set_tensor(OPTIM_FILE, lambda n: n.endswith(".exp_avg"), float("nan"), resealed=True), "non-finite value(s)"),
    ("flipped-tensor-byte", flip_byte(MODEL_FILE), "model.safetensors does not match the sha256"),
    ("flipped-optimizer-byte", flip_byte(OPTIM_FILE), "optimizer.safetensors does not match the sha256"),
    ("rng-bit-flip", flip_rng_bit, "trainer.pt"),
    ("flipped-trainer-byte", flip_byte(TRAINER_FILE, 0.5), "trainer.pt does not match the sha256"),
    ("ledger-id-removed-padded", ledger_edit(lambda ids: ids[1:]), "ledger.json does not match the sha256"),
    ("ledger-id-duplicated-padded", ledger_edit(lambda ids: ids[1:] + ids[1:2]), "ledger.json does not match the sha256"),
    ("ledger-id-outside-plan", ledger_edit(lambda ids: ids[1:] + [[0, 0, 9999]], resealed=True), "does not fit the plan"),
    ("ledger-id-duplicated-resealed", ledger_edit(lambda ids: ids[1:] + ids[1:2], resealed=True), "distinct"),
    ("ledger-id-removed-resealed", ledger_edit(lambda ids: ids[1:], resealed=True), "holds 23 batches, but its steps trained 24"),
    ("ledger-emptied-resealed", ledger_edit(lambda ids: [], resealed=True), "holds 0 batches, but its steps trained 24"),
    ("1e18-weight-resealed", set_tensor(MODEL_FILE, is_model, 1e18, resealed=True), "past 1e+06 (exploded"),
    ("extra-tensor-resealed", rewrite_model(add_tensor), "unexpected ['layers.0.extra.weight']"),
    ("transposed-weight-resealed", rewrite_model(transpose_first_rectangular), "the model's is"),
    ("trainer-step-negative-resealed", set_trainer_step(-5), "the trainer's step is -5"),
    ("meta-num-batches-edited", edit_meta_num_batches, "meta.json does not match its own sha256"),
    ("meta-missing", remove(META_FILE), "meta.json missing"),
    ("meta-nested-json", nest(META_FILE), "meta.json unreadable: nested deeper"),
    ("ledger-nested-json", nest(LEDGER_FILE), "ledger.json unreadable: nested deeper"),
    ("model-truncated", truncate(MODEL_FILE), "model.safetensors is"),
    ("optimizer-missing", remove(OPTIM_FILE), "optimizer.safetensors missing"),
]


@pytest.mark.slow
@pytest.mark.parametrize("case, damage, named", CASES, ids=[c[0] for c in CASES])
def test_damaged_newest_checkpoint_is_never_resumed(copy, case, damage, named):
    """Both readers pass over the damaged step 12 for step 8, and say why."""
    run_dir, root = copy / "run", copy / "run" / "checkpoints"
    shapes = model_shapes(root / OLDER)
    damage(root / NEWEST)
    plan = read_plan(run_dir)
    drafter = load_latest_checkpoint(root, plan=plan, strict=True, expected_shapes=shapes)
    assert drafter.path.name == OLDER, (case, drafter.notes)
    assert any(NEWEST in n and named in n for n in drafter.notes), (case, drafter.notes)
    if case.endswith("-resealed"):  # the files are as their manifest says: only the values tell
        assert choose_checkpoint(root, digests=True, plan=plan).path.name == (OLDER if "ledger" in case else NEWEST)
    else:  # the supervisor, before any process starts, picks the same checkpoint for the same reason
        supervisor = choose_checkpoint(root, digests=True, plan=plan)
        assert supervisor.path.name == OLDER and any(NEWEST in n for n in supervisor.notes), (case, supervisor.notes)
    report(f"tamper {case}: refused ({drafter.notes[0][:160]})")


@pytest.mark.slow
def test_all_checkpoints_damaged_refuses_resume(copy):
    """Every checkpoint truncated: `up --resume` exits 2 before spawning anything (never a silent step 0)."""
    run_dir, root = copy / "run", copy / "run" / "checkpoints"
    for step_dir in root.glob("step-*"):
        truncate(MODEL_FILE)(step_dir)
    with pytest.raises(ConfigError, match=r": --resume: no usable checkpoint under .*step-000012: model.safetensors is .*step-000004"):
        validate_for_up(copy / "ck4.toml", str(run_dir), resume=True)
    with pytest.raises(NoUsableCheckpoint):
        load_latest_checkpoint(root, strict=True)
    metrics_before = (run_dir / "metrics.jsonl").read_text()
    proc = up(copy / "ck4.toml", run_dir, "--resume", timeout=120)
    assert proc.returncode == 2 and "no usable checkpoint under" in proc.stdout, proc.stdout[-3000:]
    assert "[up] started" not in proc.stdout and "Traceback" not in proc.stdout
    assert (run_dir / "metrics.jsonl").read_text() == metrics_before
    # only the pointer left, pointing nowhere: refused too
    for step_dir in root.glob("step-*"):
        shutil.rmtree(step_dir)
    with pytest.raises(ConfigError, match=r"no usable checkpoint under .*points at 'step-000012', which does not exist"):
        validate_for_up(copy / "ck4.toml", str(run_dir), resume=True)
    report("tamper all-checkpoints-truncated: `up --resume` exit 2, nothing spawned; pointer only: refused")


def ledger_ids(step_dir: Path) -> list[tuple[int, ...]]:
    return [tuple(i) for i in json.loads((step_dir / LEDGER_FILE).read_text())["ids"]]


def planned_ids(run_dir: Path) -> set[tuple[int, ...]]:
    plan = read_plan(run_dir)
    return {(0, s, i) for s, n in enumerate(plan["n_batches_per_shard"]) for i in range(n)}


@pytest.mark.slow
def test_resume_falls_back_past_a_nan_checkpoint_and_trains_each_batch_once(copy):
    """A NaN written into a weight, the file's size unchanged. `up --resume` names it, resumes from step 8,
    trains on to the end of the data; the final ledger is every planned batch exactly once."""
    run_dir, root = copy / "run", copy / "run" / "checkpoints"
    set_tensor(MODEL_FILE, is_model, float("nan"), resealed=False)(root / NEWEST)
    proc = up(copy / "ck4.toml", run_dir, "--resume", "--max-steps", "0")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"[up] checkpoint: skipped {root / NEWEST}: model.safetensors does not match the sha256" in proc.stdout, proc.stdout
    assert f"resumed from {root / OLDER} (step 8)" in proc.stdout, proc.stdout
    final = root / (root / "latest").read_text().strip()
    ids = ledger_ids(final)
    assert len(ids) == len(set(ids)) and set(ids) == planned_ids(run_dir)
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, steps[-1] + 1))  # the steps after 8 were trained again, once
    report(f"tamper nan-weight end to end: resumed from step 8, {len(ids)} planned batches each once")


@pytest.mark.slow
def test_resume_falls_back_past_a_nested_manifest_and_a_checkpoint_of_other_shapes(copy):
    """The newest checkpoint's meta.json 100,000 arrays deep (every reader of `up --resume` parses it: a
    RecursionError before), the next one's weight transposed with its manifest re-sealed (the files verify, only
    the model can tell; it failed after spawn). The drafter passes both over for step 4 before loading anything."""
    run_dir, root = copy / "run", copy / "run" / "checkpoints"
    nest(META_FILE)(root / NEWEST)
    rewrite_model(transpose_first_rectangular)(root / OLDER)
    proc = up(copy / "ck4.toml", run_dir, "--resume", "--max-steps", "5")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert f"[up] checkpoint: skipped {root / NEWEST}: meta.json unreadable: nested deeper" in proc.stdout, proc.stdout[-3000:]
    assert f"[up] checkpoint: skipped {root / OLDER}: model.safetensors: " in proc.stdout, proc.stdout[-3000:]
    assert "the model's is" in proc.stdout and f"resumed from {root / 'step-000004'} (step 4)" in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout and (root / "latest").read_text().strip() == "step-000005"
    report("tamper nested meta.json + transposed weight end to end: resumed from step 4, trained step 5")


def change_data(copy: Path) -> None:
    """The data file cut to two thirds and reordered."""
    data = copy / "train.jsonl"
    lines = data.read_text().splitlines()
    data.write_text("\n".join(reversed(lines[: len(lines) * 2 // 3])) + "\n")


@pytest.mark.slow
def test_resume_on_changed_data_is_refused_naming_the_file(copy):
    run_dir = copy / "run"
    change_data(copy)
    before = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "data" not in p.parts)
    proc = up(copy / "ck4.toml", run_dir, "--resume", "--max-steps", "0", timeout=180)
    assert proc.returncode == 2, proc.stdout[-3000:]
    assert "--resume: the data changed since the checkpoint" in proc.stdout, proc.stdout
    assert "train.jsonl: " in proc.stdout and "bytes then" in proc.stdout and "--replan" in proc.stdout, proc.stdout
    assert "[up] started" not in proc.stdout and "Traceback" not in proc.stdout
    assert sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if "data" not in p.parts) == before
    report("tamper changed-data: `up --resume` exit 2 naming the file, nothing spawned")


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="a second training run; DFLASH_IPC_FAULTS_FULL=1")
def test_replan_trains_every_batch_of_the_new_plan_once(copy):
    run_dir, root = copy / "run", copy / "run" / "checkpoints"
    change_data(copy)
    proc = up(copy / "ck4.toml", run_dir, "--resume", "--replan", "--max-steps", "0")
    assert proc.returncode == 0, proc.stdout[-3000:]
    plan = read_plan(run_dir)
    assert f"re-planned: {plan['n_batches_total']} batches, all new (the checkpoint's 24 consumed batches" in proc.stdout, proc.stdout
    ids = ledger_ids(root / (root / "latest").read_text().strip())
    assert len(ids) == len(set(ids)) and set(ids) == planned_ids(run_dir)
    report(f"tamper changed-data --replan: {plan['n_batches_total']} new batches, each trained once")


def test_replan_needs_resume(tmp_path):
    proc = subprocess.run([*CLI, "up", "--config", "x.toml", "--replan"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "--replan re-plans the data of a resumed run: pass it with --resume" in proc.stderr


NAN_CONFIGS = [
    ("lr-1e30", {"training": {"lr": 1e30}}),
    ("loss-gamma-1e-300", {"training": {"loss_gamma": 1e-300}}),
    ("noise-std-1e300", {"drafter": {"noise_std": 1e300}}),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, patch", NAN_CONFIGS, ids=[n for n, _ in NAN_CONFIGS])
def test_a_run_whose_updates_are_all_skipped_fails_without_export(trained, tmp_path, name, patch):
    if name != "lr-1e30" and not FULL:
        pytest.skip("one of the three in CI; DFLASH_IPC_FAULTS_FULL=1 runs all")
    raw = config_raw(trained / "train.jsonl", checkpoint_every=0, max_steps=40, max_consecutive_skipped_updates=3)
    for section, table in patch.items():
        raw[section].update(table)
    run_dir = tmp_path / "run"
    proc = up(write_toml(tmp_path / f"{name}.toml", raw), run_dir)
    assert proc.returncode == 1, proc.stdout[-3000:]
    assert "FAILED" in proc.stdout and "training diverged: 3 updates in a row skipped" in proc.stdout, proc.stdout[-3000:]
    assert not (run_dir / "export").exists()
    report(f"nan-training {name}: exit {proc.returncode}, no export")


# A run shorter than training.max_consecutive_skipped_updates (20) that learned nothing:
# (name, config patch, what the failure says)
SHORT_DEAD_ENDS = [
    ("lr-1e30", {"training": {"lr": 1e30}}, "past 1e+06 (exploded"),  # its first update applied: the weights 2e29
    ("noise-std-1e300", {"drafter": {"noise_std": 1e300}}, "training learned nothing: none of the 6 updates"),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, patch, why", SHORT_DEAD_ENDS, ids=[n for n, _, _ in SHORT_DEAD_ENDS])
def test_a_short_run_that_learned_nothing_fails_without_checkpoint_or_export(trained, tmp_path, name, patch, why):
    raw = config_raw(trained / "train.jsonl", checkpoint_every=0, max_steps=6)
    for section, table in patch.items():
        raw[section].update(table)
    run_dir = tmp_path / "run"
    proc = up(write_toml(tmp_path / f"{name}.toml", raw), run_dir)
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = proc.stdout[proc.stdout.index("[up] FAILED") :]
    assert "TrainingDiverged" in failed and why in failed, failed[:3000]
    assert not (run_dir / "export").exists() and list((run_dir / "checkpoints").iterdir()) == []
    report(f"short dead end {name}: exit {proc.returncode}, no checkpoint, no export")


@pytest.mark.parametrize("value, why", [(-1, "must be >= 0 (got -1)"), ("x", "must be an integer"), (2.5, "must be an integer")])
def test_max_consecutive_skipped_updates_is_validated(value, why):
    with pytest.raises(ConfigError, match=rf"^a\.toml: training\.max_consecutive_skipped_updates: {re.escape(why)}"):
        config_from_dict(tiny_cpu_config(training={"max_consecutive_skipped_updates": value}), "a.toml")


def test_replan_lets_the_data_keys_change_and_nothing_else(tmp_path):
    """`--resume --replan`: data.* may differ from the checkpoint's config (re-planning is the point); other keys may not."""
    from test_bad_configs import apply, base_config
    from test_bad_resume import write_checkpoint

    run_dir = tmp_path / "run"
    write_checkpoint(run_dir, base_config())
    more_data = write_toml(tmp_path / "more.toml", apply(base_config(), {"data.builtin_samples": 900}))
    with pytest.raises(ConfigError, match=r"data\.builtin_samples: 800 in the checkpoint, 900 now"):
        validate_for_up(more_data, str(run_dir), resume=True)
    validate_for_up(more_data, str(run_dir), resume=True, replan=True)
    with pytest.raises(ConfigError, match=r"training\.lr: 0\.003 in the checkpoint, 0\.001 now"):
        validate_for_up(
            write_toml(tmp_path / "lr.toml", apply(base_config(), {"training.lr": 1e-3})), str(run_dir), resume=True, replan=True
        )
