"""The drafter's pure core: trainer, ledger, checkpoints, metrics over a model built by ``drafter.model.build``. No sockets.

One training step, identical on every drafter rank (data parallel, lockstep)::

    batch (copied out of a ring) or none
        │
    agree(has_batch, stop)  ── no rank has a batch and no more will come ──▶ finish
        │                   ── stop requested ──▶ checkpoint at this boundary ──▶ finish
    compute_loss (at most anchors_per_batch anchors: drafter.max_anchors_per_batch or the follow-wait budget;
        │        concat planes + noise on this GPU; argmax hits -> eval-rule tau; anchor chunks: forward +
        │        trainer.accumulate each but the last) ─▶ trainer.step (last chunk's backward, token-weighted all-reduce)
        │   (a rank without a batch steps with zero weight, so collectives never hang)
    ledger += batch id ─▶ metrics.jsonl (+ TensorBoard events if run.tensorboard; rank 0)
        │
    anchor budget (follow-wait, drafter/training/anchor_budget.py): fed this step's wait_s and step_s; every
        │         drafter.anchor_window steps one all-reduce of the window's sums, the same move on every rank
    checkpoint every N steps (with the budget: a resumed run continues at the same anchors per batch)

The ledger holds the id of every batch whose gradient is inside the checkpointed weights;
on resume targets skip exactly those, so no consumed batch repeats and none is skipped.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from collections import deque
from pathlib import Path

import torch

from dflash_ipc.config import DFlashConfig
from dflash_ipc.control.drafter_tau import TRAINING_TAU_STEPS, DrafterTau, drafter_tau
from dflash_ipc.control.stats import DrafterWork, GpuMemory, ResumePoint
from dflash_ipc.control.wire import to_wire
from dflash_ipc.drafter.checkpoint.layout import run_config_hash
from dflash_ipc.drafter.checkpoint.store import (
    BatchLedger,
    gather_ledger,
    load_latest_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from dflash_ipc.drafter.checkpoint.verify import BATCHES_TRAINED_KEY, PLAN_FILE, read_plan, resume_ledger
from dflash_ipc.drafter.export.layout import export_drafter
from dflash_ipc.drafter.loss.objective import accuracy_per_pos, compute_loss, expected_acceptance_length
from dflash_ipc.drafter.model.build import build_drafter, run_draft_vocab
from dflash_ipc.drafter.model.dflash_drafter import num_parameters
from dflash_ipc.drafter.training.anchor_budget import AnchorBudget
from dflash_ipc.drafter.training.distributed import DistInfo
from dflash_ipc.drafter.training.holdout import HoldoutScore, score_holdout_batch
from dflash_ipc.drafter.training.learning import UpdateTally
from dflash_ipc.drafter.training.memory_plan import resolve_anchor_chunk
from dflash_ipc.drafter.training.metrics_log import MetricsLog
from dflash_ipc.drafter.training.time_budget import MEASURE_FROM, TimeBudget
from dflash_ipc.drafter.training.trainer import DrafterTrainer
from dflash_ipc.platform.devices import dtype_from_name
from dflash_ipc.rundir.fence import Fence
from dflash_ipc.rundir.fsutil import make_private_dir, write_text_atomic
from dflash_ipc.rundir.node_spec import read_node_spec
from dflash_ipc.transport.slots import SlotViews

log = logging.getLogger(__name__)


def planned_steps(cfg: DFlashConfig, run_dir: Path, world_size: int) -> int:
    """The optimizer steps a run plans: ``training.max_steps``, or every batch of the run's plan (``plan.json``,
    written by `up`) shared by the ``world_size`` data-parallel ranks."""
    plan = json.loads((run_dir / PLAN_FILE).read_text())
    return cfg.training.max_steps or max(1, -(-plan["n_batches_total"] // world_size))


class RecentRate:
    """Seconds per step and tokens per second over the last ``window`` steps (held-out passes and
    checkpoints inside it included), for the live rate and ETA; pure: fed each step's clock.

    The span starts at this process's ``start_after``-th step: the steps before it hold the compiles
    (a new shape per length bucket), which would otherwise read as a pace many times the real one."""

    def __init__(self, window: int = 50, start_after: int = 1) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1 step (got {window})")
        if start_after < 1:
            raise ValueError(f"start_after must be >= 1 step (got {start_after})")
        self._marks: deque[tuple[int, float, int]] = deque(maxlen=window + 1)
        self._to_skip = start_after - 1

    def observe(self, step: int, elapsed_s: float, tokens_total: int) -> None:
        if self._to_skip:
            self._to_skip -= 1
            return
        self._marks.append((step, elapsed_s, tokens_total))

    def _span(self) -> tuple[int, float, int] | None:
        if len(self._marks) < 2:
            return None
        (s0, t0, n0), (s1, t1, n1) = self._marks[0], self._marks[-1]
        return (s1 - s0, t1 - t0, n1 - n0) if s1 > s0 and t1 > t0 else None

    def step_s(self) -> float | None:
        span = self._span()
        return span[1] / span[0] if span else None

    def tokens_per_s(self) -> float | None:
        span = self._span()
        return span[2] / span[1] if span else None


class DrafterCore:
    def __init__(
        self,
        cfg: DFlashConfig,
        run_dir: Path,
        world: DistInfo,
        device: torch.device,
        total_steps: int,
        resume: bool,
        fence: Fence | None = None,
        target_need: int | None = None,
    ):
        self.cfg = cfg
        self.run_dir = run_dir
        # Every write to the run directory is fenced: refused once a newer `up` owns it (dflash_ipc.rundir.fence).
        self.fence = fence or Fence.none()
        self.world = world
        self.device = device
        dtype = dtype_from_name(cfg.drafter.dtype)
        self.model = build_drafter(cfg, device, log_mask_token=world.is_main, draft_vocab=run_draft_vocab(cfg, run_dir))
        self.trainer = DrafterTrainer(self.model, cfg.training, compute_dtype=dtype, world=world, total_steps=max(1, total_steps))
        # drafter.anchor_chunk "auto" becomes this GPU's chunk here; the run's config hash keeps "auto"
        self.cfg, why = resolve_anchor_chunk(cfg, self.model, device, target_need)
        if why:
            log.info("%s", why)
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(cfg.run.seed * 1000 + world.rank)
        self.ledger = BatchLedger()
        self._new_ids: list[tuple] = []
        self.step = 0
        self.resumed_from: ResumePoint | None = None
        self.last_checkpoint: tuple[int, Path | None] | None = None
        # Several nodes: global rank 0 writes, every node resumes from the shared root (runtime/nodes.py).
        self.shared_root = read_node_spec(run_dir).shared_root(run_dir)
        self.ckpt_root = self.shared_root / "checkpoints"
        self.plan = read_plan(run_dir)  # plan.json, written by `up` (None outside a run)
        self.trained_ids: list[tuple] = []  # every batch this rank trained on in this process (its own ledger)
        self.config_hash = run_config_hash(cfg.to_dict())
        self.metrics = MetricsLog(run_dir, self.fence)  # written by global rank 0
        self.tokens_total = 0
        self.t_start = time.perf_counter()
        self.t_first_step: float | None = None  # when this process's first training step began
        self.time_budget = TimeBudget(cfg.training.max_seconds, cfg.training.max_steps) if cfg.training.max_seconds > 0 else None
        self.recent = RecentRate(start_after=MEASURE_FROM)  # the time budget skips the same compiles
        self.last: dict = {}
        self.updates = UpdateTally()  # whether the run learned anything (drafter/training/learning.py), asked before writing weights
        self.batches_trained = 0  # by every rank, since the ledger began: what the ledger must hold (checkpoint.verify)
        self.n_params = num_parameters(self.model)
        self.target_hidden_size = self.model.config.hidden_size  # equal to the target's (DrafterModelConfig.from_configs)
        self.warmup_s: float | None = None
        # Held-out passes (training.holdout_every; drafter 0 only): per pass (summed scores, batches in)
        self._holdout_sums: dict[int, tuple[HoldoutScore, int]] = {}
        self._holdout_unlogged: dict = {}  # the last completed pass, for the next metrics record
        self.holdout_last: dict = {}
        self._recent_accept: deque[tuple[float, float]] = deque(maxlen=TRAINING_TAU_STEPS)  # training τ when none held out
        self.anchor_budget = self._anchor_budget()
        if resume:
            self._resume()
        if cfg.run.tensorboard and world.is_main:
            self.metrics.open_tensorboard(purge_step=self.step + 1 if resume else None)

    def _anchor_budget(self) -> AnchorBudget | None:
        d = self.cfg.drafter
        if d.anchor_budget != "follow-wait":
            return None
        # Not counted: the steps that drain the backlog a ring's depth of slots built while this drafter warmed up.
        settle = self.cfg.transport.ring_slots + 2
        cap = d.resolved_max_anchors_auto()
        return AnchorBudget(d.max_anchors_per_batch, d.anchor_chunk, cap, d.anchor_target_wait, d.anchor_window, settle_steps=settle)

    @property
    def anchors_per_batch(self) -> int:
        """The most anchors the next batch trains on (0: every sampled anchor)."""
        return self.anchor_budget.anchors if self.anchor_budget else self.cfg.drafter.max_anchors_per_batch

    def _sum_over_ranks(self, wait_s: float, step_s: float) -> tuple[float, float]:
        if not self.world.is_distributed:
            return wait_s, step_s
        sums = torch.tensor([wait_s, step_s], dtype=torch.float64, device=self.world.comm_device)
        torch.distributed.all_reduce(sums)
        return float(sums[0]), float(sums[1])

    def _min_over_ranks(self, value: int) -> int:
        if not self.world.is_distributed:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.world.comm_device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return int(t.item())

    def close(self) -> None:
        self.metrics.close()

    def _resume(self) -> None:
        # strict: checkpoints that all fail verification end this process; it never trains again from step 0
        shapes = self.trainer.checkpoint_shapes()  # a checkpoint holding other tensors, or other shapes, is passed over
        ckpt = load_latest_checkpoint(self.ckpt_root, map_location=self.device, plan=self.plan, strict=True, expected_shapes=shapes)
        if ckpt is None:
            log.info("resume: no checkpoint under %s, starting fresh", self.ckpt_root)
            if self.world.is_main:  # a run that crashed before its first checkpoint logged steps trained again now
                self.metrics.drop_after(0)
            return
        self.trainer.load_state_dict(ckpt.trainer_state, master=ckpt.model_state, moments=ckpt.optimizer_tensors)
        set_rng_state(ckpt.rng_state)
        self.generator.manual_seed(self.cfg.run.seed * 1000 + self.world.rank + 7919 * ckpt.step)
        # the targets skip the same batches (checkpoint.verify.resume_ledger): none after `up --replan` re-planned changed data
        self.ledger = resume_ledger(ckpt.path, self.run_dir)
        self.batches_trained = len(self.ledger)  # as many as its steps trained (checkpoint.verify checked); none after --replan
        self.step = ckpt.step
        self.updates.mark(ckpt.step)
        if self.anchor_budget is not None and "anchor_budget" in ckpt.extra:
            self.anchor_budget.load_state_dict(ckpt.extra["anchor_budget"])
            log.info("resume: %d anchors per batch (follow-wait, from the checkpoint)", self.anchor_budget.anchors)
        if self.time_budget is not None:
            kept = ckpt.extra.get("time_budget", {})
            spent = float(kept.get("spent_s", 0.0))
            t = self.cfg.training
            self.time_budget = TimeBudget(t.max_seconds, t.max_steps, spent, ckpt.step, kept.get("seconds_per_step"))
            if self.time_budget.total_steps is not None:
                self.trainer.set_total_steps(self.time_budget.total_steps)
            log.info("resume: %.1f s of max_seconds %g trained; plan ends at step %s", spent, t.max_seconds, self.time_budget.total_steps)
        self.resumed_from = ResumePoint(checkpoint=str(ckpt.path), step=ckpt.step, notes=list(ckpt.notes))
        self.last_checkpoint = (ckpt.step, ckpt.path)
        if self.world.is_main:
            self.metrics.drop_after(ckpt.step)
        log.info("resumed from %s: step %d, %d batches in the ledger", ckpt.path, ckpt.step, len(self.ledger))

    # -- warm-up
    def warm_up(self) -> float:
        """One forward+backward on a dummy batch of the configured shapes; returns its seconds.

        Compiles flex attention and makes the first step's allocations before the handshake,
        AdamW's moments included (zeros, as its first step makes them), so a (re)started run never
        leaves the targets waiting on the drafter's first step, and a device too small for a step
        fails here. It changes no weight, ledger, step count, metrics or RNG stream (its anchors and
        noise come from a generator of its own); its gradients are discarded. Local to this rank:
        no collective.
        """
        t0 = time.perf_counter()
        self.trainer.allocate_optimizer_state()  # first: a step's forward+backward runs beside the moments
        views = self._dummy_batch()
        generator = torch.Generator(device=self.device)
        generator.manual_seed(0)
        out = compute_loss(self.model, views, self.cfg.drafter, self.cfg.training, generator, lambda chunk: chunk.backward())
        out.loss_sum.backward()
        self.trainer.discard_grads()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    def _dummy_batch(self) -> SlotViews:
        """A full batch as the targets send it: token budget filled with max_seq_len documents, all supervised."""
        data, n = self.cfg.data, self.cfg.data.token_budget
        lens = [data.max_seq_len] * (n // data.max_seq_len) + ([n % data.max_seq_len] if n % data.max_seq_len else [])
        planes = self.model.config.num_context_planes + int(self.cfg.target.capture_last_hidden)
        # Drawn where it is used: a host draw in fp32 would stage planes x tokens x hidden
        # floats in every drafter's host memory, at start-up.
        g = torch.Generator(device=self.device).manual_seed(0)
        dtype = dtype_from_name(self.cfg.target.dtype)
        return SlotViews(
            planes=torch.randn(planes, n, self.target_hidden_size, generator=g, device=self.device, dtype=dtype),
            token_ids=torch.randint(0, self.model.config.vocab_size, (n,), generator=g, device=self.device),
            loss_mask=torch.ones(n, dtype=torch.uint8, device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
        )

    # -- training
    @property
    def end_step(self) -> int:
        """The step training ends at: training.max_steps, or the time budget's plan; 0: until the data ends."""
        planned = self.time_budget.total_steps if self.time_budget is not None else None
        if planned is None:
            return self.cfg.training.max_steps
        return planned

    def end_reason(self) -> str:
        end, cap = self.end_step, self.cfg.training.max_steps
        if self.time_budget is not None and self.time_budget.total_steps == end and (not cap or end < cap):
            return f"max_seconds {self.cfg.training.max_seconds:g} (planned step {end})"
        return f"max_steps {end}"

    def train_step(self, views: SlotViews | None, batch_id: list | None, wait_s: float, copy_s: float) -> dict:
        t0 = time.perf_counter()
        if self.t_first_step is None:
            self.t_first_step = t0 - wait_s  # the wait for the first batch is training time too
        anchors = self.anchors_per_batch
        if views is not None:
            drafter_cfg = self.cfg.drafter
            if anchors != drafter_cfg.max_anchors_per_batch:
                drafter_cfg = dataclasses.replace(drafter_cfg, max_anchors_per_batch=anchors)
            out = compute_loss(self.model, views, drafter_cfg, self.cfg.training, self.generator, self.trainer.accumulate)
            t_fwd = time.perf_counter()  # with anchor chunks: every chunk's forward and all but the last's backward
            stats = self.trainer.step(out.loss_sum, out.weight_sum)
            correct, count = out.correct_per_pos.detach(), out.count_per_pos.detach()
            accept = torch.stack([out.accept_len_sum, out.accept_blocks]).detach().float()
            n_tokens = int(views.token_ids.numel())
            self._new_ids.append(tuple(batch_id))
            self.trained_ids.append(tuple(batch_id))
        else:
            t_fwd = time.perf_counter()
            stats = self.trainer.step_empty()
            bs = self.model.config.block_size
            correct = torch.zeros(bs, device=self.device)
            count = torch.zeros(bs, device=self.device)
            accept = torch.zeros(2, device=self.device)
            n_tokens = 0
        # the batches every rank trained this step, counted apart from their ids (the ledger must agree: checkpoint.verify)
        counts = torch.tensor([float(n_tokens), float(views is not None)], device=self.device)
        sums = torch.cat([correct.float(), count.float(), accept, counts])
        if self.world.is_distributed:
            torch.distributed.all_reduce(sums)
        bs = self.model.config.block_size
        acc = accuracy_per_pos(sums[:bs], sums[bs : 2 * bs])
        accept_len_sum, accept_blocks = sums[2 * bs].item(), sums[2 * bs + 1].item()
        self._recent_accept.append((accept_len_sum, accept_blocks))
        tokens = int(sums[-2].item())
        self.step += 1
        self.tokens_total += tokens
        self.batches_trained += int(sums[-1].item())
        dt = time.perf_counter() - t0
        acc_list = [round(float(a), 4) if not math.isnan(float(a)) else None for a in acc.tolist()]
        acc_valid = [a for a in acc_list[1:] if a is not None]
        elapsed = time.perf_counter() - self.t_start
        self.recent.observe(self.step, elapsed, self.tokens_total)
        rec = {
            "step": self.step,
            "loss": stats.global_loss,
            "tokens": tokens,
            "tokens_per_s": tokens / max(1e-9, dt + wait_s),
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "acc": round(sum(acc_valid) / len(acc_valid), 4) if acc_valid else None,
            "acc_per_pos": acc_list,
            # tau by eval's rule (joint prefix acceptance per block, + bonus) on this training batch,
            # before the optimizer step; held-out tau comes from `dflash-ipc eval`. tau_marginal:
            # the product of per-slot accuracies, kept for comparison with earlier runs.
            "tau": round(accept_len_sum / accept_blocks, 4) if accept_blocks > 0 else None,
            "tau_marginal": round(expected_acceptance_length([0.0 if a is None else a for a in acc_list]), 4),
            "tau_blocks": int(accept_blocks),
            "wait_s": wait_s,
            "copy_s": copy_s,
            "forward_s": t_fwd - t0,
            "backward_s": stats.backward_s,
            "allreduce_s": stats.allreduce_s,
            "optimizer_s": stats.optimizer_s,
            "step_s": dt,
            "elapsed_s": elapsed,
            "skipped": stats.skipped,
            "anchors": anchors,  # the most anchors this step trained on per batch (0: no cap)
        }
        if self.time_budget is not None:
            # every rank, every step: a plan point is a collective (the smallest plan over the ranks)
            planned_before = self.time_budget.total_steps
            plan = self.time_budget.observe(self.step, time.perf_counter() - self.t_first_step, self._min_over_ranks)
            if plan is not None:
                self.trainer.set_total_steps(plan.total_steps)
                # plans come every step near the end: say only the ones that move it
                if self.world.is_main and plan.total_steps != planned_before:
                    log.info("%s", plan.describe())
        if self.anchor_budget is not None:
            # every rank, every step: a window's end is a collective (held-out passes never come here)
            change = self.anchor_budget.observe(wait_s, dt, self._sum_over_ranks)
            if change is not None and self.world.is_main:
                log.info("%s", change.describe())
        if self._holdout_unlogged:
            rec.update(self._holdout_unlogged)
            self._holdout_unlogged = {}
        self.last = rec
        if self.world.is_main:
            self.metrics.write(rec)
        # global figures (all-reduced): every rank raises at the same step, no collective is left waiting
        limit = self.cfg.training.max_consecutive_skipped_updates
        self.updates.observe(self.step, stats.skipped, stats.grad_norm, stats.global_weight, stats.global_loss, limit)
        return rec

    # -- held-out passes
    def evaluate_holdout(self, views: SlotViews, batch_id: list, pass_batches: int) -> dict | None:
        """Held-out τ of a batch by simulated decoding (drafter/training/holdout.py): no gradient, no optimizer
        step, no ledger, no collective, noise off, the training RNG stream untouched.

        ``tau_holdout``: eval's decode replayed on the answers (blocks at every position, chained from
        the first answer token, ``training.holdout_max_new`` answer tokens); ``tau_holdout_uniform``:
        the earlier estimate, blocks at uniformly drawn anchors (the same blocks every pass). Returns
        the pass's record once its ``pass_batches``-th batch is in (logged with the next step's
        metrics), else None.
        """
        pass_id, _, index = batch_id
        t = self.cfg.training
        got = score_holdout_batch(self.model, views, self.cfg.drafter, t, self.cfg.run.seed * 1_000_003 + 7919 + index, t.holdout_max_new)
        prev, batches = self._holdout_sums.get(pass_id, (None, 0))
        if prev is not None:
            got = HoldoutScore(*(a + b for a, b in zip(dataclasses.astuple(prev), dataclasses.astuple(got))))
        if batches + 1 < pass_batches:
            self._holdout_sums[pass_id] = (got, batches + 1)
            return None
        self._holdout_sums.pop(pass_id, None)
        rec = {
            "tau_holdout": round(got.tokens / got.steps, 4) if got.steps > 0 else None,
            "tau_holdout_steps": got.steps,
            "tau_holdout_answers": got.answers,
            "tau_holdout_blocks": got.blocks,
            "tau_holdout_uniform": round(got.uniform_accept_sum / got.uniform_blocks, 4) if got.uniform_blocks > 0 else None,
            "tau_holdout_uniform_blocks": got.uniform_blocks,
            "loss_holdout": round(got.ce_sum / got.weight_sum, 4) if got.weight_sum > 0 else None,
            "holdout_max_new": t.holdout_max_new,
            "holdout_pass": pass_id,
            "holdout_step": self.step,  # the weights it was measured on: after this many optimizer steps
        }
        self.holdout_last = self._holdout_unlogged = rec
        log.info(
            "held-out pass %d at step %d: tau %s (simulated decode: %d answers, %d steps; max_new %d), uniform-anchor tau %s, loss %s",
            pass_id,
            self.step,
            rec["tau_holdout"],
            got.answers,
            got.steps,
            t.holdout_max_new,
            rec["tau_holdout_uniform"],
            rec["loss_holdout"],
        )
        return rec

    # -- checkpoints
    def checkpoint(self, reason: str) -> Path | None:
        """Collective: every rank calls it at the same step boundary.

        A step that is already checkpointed (the periodic checkpoint fell on the last step) is
        not written again; its path is returned."""
        if self.last_checkpoint is not None and self.last_checkpoint[0] == self.step:
            return self.last_checkpoint[1]
        self.updates.check_before_writing(self.step, self.trainer.trainable_tensors(), "checkpoint")
        ids = gather_ledger(self._new_ids, self.world)
        self.ledger.add(ids)
        self._new_ids = []
        path = None
        if self.world.is_main:
            path = save_checkpoint(
                self.ckpt_root,
                self.step,
                # the weights stay on the device: the writer streams them through one bounded buffer
                model_state=dict(self.trainer.trainable_tensors()),
                trainer_state=self.trainer.state_dict(include_master=False, include_moments=False),
                optimizer_tensors=self.trainer.moment_tensors(),
                rng_state=rng_state(),
                ledger=self.ledger,
                extra=self._checkpoint_extra(reason),
                config_hash=self.config_hash,
                keep=self.cfg.training.keep_checkpoints,
                fence=self.fence,
            )
            log.info("checkpoint %s (%s): %d batches in the ledger", path, reason, len(self.ledger))
        self.last_checkpoint = (self.step, path)
        self.updates.mark(self.step)
        return path

    def _checkpoint_extra(self, reason: str) -> dict:
        # the config itself, so a resume can name the keys that differ (runtime/resume_check.py)
        extra = {"reason": reason, "tokens_total": self.tokens_total, "config": self.cfg.to_dict()}
        extra[BATCHES_TRAINED_KEY] = self.batches_trained
        if self.plan is not None:  # which batches the ledger's ids are (data/fingerprint.py)
            extra["data"] = self.plan.get("data_fingerprint")
        if self.anchor_budget is not None:
            extra["anchor_budget"] = self.anchor_budget.state_dict()
        if self.time_budget is not None:
            extra["time_budget"] = self.time_budget.state_dict()
        tau = self.drafter_tau()
        if tau is not None:  # `export` says whether these weights are worth serving
            extra["drafter_tau"] = to_wire(tau)
        return extra

    def drafter_tau(self) -> DrafterTau | None:
        """Held-out τ of the last pass, else training τ of the last steps (control/drafter_tau.py)."""
        return drafter_tau(self.holdout_last, list(self._recent_accept), self.step)

    def export(self) -> Path | None:
        # every rank asks (the same answer): a rank that stopped here alone would leave its peers in the next collective
        self.updates.check_before_writing(self.step, self.trainer.trainable_tensors(), "export")
        if not self.world.is_main:
            return None
        out = self.shared_root / "export" / "drafter"
        with self.fence.guard(f"the export to {out}"):  # written beside it, swapped in whole; no link followed
            make_private_dir(out.parent, root=self.shared_root)
            export_drafter(
                self.model, out, chat_template_kwargs=self.cfg.chat_template.kwargs, drafter_tau=self.drafter_tau(), root=self.shared_root
            )
        return out

    def weights_digest(self) -> str:
        """sha256 of this rank's trainable weights (data parallel: the same on every rank).

        One tensor on the host at a time: copying the whole state first would hold the fp32
        weights twice over on the host (the tensors and their bytes), a drafter's peak host RSS."""
        h = hashlib.sha256()
        for name, t in sorted(self.trainer.trainable_tensors(), key=lambda item: item[0]):
            h.update(name.encode())
            h.update(t.to("cpu", torch.float32).contiguous().numpy())
        return h.hexdigest()

    def write_rank_record(self) -> Path:
        """RUN_DIR/ranks/rank-<global>.json: this rank's step, weights digest and the batches it trained on."""
        out = self.run_dir / "ranks" / f"rank-{self.world.rank}.json"
        make_private_dir(out.parent, root=self.run_dir)
        digest = self.weights_digest()
        rec = {"rank": self.world.rank, "step": self.step, "weights_sha256": digest, "batch_ids": [list(b) for b in self.trained_ids]}
        with self.fence.guard(f"the rank record {out.name}"):
            write_text_atomic(out, json.dumps(rec) + "\n", root=self.run_dir)
        log.info("rank record %s: step %d, weights sha256 %s", out, self.step, digest[:16])
        return out

    def stats(self) -> DrafterWork:
        wall = max(1e-9, time.perf_counter() - self.t_start)
        last = self.last
        return DrafterWork(
            step=self.step,
            loss=float(last["loss"]) if last else None,
            acc=last["acc"] if last else None,
            tau=float(last["tau"]) if last else None,
            tokens_per_s=self.tokens_total / wall,
            tokens=self.tokens_total,
            params=self.n_params,
            train_elapsed_s=last["elapsed_s"] if last else None,
            gpu=GpuMemory.of(self.device),
            warmup_s=self.warmup_s,
            recent_step_s=self.recent.step_s(),
            recent_tokens_per_s=self.recent.tokens_per_s(),
            tau_holdout=self.holdout_last.get("tau_holdout"),
            tau_holdout_blocks=self.holdout_last.get("tau_holdout_blocks", 0),
            tau_holdout_steps=self.holdout_last.get("tau_holdout_steps", 0),
            tau_holdout_uniform=self.holdout_last.get("tau_holdout_uniform"),
            holdout_step=self.holdout_last.get("holdout_step"),
            anchors=self.anchors_per_batch,
            end_step=self.end_step,
        )
