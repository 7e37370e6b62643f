"""Data-parallel drafter optimisation: fp32 master weights, token-weighted gradient all-reduce.

Model-agnostic: :class:`DrafterTrainer` works for any ``nn.Module``; only parameters with
``requires_grad`` are trained (a frozen embedding / LM head is left alone).

Numerics
    The model's trainable parameters live in ``compute_dtype`` (bf16 on GPU) as views into one
    flat compute buffer. The optimizer owns fp32 *master* copies (views into one flat fp32
    buffer) and fp32 gradients (views into one flat fp32 buffer). After each optimizer step
    the master buffer is copied back into the compute buffer in one kernel. When the compute
    dtype already is the master dtype (float32 on CPU) there is a single copy: the model's
    parameters *are* the master weights and autograd accumulates straight into the flat
    gradient buffer.

Data parallelism with token weighting
    Every rank calls :meth:`DrafterTrainer.step` with ``loss_sum`` (a *sum* of weighted
    per-token losses) and ``weight_sum`` (the sum of those weights). Backward runs on the local
    sum; gradients are all-reduced (SUM) in a few flat buckets, launched in a fixed order while
    backward is still running, together with the weight sums (two fp32 scalars ride in the
    first bucket), and divided by the *global* weight sum. The result equals one process
    stepping on the concatenation of every rank's batch. A rank with no batch calls
    :meth:`DrafterTrainer.step_empty` and contributes zeros, so collectives never hang.
    No DDP wrapper is used.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dflash_ipc.config import TrainingConfig
from dflash_ipc.drafter.checkpoint.store import cpu_snapshot
from dflash_ipc.drafter.checkpoint.values import ModelShapes
from dflash_ipc.drafter.training.distributed import DistInfo
from dflash_ipc.drafter.training.schedule import lr_at

log = logging.getLogger(__name__)

_HEADER = 4  # fp32 scalars at the front of the flat gradient buffer: weight_sum, loss_sum, 2 reserved
_ALIGN_ELEMS = 16  # each parameter's slot starts on a 64-byte boundary (fp32)
_STATE_FORMAT = 2  # 2: the master weights may live outside the state (the checkpoint's model.safetensors)
_READABLE_FORMATS = (1, 2)


# --------------------------------------------------------------------------- trainer


@dataclass
class StepStats:
    step: int  # optimizer steps taken after this call
    lr: float
    grad_norm: float  # global, after dividing by the global weight, before clipping
    global_weight: float
    global_loss: float  # global loss_sum / global weight_sum (nan when the weight is 0)
    local_weight: float
    backward_s: float
    allreduce_s: float  # time waiting for the all-reduce after backward (the rest overlaps)
    optimizer_s: float
    skipped: bool = False  # True: no parameter update (zero global weight or non-finite grads)
    clipped: bool = False


class DrafterTrainer:
    """AdamW over a model's trainable parameters, fp32 master weights, token-weighted DP."""

    def __init__(
        self,
        model: nn.Module,
        training_cfg: TrainingConfig,
        *,
        compute_dtype: torch.dtype | None = None,
        world: DistInfo | None = None,
        total_steps: int | None = None,
        bucket_mb: float = 25.0,
        sync_initial: bool = True,
        sync_timing: bool = True,
        eps: float = 1e-8,
    ):
        self.model = model
        self.cfg = training_cfg
        self.world = world if world is not None else DistInfo.single()
        self.sync_timing = sync_timing
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (requires_grad=True)")
        devices = {p.device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"trainable parameters must all be on one device (found {sorted(map(str, devices))})")
        self.device = devices.pop()
        if compute_dtype is None:
            compute_dtype = named[0][1].dtype
        if not compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating dtype (got {compute_dtype})")
        self.compute_dtype = compute_dtype
        self.master_dtype = torch.float64 if compute_dtype == torch.float64 else torch.float32
        self.single_copy = compute_dtype == self.master_dtype
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]  # model parameters (compute dtype)
        self.total_steps = self._resolve_total_steps(total_steps)
        self.step_count = 0

        # Flat layout: gradients are produced roughly in reverse registration order, so slots
        # (and buckets) follow reverse order to let early buckets launch during backward.
        order = list(range(len(self.params)))[::-1]
        self._allocate_flat_buffers(order)
        self._plan_buckets(order, bucket_mb)
        self._pending: list[int] = []
        self._next_launch = 0
        self._works: list[Any] = []
        self._in_backward = False
        self._accumulating = False
        self._accumulated: torch.Tensor | None = None  # loss sum of the micro-batches backpropagated so far
        self._seen: list[bool] = []
        self.buckets_launched_in_backward = 0
        self.optimizer = self._build_optimizer(eps)

        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(self.params)]
        self._relink_warned = False
        if self.world.is_distributed:
            self._check_layout()
            if sync_initial:
                dist.broadcast(self._master_flat, src=0)
                if not self.single_copy:
                    self._compute_flat.copy_(self._master_flat)

    # ------------------------------------------------------------------ setup helpers

    def _allocate_flat_buffers(self, order: list[int]) -> None:
        """The flat master, compute and gradient buffers (each parameter's slot aligned, in ``order``),
        and every parameter re-pointed at its views: the model's at the compute buffer, the
        optimizer's fp32 masters at the master buffer, both sharing the gradient buffer."""
        offsets: dict[int, int] = {}
        off = 0
        for i in order:
            offsets[i] = off
            off += -(-self.params[i].numel() // _ALIGN_ELEMS) * _ALIGN_ELEMS
        self.numel = off
        self._offsets = [offsets[i] for i in range(len(self.params))]

        dev = self.device
        self._master_flat = torch.zeros(self.numel, dtype=self.master_dtype, device=dev)
        self._grad_buf = torch.zeros(_HEADER + self.numel, dtype=self.master_dtype, device=dev)
        self._grad_flat = self._grad_buf[_HEADER:]
        self._local_w = torch.zeros(1, dtype=self.master_dtype, device=dev)
        if self.single_copy:
            self._compute_flat = self._master_flat
        else:
            self._compute_flat = torch.zeros(self.numel, dtype=self.compute_dtype, device=dev)

        self._master_views: list[torch.Tensor] = []
        self._compute_views: list[torch.Tensor] = []
        self._grad_views: list[torch.Tensor] = []
        self.master_params: list[nn.Parameter] = []
        with torch.no_grad():
            for p, o in zip(self.params, self._offsets):
                n = p.numel()
                mv = self._master_flat[o : o + n].view(p.shape)
                cv = self._compute_flat[o : o + n].view(p.shape)
                gv = self._grad_flat[o : o + n].view(p.shape)
                mv.copy_(p.detach())  # from the original values, before any down-cast
                if not self.single_copy:
                    cv.copy_(mv)
                p.data = cv
                p.grad = gv if self.single_copy else None
                mp = nn.Parameter(mv, requires_grad=True)
                mp.grad = gv
                self._master_views.append(mv)
                self._compute_views.append(cv)
                self._grad_views.append(gv)
                self.master_params.append(mp)

    def _plan_buckets(self, order: list[int], bucket_mb: float) -> None:
        """All-reduce buckets over the flat gradient buffer (header included in bucket 0), cut at
        parameter slots in ``order`` once ``bucket_mb`` is reached, and each parameter's bucket."""
        bucket_elems = max(1, int(bucket_mb * 2**20) // self._grad_buf.element_size())
        self._bucket_bounds: list[tuple[int, int]] = []
        self._param_bucket = [0] * len(self.params)
        start = 0
        cur_end = _HEADER
        for i in order:
            end = _HEADER + self._offsets[i] + -(-self.params[i].numel() // _ALIGN_ELEMS) * _ALIGN_ELEMS
            if cur_end - start >= bucket_elems and cur_end > start:
                self._bucket_bounds.append((start, cur_end))
                start = cur_end
            self._param_bucket[i] = len(self._bucket_bounds)
            cur_end = end
        self._bucket_bounds.append((start, cur_end))
        self._bucket_sizes = [0] * len(self._bucket_bounds)
        for b in self._param_bucket:
            self._bucket_sizes[b] += 1

    def _build_optimizer(self, eps: float) -> torch.optim.AdamW:
        """AdamW over the fp32 masters: weight decay on matrices only (group 0 when there are any)."""
        decay = [mp for mp in self.master_params if mp.ndim >= 2]
        no_decay = [mp for mp in self.master_params if mp.ndim < 2]
        groups = []
        self._decay_group = 0 if decay else -1
        if decay:
            groups.append({"params": decay, "weight_decay": self.cfg.weight_decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        opt_kwargs: dict[str, Any] = dict(lr=self.cfg.lr, betas=tuple(self.cfg.betas), eps=eps)
        if self.device.type == "cuda":
            opt_kwargs["fused"] = True
        return torch.optim.AdamW(groups, **opt_kwargs)

    def _resolve_total_steps(self, total_steps: int | None) -> int:
        if self.cfg.max_steps > 0:
            return self.cfg.max_steps
        if total_steps is None or total_steps < 1:
            raise ValueError(
                "training.max_steps is 0 (run until the data is exhausted): pass total_steps=<estimated "
                "number of optimizer steps> so the cosine schedule knows where to end"
            )
        return int(total_steps)

    def set_total_steps(self, total_steps: int) -> None:
        """Update the schedule length: the data's estimate (training.max_steps = 0) or the time budget's plan
        (training.max_seconds, drafter/training/time_budget.py; it already respects max_steps)."""
        if self.cfg.max_seconds > 0:
            self.total_steps = max(1, int(total_steps))
            return
        self.total_steps = self._resolve_total_steps(total_steps)

    def _check_layout(self) -> None:
        t = torch.tensor([self.numel, -self.numel, len(self.params), -len(self.params)], dtype=torch.int64, device=self.world.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]) or int(t[2]) != -int(t[3]):
            raise RuntimeError(
                "drafter ranks disagree on the trainable parameter layout "
                f"(this rank: {len(self.params)} tensors / {self.numel} elements); every rank must build the same model"
            )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ backward + all-reduce

    def _make_hook(self, idx: int):
        def hook(p: torch.Tensor) -> None:
            if not self._in_backward:
                return
            g = p.grad
            if g is None:
                return
            slot = self._grad_views[idx]
            if g.data_ptr() != slot.data_ptr():
                # single copy: g already holds the sum; else p.grad starts empty and the slot accumulates
                slot.copy_(g) if self.single_copy else slot.add_(g)
                p.grad = slot if self.single_copy else None
            if self._accumulating or self._seen[idx]:
                return
            self._seen[idx] = True
            b = self._param_bucket[idx]
            self._pending[b] -= 1
            self._launch_ready()

        return hook

    def _launch_ready(self) -> None:
        while self._next_launch < len(self._pending) and self._pending[self._next_launch] == 0:
            self._launch(self._next_launch)

    def _launch(self, b: int) -> None:
        self._next_launch = b + 1
        if self._in_backward:
            self.buckets_launched_in_backward += 1
        if self.world.is_distributed:
            s, e = self._bucket_bounds[b]
            self._works.append(dist.all_reduce(self._grad_buf[s:e], op=dist.ReduceOp.SUM, async_op=True))

    def _begin(self, loss_sum: torch.Tensor | None, weight_sum: Any) -> None:
        if self._accumulated is None:
            self._ensure_linked()
            self._grad_buf.zero_()
        if isinstance(weight_sum, torch.Tensor):
            w = weight_sum.detach().reshape(1).to(self._grad_buf.dtype)
            self._grad_buf[0:1].copy_(w)
        else:
            self._grad_buf[0] = float(weight_sum)
        # Local weight kept aside (bucket 0 gets summed in place); read with the header, one sync.
        self._local_w.copy_(self._grad_buf[0:1])
        if loss_sum is not None:
            self._grad_buf[1:2].copy_(loss_sum.detach().reshape(1))
        if self._accumulated is not None:
            self._grad_buf[1:2].add_(self._accumulated)
            self._accumulated = None
        self._pending = list(self._bucket_sizes)
        self._seen = [False] * len(self.params)
        self._next_launch = 0
        self._works = []
        self.buckets_launched_in_backward = 0  # overlap diagnostics: buckets sent while backward ran

    def _ensure_linked(self) -> None:
        """Re-attach model parameters whose storage was replaced behind our back."""
        for i, (p, cv) in enumerate(zip(self.params, self._compute_views)):
            if p.data_ptr() != cv.data_ptr() or p.dtype != cv.dtype or p.shape != cv.shape:
                if not self._relink_warned:
                    log.warning(
                        "trainable parameter %s was replaced outside the trainer; re-linking it to the "
                        "master weights (its new values are discarded)",
                        self.names[i],
                    )
                    self._relink_warned = True
                p.data = cv
                if self.single_copy:
                    p.grad = self._grad_views[i]

    def _sync(self) -> None:
        if self.sync_timing and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self, loss_sum: torch.Tensor | None, weight_sum: float | torch.Tensor) -> StepStats:
        """Backward ``loss_sum``, all-reduce gradients and weights, divide by the global weight, clip, step.

        ``loss_sum`` is a *sum* of weighted per-token losses and ``weight_sum`` the sum of those
        weights on this rank. ``loss_sum=None`` (and weight 0) is an empty participation.
        Every rank of the group must call this (or :meth:`step_empty`) once per step.
        """
        t0 = time.perf_counter()
        self._begin(loss_sum, weight_sum)
        if loss_sum is not None:
            if not loss_sum.requires_grad:
                raise ValueError("loss_sum does not require grad; pass None (or call step_empty) for an empty step")
            self._in_backward = True
            try:
                loss_sum.backward()
            finally:
                self._in_backward = False
        self._launch_remaining()
        self._sync()
        t1 = time.perf_counter()
        for w in self._works:
            w.wait()
        self._works = []
        global_w, global_loss_sum, local_w = torch.cat([self._grad_buf[:2], self._local_w]).tolist()  # one sync
        t2 = time.perf_counter()
        stats = self._apply(global_w, global_loss_sum)
        t3 = time.perf_counter()
        stats.local_weight = local_w
        stats.backward_s, stats.allreduce_s, stats.optimizer_s = t1 - t0, t2 - t1, t3 - t2
        return stats

    def accumulate(self, loss_sum: torch.Tensor) -> None:
        """Backward one micro-batch's ``loss_sum`` into the gradient buffer (no communication, no update); the
        next :meth:`step` (the last micro-batch's loss, the whole batch's weight) makes one step over their union."""
        if self._accumulated is None:
            self._ensure_linked()
            self._grad_buf.zero_()
            self._accumulated = torch.zeros(1, dtype=self.master_dtype, device=self.device)
        self._accumulated.add_(loss_sum.detach().reshape(1))
        self._in_backward = self._accumulating = True
        try:
            loss_sum.backward()
        finally:
            self._in_backward = self._accumulating = False

    def discard_grads(self) -> None:
        """Forget gradients of a backward that was no step (the drafter's warm-up)."""
        self._grad_buf.zero_()
        for p, gv in zip(self.params, self._grad_views):
            p.grad = gv if self.single_copy else None

    def allocate_optimizer_state(self) -> None:
        """Create AdamW's per-parameter state now, as its first step would: zero moments, step 0.

        The moments are twice the master weights; the drafter's warm-up takes them before the
        handshake, so that its memory peak is a step's and a GPU too small for the step fails there.
        The next step is bit-identical to one on a fresh optimizer: it starts from exactly this
        state (tests/drafter/test_trainer.py). A no-op once the optimizer has state (a resumed run's, or
        after a step).
        """
        if self.optimizer.state:
            return
        self._grad_buf.zero_()
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        try:
            # Zero gradients at lr 0: the moments stay 0 and every weight keeps its bits (decay is
            # a multiply by 1 - 0 * wd); only the step counters move, and they are reset below.
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
        for state in self.optimizer.state.values():
            state["step"].zero_()

    def step_empty(self) -> StepStats:
        """Participate in a step with no local batch (zero gradient, zero weight)."""
        return self.step(None, 0.0)

    def _launch_remaining(self) -> None:
        # Buckets whose parameters got no gradient (unused, or an empty step) still go out, in order.
        self._pending = [0] * len(self._pending)
        self._launch_ready()

    def _apply(self, global_w: float, global_loss_sum: float) -> StepStats:
        lr = lr_at(self.step_count, self.cfg, self.total_steps)
        if not (global_w > 0) or not math.isfinite(global_w):
            if global_w != 0:
                log.warning("global weight sum is %r; skipping the update", global_w)
            return StepStats(self.step_count, lr, 0.0, global_w, float("nan"), 0.0, 0.0, 0.0, 0.0, skipped=True)
        g = self._grad_flat
        g.mul_(1.0 / global_w)
        norm = float(torch.linalg.vector_norm(g))
        global_loss = global_loss_sum / global_w
        clipped = False
        if not math.isfinite(norm):
            log.warning("non-finite gradient norm (%s) at step %d; skipping the update", norm, self.step_count)
            self.step_count += 1
            return StepStats(self.step_count, lr, norm, global_w, global_loss, 0.0, 0.0, 0.0, 0.0, skipped=True)
        clip = self.cfg.grad_clip
        if clip > 0 and norm > clip:
            g.mul_(clip / (norm + 1e-6))
            clipped = True
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if not self.single_copy:
            self._compute_flat.copy_(self._master_flat)
        self.step_count += 1
        self._sync()
        return StepStats(self.step_count, lr, norm, global_w, global_loss, 0.0, 0.0, 0.0, 0.0, clipped=clipped)

    # ------------------------------------------------------------------ control

    def agree(self, has_batch: bool, stop_requested: bool) -> tuple[bool, bool]:
        """One small all-reduce: (does any rank have a batch, did any rank ask to stop)."""
        if not self.world.is_distributed:
            return bool(has_batch), bool(stop_requested)
        t = torch.tensor([int(bool(has_batch)), int(bool(stop_requested))], dtype=torch.int32, device=self.world.comm_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        a, s = t.tolist()  # one sync
        return bool(a), bool(s)

    @property
    def current_lr(self) -> float:
        return lr_at(self.step_count, self.cfg, self.total_steps)

    # ------------------------------------------------------------------ state

    def trainable_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, master-precision weight) on the training device, one at a time: what a reader
        that needs each tensor only briefly (a digest) walks, so the host never holds all of them."""
        for n, mv in zip(self.names, self._master_views):
            yield n, mv.detach()

    def trainable_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Trainable weights by name (CPU copies; master precision unless ``dtype`` is given)."""
        out = {}
        for n, t in self.trainable_tensors():
            if dtype is not None:
                t = t.to(dtype)
            out[n] = t.to("cpu", copy=True).contiguous()
        return out

    def moment_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's per-parameter tensors (AdamW exp_avg / exp_avg_sq), live on the training
        device, keyed ``"<param index>.<name>"``: what a checkpoint streams to optimizer.safetensors."""
        per_param_state = self.optimizer.state_dict()["state"]
        return {_moment_key(i, k): v for i, per_param in per_param_state.items() for k, v in per_param.items() if _is_moment(v)}

    def checkpoint_shapes(self) -> ModelShapes:
        """The shapes a checkpoint of this trainer holds: each trainable tensor's, each optimizer parameter's
        (the optimizer numbers its parameters group by group: :meth:`moment_tensors`' keys)."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return ModelShapes(
            {n: tuple(mv.shape) for n, mv in zip(self.names, self._master_views)}, {i: tuple(p.shape) for i, p in enumerate(params)}
        )

    def state_dict(self, include_master: bool = True, include_moments: bool = True) -> dict[str, Any]:
        """Step, schedule, the optimizer's state and (``include_master``) the master weights, on the CPU.

        A checkpoint leaves the big tensors out and streams them from the device instead: the
        master weights are its model.safetensors (master precision, :meth:`trainable_tensors`), the
        moments its optimizer.safetensors (:meth:`moment_tensors`; each left here as the string
        ``moment:<key>``); :meth:`load_state_dict` takes them back from there, so a checkpoint
        never holds host copies of the master weights or the moments (three times the weights)."""
        optimizer = self.optimizer.state_dict()
        if not include_moments:
            optimizer = {
                **optimizer,
                "state": {
                    i: {k: _MOMENT_PLACEHOLDER + _moment_key(i, k) if _is_moment(v) else v for k, v in per_param.items()}
                    for i, per_param in optimizer["state"].items()
                },
            }
        state = {
            "format": _STATE_FORMAT,
            "step": self.step_count,
            "total_steps": self.total_steps,
            "names": list(self.names),
            "optimizer": cpu_snapshot(optimizer),
            "schedule": {
                "kind": "warmup-cosine",
                "lr": self.cfg.lr,
                "min_lr_ratio": self.cfg.min_lr_ratio,
                "warmup_steps": self.cfg.resolved_warmup_steps(self.total_steps),
                "total_steps": self.total_steps,
            },
        }
        if include_master:
            state["master"] = self.trainable_state_dict()
        return state

    def load_state_dict(
        self, state: dict[str, Any], master: Mapping[str, torch.Tensor] | None = None, moments: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Restore :meth:`state_dict`'s state; the master weights come from ``state`` or, when it has
        none (a checkpoint's), from ``master`` (the checkpoint's model.safetensors, master precision);
        moments left out of ``state`` from ``moments`` (its optimizer.safetensors)."""
        if state.get("format") not in _READABLE_FORMATS:
            raise ValueError(f"unsupported trainer state format {state.get('format')!r} (readable: {_READABLE_FORMATS})")
        weights = state.get("master")
        if weights is None:
            if master is None:
                raise ValueError("the trainer state holds no master weights: pass the checkpoint's model weights as master=")
            weights = master
            low = sorted({str(t.dtype) for t in master.values() if t.dtype != self.master_dtype})
            if low:
                raise ValueError(f"resuming needs the master weights in {self.master_dtype}; the model weights given are {low}")
        names = list(state["names"])
        if names != self.names:
            missing = sorted(set(self.names) - set(names))
            extra = sorted(set(names) - set(self.names))
            raise ValueError(f"trainer state does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for n, mv in zip(self.names, self._master_views):
                src = weights.get(n)
                if src is None:
                    raise ValueError(f"no master weight for {n} in the {'trainer state' if 'master' in state else 'model weights given'}")
                if src.shape != mv.shape:
                    raise ValueError(f"trainer state: {n} has shape {tuple(src.shape)}, model has {tuple(mv.shape)}")
                mv.copy_(src)
            if not self.single_copy:
                self._compute_flat.copy_(self._master_flat)
        self.optimizer.load_state_dict(_with_moments(state["optimizer"], moments or {}))
        # The config in force now decides the hyper-parameters; the state decides the moments.
        for gi, group in enumerate(self.optimizer.param_groups):
            group["betas"] = tuple(self.cfg.betas)
            group["weight_decay"] = self.cfg.weight_decay if gi == self._decay_group else 0.0
        self.step_count = int(state["step"])
        if self.cfg.max_steps == 0 or self.cfg.max_seconds > 0:
            self.total_steps = int(state["total_steps"])
        self._ensure_linked()


_MOMENT_PLACEHOLDER = "moment:"  # state_dict(include_moments=False) leaves "moment:<key>" where a moment was


def _moment_key(param_index: int, name: str) -> str:
    """A moment's key in optimizer.safetensors (and in its placeholder)."""
    return f"{param_index}.{name}"


def _is_moment(value: Any) -> bool:
    """A per-parameter optimizer tensor (not the 0-dim ``step``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _with_moments(optimizer_state: dict[str, Any], moments: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """``optimizer_state`` with each ``moment:<key>`` placeholder replaced by ``moments[key]``."""
    state = {}
    for i, per_param in optimizer_state["state"].items():
        filled = {}
        for k, v in per_param.items():
            if isinstance(v, str) and v.startswith(_MOMENT_PLACEHOLDER):
                key = v[len(_MOMENT_PLACEHOLDER) :]
                if key not in moments:
                    raise ValueError(f"the trainer state's optimizer moment {key!r} is not among the moments given (optimizer.safetensors)")
                v = moments[key]
            filled[k] = v
        state[i] = filled
    return {**optimizer_state, "state": state}
