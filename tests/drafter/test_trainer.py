"""DrafterTrainer: token-weighted data parallelism over real gloo, fp32 master weights, schedule, state."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
import torch.multiprocessing as mp
from conftest import free_port, process_group_rank, spawn_ranks
from torch import nn

from dflash_ipc.config import TrainingConfig
from dflash_ipc.drafter.training.distributed import DistInfo, init_distributed
from dflash_ipc.drafter.training.schedule import lr_at
from dflash_ipc.drafter.training.trainer import DrafterTrainer

VOCAB, DIM, CLASSES = 11, 8, 5


class Tiny(nn.Module):
    """Frozen embedding + trainable MLP head; LayerNorm gives 1-D (no-decay) params."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.embed.weight.requires_grad_(False)
        self.fc1 = nn.Linear(DIM, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, CLASSES)

    def forward(self, x):
        h = self.embed(x).to(self.fc1.weight.dtype)
        return self.fc2(torch.tanh(self.norm(self.fc1(h))))


def make_model(dtype=torch.float32) -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def make_batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, VOCAB, (n,), generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    w = torch.rand(n, generator=g)
    w[::3] = 0.0  # some tokens unsupervised
    return x, y, w


def loss_sum(model, batch):
    x, y, w = batch
    per_tok = nn.functional.cross_entropy(model(x).float(), y, reduction="none")
    return (per_tok * w).sum(), w.sum()


def split(batch, k):
    return tuple(t[:k] for t in batch), tuple(t[k:] for t in batch)


CFG = TrainingConfig(lr=1e-2, warmup_steps=1, max_steps=20, grad_clip=1.0, weight_decay=0.1)
STEP_SEEDS = (1, 2, 3)
N_TOK, SPLIT = 13, 4  # rank 0 gets 4 tokens, rank 1 gets 9: different supervised weights


def master_snapshot(tr: DrafterTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in tr.master_params]


# --------------------------------------------------------------------------- single process


def test_single_process_matches_plain_adamw():
    model, ref = make_model(), make_model()
    tr = DrafterTrainer(model, CFG, compute_dtype=torch.float32, bucket_mb=1e-4)
    assert tr.single_copy and len(tr._bucket_bounds) > 1
    ps = [p for p in ref.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [{"params": [p for p in ps if p.ndim >= 2], "weight_decay": 0.1}, {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0}],
        lr=CFG.lr,
        betas=tuple(CFG.betas),
    )
    for i, seed in enumerate(STEP_SEEDS):
        batch = make_batch(N_TOK, seed)
        st = tr.step(*loss_sum(model, batch))
        opt.zero_grad()
        ls, ws = loss_sum(ref, batch)
        (ls / ws).backward()
        norm = torch.nn.utils.clip_grad_norm_(ps, CFG.grad_clip)
        for g in opt.param_groups:
            g["lr"] = lr_at(i, CFG, CFG.max_steps)
        opt.step()
        assert st.step == i + 1 and not st.skipped
        assert st.grad_norm == pytest.approx(float(norm), rel=1e-5)
        assert st.global_weight == pytest.approx(float(ws))
        assert st.global_loss == pytest.approx(float(ls.detach() / ws), rel=1e-5)
    for a, b, p in zip(tr.master_params, ps, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert p.data_ptr() == a.data_ptr()  # one copy on CPU/fp32
    assert not model.embed.weight.requires_grad and len(tr.master_params) == 6


def test_bf16_compute_keeps_fp32_master():
    model = make_model()
    cfg = TrainingConfig(lr=1e-5, warmup_steps=0, max_steps=10, grad_clip=0.0)
    tr = DrafterTrainer(model, cfg, compute_dtype=torch.bfloat16)
    start = master_snapshot(tr)
    assert all(p.dtype == torch.float32 for p in tr.master_params)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters() if p.requires_grad)
    assert model.embed.weight.dtype == torch.float32  # frozen params untouched
    for seed in STEP_SEEDS:
        tr.step(*loss_sum(model, make_batch(N_TOK, seed)))
    for mp_, p, s in zip(tr.master_params, [p for p in model.parameters() if p.requires_grad], start):
        assert torch.equal(p, mp_.to(torch.bfloat16))  # copied back after each step
        assert (mp_ - s).abs().max() > 0  # updates below bf16 resolution still accumulate in fp32
        assert p.grad is None  # bf16 grads are not kept around
    # The LayerNorm weight (1.0 + ~3e-5) is unchanged in bf16 but moved in the master copy.
    assert torch.equal(model.norm.weight, torch.ones_like(model.norm.weight))


def test_schedule_warmup_cosine_and_total_steps():
    cfg = TrainingConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=4, max_steps=0)
    assert lr_at(0, cfg, 14) == pytest.approx(0.25)
    assert lr_at(3, cfg, 14) == pytest.approx(1.0)
    assert lr_at(4, cfg, 14) == pytest.approx(1.0)
    assert lr_at(9, cfg, 14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(14, cfg, 14) == pytest.approx(0.1)
    assert lr_at(100, cfg, 14) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="total_steps"):
        DrafterTrainer(make_model(), cfg)
    tr = DrafterTrainer(make_model(), cfg, total_steps=14)
    assert tr.total_steps == 14
    tr.set_total_steps(30)
    assert tr.total_steps == 30
    assert DrafterTrainer(make_model(), CFG, total_steps=5).total_steps == CFG.max_steps


def test_schedule_warmup_fraction():
    cfg = TrainingConfig(lr=2.0, min_lr_ratio=0.0, warmup_steps=50, warmup_fraction=0.04)
    assert cfg.resolved_warmup_steps(200) == 8  # the fraction wins over warmup_steps
    assert [lr_at(i, cfg, 200) for i in range(8)] == pytest.approx([2.0 * (i + 1) / 8 for i in range(8)])
    assert lr_at(8, cfg, 200) == pytest.approx(2.0)  # peak, then cosine over the remaining 192 steps
    assert lr_at(8 + 96, cfg, 200) == pytest.approx(1.0)
    assert lr_at(200, cfg, 200) == pytest.approx(0.0, abs=1e-12)
    lrs = [lr_at(i, cfg, 200) for i in range(8, 201)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))
    # A short schedule still warms up for one step; warmup_fraction 0 keeps warmup_steps.
    assert cfg.resolved_warmup_steps(3) == 1 and lr_at(0, cfg, 3) == pytest.approx(2.0)
    assert TrainingConfig(warmup_steps=5).resolved_warmup_steps(1000) == 5
    from dflash_ipc.config import DFlashConfig

    assert "training.warmup_steps is ignored because training.warmup_fraction is set" in DFlashConfig(training=cfg).ignored_value_warnings()
    assert not any("warmup" in w for w in DFlashConfig(training=TrainingConfig(warmup_fraction=0.04)).ignored_value_warnings())


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"warmup_fraction": 1.0}, "warmup_fraction"),
        ({"warmup_fraction": -0.1}, "warmup_fraction"),
        ({"weight_decay": -0.01}, "weight_decay"),
        ({"weight_decay": float("nan")}, "weight_decay"),
        ({"betas": [0.9]}, "betas"),
        ({"betas": [0.9, 1.0]}, "betas"),
    ],
)
def test_recipe_knobs_validated(kwargs, key, tmp_path):
    from dflash_ipc.config import ConfigError, load_config

    with pytest.raises(ValueError):
        TrainingConfig(**kwargs)
    value = kwargs[key]
    toml = f"[training]\n{key} = {value!r}\n"  # Python's repr of these values is valid TOML
    (tmp_path / "c.toml").write_text(toml)
    with pytest.raises(ConfigError, match=f"training.{key}"):
        load_config(tmp_path / "c.toml")


def test_empty_and_zero_weight_steps_do_not_update():
    model = make_model()
    tr = DrafterTrainer(model, CFG)
    before = master_snapshot(tr)
    st = tr.step_empty()
    assert st.skipped and st.step == 0 and st.global_weight == 0
    assert all(torch.equal(a, b) for a, b in zip(before, master_snapshot(tr)))
    assert tr.agree(False, True) == (False, True)


def test_trainer_state_round_trip_bit_exact():
    a = DrafterTrainer(make_model(), CFG, compute_dtype=torch.bfloat16)
    a.step(*loss_sum(a.model, make_batch(N_TOK, 1)))
    state = a.state_dict()
    b = DrafterTrainer(make_model(), CFG, compute_dtype=torch.bfloat16)
    b.load_state_dict(state)
    assert b.step_count == 1
    for seed in (2, 3):
        a.step(*loss_sum(a.model, make_batch(N_TOK, seed)))
        b.step(*loss_sum(b.model, make_batch(N_TOK, seed)))
    assert all(torch.equal(x, y) for x, y in zip(master_snapshot(a), master_snapshot(b)))
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))


def _moments(tr: DrafterTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.moment_tensors().items()}


def _steps_match_a_fresh_optimizer(device: str, compute_dtype: torch.dtype) -> None:
    fresh = DrafterTrainer(make_model().to(device), CFG, compute_dtype=compute_dtype)
    early = DrafterTrainer(make_model().to(device), CFG, compute_dtype=compute_dtype)
    before = master_snapshot(early)
    early.allocate_optimizer_state()
    assert all(torch.equal(a, b) for a, b in zip(before, master_snapshot(early)))
    moments = _moments(early)
    assert len(moments) == 2 * len(early.master_params) and not fresh.moment_tensors()
    assert all(not m.any() for m in moments.values())
    assert all(int(s["step"]) == 0 for s in early.optimizer.state.values())
    for seed in STEP_SEEDS:
        for tr in (fresh, early):
            x, y, w = (t.to(device) for t in make_batch(N_TOK, seed))
            tr.step(*loss_sum(tr.model, (x, y, w)))
    assert all(torch.equal(a, b) for a, b in zip(master_snapshot(fresh), master_snapshot(early)))
    after = _moments(early)
    assert after.keys() == _moments(fresh).keys()
    assert all(torch.equal(after[k], v) for k, v in _moments(fresh).items())
    assert [int(s["step"]) for s in early.optimizer.state.values()] == [len(STEP_SEEDS)] * len(early.master_params)
    early.allocate_optimizer_state()  # has state now: a no-op
    assert all(torch.equal(after[k], v) for k, v in _moments(early).items())


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_optimizer_state_made_early_gives_the_steps_of_a_fresh_one(compute_dtype):
    _steps_match_a_fresh_optimizer("cpu", compute_dtype)


@pytest.mark.gpu
def test_optimizer_state_made_early_gives_the_steps_of_a_fresh_one_fused_on_cuda():
    _steps_match_a_fresh_optimizer("cuda:0", torch.bfloat16)


def test_init_distributed_world_of_one(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    info = init_distributed("gloo", 10.0)
    assert (info.rank, info.world_size, info.is_distributed, info.device.type) == (0, 1, False, "cpu")
    with pytest.raises(ValueError):
        init_distributed("mpi", 10.0)


# --------------------------------------------------------------------------- two gloo processes


def _worker(rank: int, port: int, out_dir: str) -> None:
    with process_group_rank(rank, port) as world:
        assert world.is_distributed and world.world_size == 2
        res: dict = {}
        # (a) each rank steps on its half; halves carry different supervised weights.
        model = make_model()
        tr = DrafterTrainer(model, CFG, world=world, bucket_mb=1e-4)
        norms = []
        for seed in STEP_SEEDS:
            half = split(make_batch(N_TOK, seed), SPLIT)[rank]
            st = tr.step(*loss_sum(model, half))
            norms.append((st.grad_norm, st.global_weight, st.local_weight, st.global_loss))
            assert tr.buckets_launched_in_backward >= 2  # all-reduce overlapped with backward
        res["halves"] = master_snapshot(tr)
        res["halves_stats"] = norms
        tr.close()

        # (b) rank 1 has no batch at all: it must participate and contribute nothing.
        model = make_model()
        tr = DrafterTrainer(model, CFG, world=world, bucket_mb=1e-4)
        for seed in STEP_SEEDS:
            if rank == 0:
                tr.step(*loss_sum(model, make_batch(N_TOK, seed)))
            else:
                st = tr.step_empty()
                assert st.local_weight == 0.0 and not st.skipped
        res["empty"] = master_snapshot(tr)

        # (c) the control all-reduce.
        res["agree"] = [
            tr.agree(rank == 1, False),
            tr.agree(False, rank == 0),
            tr.agree(False, False),
            tr.agree(True, True),
        ]
        # (d) unequal initial weights are replaced by rank 0's at construction.
        model = make_model()
        if rank == 1:
            with torch.no_grad():
                model.fc1.weight.add_(1.0)
        tr = DrafterTrainer(model, CFG, world=world)
        res["synced_fc1"] = model.fc1.weight.detach().clone()
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def dist_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    spawn_ranks(_worker, args=(free_port(), str(out)))
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def _reference_full_batch():
    model = make_model()
    tr = DrafterTrainer(model, CFG)
    stats = [tr.step(*loss_sum(model, make_batch(N_TOK, seed))) for seed in STEP_SEEDS]
    return master_snapshot(tr), stats


@pytest.mark.slow  # two gloo ranks (module fixture)
def test_two_ranks_token_weighted_equal_one_rank(dist_results):
    ref, ref_stats = _reference_full_batch()
    r0, r1 = dist_results
    # The halves really differ in supervised weight, so a mean of per-rank means would not match.
    b = make_batch(N_TOK, STEP_SEEDS[0])
    w0, w1 = b[2][:SPLIT].sum(), b[2][SPLIT:].sum()
    assert abs(float(w0) - float(w1)) > 0.5
    for a, c, r in zip(r0["halves"], r1["halves"], ref):
        assert torch.equal(a, c)  # ranks stay in lockstep
        torch.testing.assert_close(a, r, rtol=0, atol=1e-6)
    for (n0, gw0, lw0, gl0), (n1, gw1, lw1, _), st in zip(r0["halves_stats"], r1["halves_stats"], ref_stats):
        assert n0 == n1 == pytest.approx(st.grad_norm, rel=1e-5, abs=1e-6)
        assert gw0 == gw1 == pytest.approx(st.global_weight, rel=1e-6)
        assert lw0 + lw1 == pytest.approx(st.global_weight, rel=1e-6) and lw0 != lw1
        assert gl0 == pytest.approx(st.global_loss, rel=1e-5)


@pytest.mark.slow  # two gloo ranks (module fixture)
def test_empty_rank_participates_and_contributes_nothing(dist_results):
    ref, _ = _reference_full_batch()
    for res in dist_results:
        for a, r in zip(res["empty"], ref):
            torch.testing.assert_close(a, r, rtol=0, atol=1e-6)


@pytest.mark.slow  # two gloo ranks (module fixture)
def test_agree_and_initial_sync(dist_results):
    expected = [(True, False), (False, True), (False, False), (True, True)]
    assert dist_results[0]["agree"] == expected == dist_results[1]["agree"]
    assert torch.equal(dist_results[0]["synced_fc1"], dist_results[1]["synced_fc1"])
    assert torch.equal(dist_results[0]["synced_fc1"], make_model().fc1.weight.detach())


def test_distinfo_single_defaults():
    w = DistInfo.single()
    assert w.is_main and not w.is_distributed and w.comm_device.type == "cpu"


# --------------------------------------------------------------------------- GPU (nccl)


def _nccl_worker(rank: int, port: int, out_dir: str) -> None:
    with process_group_rank(rank, port, backend="nccl") as world:
        assert world.device == torch.device("cuda", rank)
        res: dict = {}
        for dtype in (torch.float32, torch.bfloat16):
            model = make_model().to(world.device)
            tr = DrafterTrainer(model, CFG, compute_dtype=dtype, world=world, bucket_mb=1e-4)
            for seed in STEP_SEEDS:
                if rank == 1 and seed == STEP_SEEDS[-1]:
                    tr.step_empty()  # last step: rank 1 has nothing, rank 0 still sends its half
                    continue
                half = split(make_batch(N_TOK, seed), SPLIT)[rank]
                st = tr.step(*loss_sum(model, tuple(t.to(world.device) for t in half)))
                assert st.global_weight > 0 and not st.skipped
            assert tr.agree(rank == 0, False) == (True, False)
            res[str(dtype)] = [p.detach().cpu() for p in tr.master_params]
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.gpu(2)
@pytest.mark.slow
def test_two_gpus_nccl_token_weighted(tmp_path):
    mp.spawn(_nccl_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2))
    for dtype, atol in ((torch.float32, 1e-6), (torch.bfloat16, 2e-2)):
        model = make_model().to("cuda:0")
        tr = DrafterTrainer(model, CFG, compute_dtype=dtype)
        for seed in STEP_SEEDS:
            b = make_batch(N_TOK, seed)
            if seed == STEP_SEEDS[-1]:
                b = split(b, SPLIT)[0]  # rank 1 was empty on the last step
            tr.step(*loss_sum(model, tuple(t.to("cuda:0") for t in b)))
        for a, c, r in zip(r0[str(dtype)], r1[str(dtype)], tr.master_params):
            assert torch.equal(a, c)
            torch.testing.assert_close(a, r.detach().cpu(), rtol=0, atol=atol)
