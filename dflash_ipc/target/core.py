"""The target's pure core: its data shard, the frozen model, the packer, and the batch schedule.

The process shell (``procs/target.py``) owns sockets and signals; this core owns everything
else and never blocks on the network. One step of the target::

    next_batch() ─▶ forward(batch) ─▶ [captured planes]  ─ slot free? ─▶ submit_pack(slot)
       (skips ledgered ids)           (critical path)                     (side stream/thread)
                                                              finished_packs() ─▶ commit + route

The forward of batch i+1 starts while batch i is packed: ``submit_pack`` returns at once,
and the captured tensors stay referenced by the pack handle until the pack has completed.
At most one forward runs ahead of the free slots, so slot waits are bounded and measured.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from dflash_ipc.config import DFlashConfig
from dflash_ipc.control.router import deal_by_plan
from dflash_ipc.control.stats import GpuMemory, TargetWork
from dflash_ipc.data.corpus import Corpus, load_corpus
from dflash_ipc.data.plan import PlannedBatch, plan_epoch
from dflash_ipc.data.tokenizer import config_tokenizer
from dflash_ipc.rundir.ledger import BatchLedger
from dflash_ipc.rundir.node_spec import NodeSpec, read_node_spec
from dflash_ipc.target.fast_path import fast_path_report
from dflash_ipc.target.model import TargetModel, build_target
from dflash_ipc.target.packing import AsyncPacker, BatchMeta, OverlapMeter, PackHandle, flat_batch_meta
from dflash_ipc.transport.slots import SlotLayout

log = logging.getLogger(__name__)


def slot_layout_for(cfg: DFlashConfig, model: TargetModel) -> SlotLayout:
    tokens = cfg.data.token_budget + cfg.transport.slot_tokens
    return SlotLayout(
        num_planes=model.num_planes,
        hidden_size=model.hidden_size,
        max_tokens=tokens,
        max_seqs=cfg.data.max_batch_size,
        plane_dtype=cfg.target.dtype,
    )


class ForwardObserver(Protocol):
    """What a benchmark attaches to a :class:`TargetCore` (``core.observers``) to count its forwards
    (``bench/target_counters.py``); the target's own work and figures never depend on one."""

    def before_forward(self, timed_capture: Callable[[], float], timed_uncaptured: Callable[[], float]) -> None:
        """Called with the batch about to be forwarded: each callable forwards it once more, synchronized and
        timed (seconds back), captured or through the decoder stack alone (no hooks, no capture), and counts as
        a forward for the overlap meter."""

    def after_forward(self, n_tokens: int, flops: float, seconds: float) -> None:
        """Called once the batch's captured forward completed: its real tokens, FLOPs and seconds."""

    def figures(self, work: TargetWork) -> TargetWork:
        """``work`` with the observer's own figures filled in."""


@dataclass
class Captured:
    batch: PlannedBatch
    planes: list[torch.Tensor]
    meta: BatchMeta
    forward_s: float
    wire_id: list[int]  # SlotReady.batch_id: the plan's id, or [pass, rank, index] for a held-out batch
    holdout_pass_batches: int = 0  # > 0: a held-out batch (SlotReady.holdout_pass_batches)


@dataclass
class _Packing:
    handle: PackHandle
    slot: int
    batch: PlannedBatch
    wire_id: list[int]
    holdout_pass_batches: int


class HoldoutSchedule:
    """When one target forwards held-out batches (``training.holdout_every``) and which.

    Every target plans the same held-out batches (epoch 0 of ``data.holdout_paths``, unsharded); a
    pass is their first ``training.holdout_batches`` (0: all), the same batches in every pass so
    passes compare; target ``r`` forwards those whose index ``i % targets == r``. A pass starts
    before the first training batch (the untrained floor), again each time this target forwarded
    ``interval`` more training batches, and once more when its training data ran out. ``interval``
    = holdout_every x drafters / targets (all nodes): about holdout_every optimizer steps. Only
    node 0's targets run passes; their held-out batches go to drafter 0 (global rank 0).
    """

    def __init__(self, corpus: Corpus, batches: list[tuple[int, PlannedBatch]], pass_batches: int, interval: int):
        self.corpus = corpus
        self.batches = batches
        self.pass_batches = pass_batches
        self.interval = interval
        self.queue: deque[tuple[list[int], PlannedBatch]] = deque()
        self.passes = 0
        self.next_at = 0
        self.last_at = -1

    def start_pass_if_due(self, trained: int, training_left: bool, rank: int) -> None:
        if self.queue or not (trained >= self.next_at or (not training_left and trained > self.last_at)):
            return
        self.queue.extend(([self.passes, rank, i], b) for i, b in self.batches)
        self.passes += 1
        self.last_at, self.next_at = trained, trained + self.interval

    @classmethod
    def build(cls, cfg: DFlashConfig, node: NodeSpec, rank: int, tokenizer, data_dir: Path) -> HoldoutSchedule | None:
        t = cfg.training
        if t.holdout_every == 0 or node.node_rank != 0:
            return None
        corpus = load_corpus(dataclasses.replace(cfg.data, paths=list(cfg.data.holdout_paths), weights=[]), tokenizer, data_dir)
        planned = plan_epoch(corpus.lengths, cfg.data, cfg.run.seed, 0, 1, 0)
        chosen = planned[: t.holdout_batches] if t.holdout_batches else planned
        n_targets = len(cfg.topology.targets)
        mine = [(i, b) for i, b in enumerate(chosen) if i % n_targets == rank]
        if not mine:
            return None
        interval = max(1, round(t.holdout_every * len(cfg.topology.drafters) / n_targets))
        log.info("held-out: %d of %d held-out batches per pass here, a pass every %d training batches", len(mine), len(chosen), interval)
        return cls(corpus, mine, len(chosen), interval)


class TargetCore:
    def __init__(self, cfg: DFlashConfig, rank: int, run_dir: Path, device: torch.device):
        self.cfg = cfg
        self.rank = rank
        self.device = device
        # One data shard per target of every node (runtime/nodes.py): no batch is planned on two nodes.
        node = read_node_spec(run_dir)
        self.node = node
        self.num_shards = node.nnodes * len(cfg.topology.targets)
        self.shard = node.global_rank(rank, len(cfg.topology.targets))
        self.tokenizer = config_tokenizer(cfg)  # the [chat_template] kwargs render the corpus (the loss mask)
        data_dir = Path(cfg.data.cache_dir) if cfg.data.cache_dir else run_dir / "data"
        self.corpus = load_corpus(cfg.data, self.tokenizer, data_dir)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.holdout = HoldoutSchedule.build(cfg, node, rank, self.tokenizer, data_dir)
        self.trained_forwards = 0  # training batches forwarded (held-out ones not counted)
        self.model = build_target(cfg.target, device, vocab_size=len(self.tokenizer))
        self.fast_path = fast_path_report(self.model.stack)
        self.layout = slot_layout_for(cfg, self.model)
        self.packer: AsyncPacker | None = None
        self.overlap: OverlapMeter | None = None
        self.pack_submit_s = 0.0
        self._packing: deque[_Packing] = deque()
        self._schedule: deque[PlannedBatch] = deque()
        self.ledger = BatchLedger()
        self.deal: dict[tuple[int, int, int], tuple[int, int]] = {}  # run.deterministic: batch id -> (drafter, ordinal)
        self.skipped_ledgered = 0
        self.planned = 0
        # stats
        self.t_start = time.perf_counter()
        self.forward_s = 0.0
        self.forwards = 0
        self.tokens_forwarded = 0
        self.slot_wait_s = 0.0
        self.flops = 0.0
        self.observers: list[ForwardObserver] = []  # a benchmark's counters

    def start(self, ledger: BatchLedger) -> None:
        """Plan every epoch of this shard, leaving out batches already consumed."""
        self.ledger = ledger
        for epoch in range(self.cfg.data.num_epochs):
            for b in plan_epoch(
                self.corpus.lengths, self.cfg.data, self.cfg.run.seed, epoch, self.num_shards, self.shard, self.corpus.sources
            ):
                self.planned += 1
                if tuple(b.id.to_wire()) in ledger:
                    self.skipped_ledgered += 1
                    continue
                self._schedule.append(b)
        if self.cfg.run.deterministic:
            self.deal = self._deal(ledger)
        self.packer = AsyncPacker(self.layout, self.device, async_pack=self.cfg.target.async_pack)
        self.overlap = OverlapMeter(self.device)
        self.t_start = time.perf_counter()

    def _deal(self, ledger: BatchLedger) -> dict[tuple[int, int, int], tuple[int, int]]:
        """run.deterministic: which drafter of this node trains each of this shard's batches, and when."""
        cfg, per_node = self.cfg, len(self.cfg.topology.targets)
        sizes = [
            len(plan_epoch(self.corpus.lengths, cfg.data, cfg.run.seed, e, 1, 0, self.corpus.sources)) for e in range(cfg.data.num_epochs)
        ]
        node_shards = range(self.node.global_rank(0, per_node), self.node.global_rank(per_node - 1, per_node) + 1)
        return deal_by_plan(sizes, self.num_shards, node_shards, self.shard, ledger.__contains__, len(cfg.topology.drafters))

    def route_of(self, wire_id: list[int], holdout_pass_batches: int) -> tuple[int, int] | None:
        """run.deterministic: the (drafter, ordinal) of a training batch; None otherwise."""
        if not self.deal or holdout_pass_batches:
            return None
        return self.deal[tuple(wire_id)]

    def scheduled_ids(self) -> list[list[int]]:
        """The plan ids of the training batches still to forward, in order."""
        return [b.id.to_wire() for b in self._schedule]

    @property
    def batches_left(self) -> int:
        return len(self._schedule) + (len(self.holdout.queue) if self.holdout else 0)

    def _next_batch(self) -> tuple[PlannedBatch, Corpus, list[int], int] | None:
        h = self.holdout
        if h is not None:
            h.start_pass_if_due(self.trained_forwards, bool(self._schedule), self.rank)
            if h.queue:
                wire_id, batch = h.queue.popleft()
                return batch, h.corpus, wire_id, h.pass_batches
        if not self._schedule:
            return None
        self.trained_forwards += 1
        batch = self._schedule.popleft()
        return batch, self.corpus, batch.id.to_wire(), 0

    def forward_next(self) -> Captured | None:
        """Forward the next batch with capture hooks (the critical path), timed to completion; each observer
        sees the batch before (and may forward it again) and the forward's figures after."""
        nxt = self._next_batch()
        if nxt is None:
            return None
        batch, corpus, wire_id, holdout_pass_batches = nxt
        ids, mask, lens = corpus.collate(batch.sample_indices, self.pad_id)
        varlen = self.model.varlen
        on_gpu = self.device.type == "cuda"
        meta = None
        if varlen:  # the real tokens back to back: the forward's input and the slot's order
            meta = flat_batch_meta(ids, mask, lens, pin=False)
            ids = meta.token_ids
        for observer in self.observers:
            observer.before_forward(lambda: self._timed(lambda: self._capture(ids, meta)), lambda: self._uncaptured_forward(ids, lens))
        self._sync()
        t0 = time.perf_counter()
        start_mark = self.overlap.mark()
        planes = self._capture(ids, meta)
        end_mark = self.overlap.mark()
        if on_gpu:  # host work while the GPU still runs the forward: submit then only enqueues
            if meta is None:
                meta = flat_batch_meta(ids, mask, lens, pin=True)
            else:
                meta = BatchMeta(seq_lens=meta.seq_lens, token_ids=meta.token_ids.pin_memory(), loss_mask=meta.loss_mask.pin_memory())
        self._sync()
        t1 = time.perf_counter()
        if meta is None:
            meta = flat_batch_meta(ids, mask, lens, pin=False)
        self.overlap.add_forward(start_mark, end_mark)
        dt = t1 - t0
        flops = self.model.forward_flops(lens.tolist())
        self.forward_s += dt
        self.forwards += 1
        self.tokens_forwarded += batch.n_tokens
        self.flops += flops
        for observer in self.observers:
            observer.after_forward(batch.n_tokens, flops, dt)
        return Captured(batch, planes, meta, dt, wire_id, holdout_pass_batches)

    def _capture(self, ids: torch.Tensor, meta: BatchMeta | None) -> list[torch.Tensor]:
        if meta is not None:  # varlen: the real tokens back to back
            return self.model.capture_packed(ids, meta.lens())
        return self.model.capture(ids.to(self.device, non_blocking=True))

    def _timed(self, forward) -> float:
        """An observer's forward, synchronized and timed; the overlap meter counts it as a forward."""
        self._sync()
        t0 = time.perf_counter()
        start_mark = self.overlap.mark()
        forward()
        end_mark = self.overlap.mark()
        self._sync()
        self.overlap.add_forward(start_mark, end_mark)
        return time.perf_counter() - t0

    def _sync(self) -> None:
        # The forward's wall time must be its GPU time: wait for the compute stream.
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _uncaptured_forward(self, ids: torch.Tensor, lens: torch.Tensor) -> float:
        """The batch through the stack alone, as the captured forward runs it (packed or padded):
        no hooks, no capture."""
        return self._timed(lambda: self.model.forward_bare(ids, lens.tolist() if self.model.varlen else None))

    def submit_pack(self, captured: Captured, slot: int, slot_tensor: torch.Tensor) -> None:
        assert self.packer is not None
        t0 = time.perf_counter()
        handle = self.packer.submit(captured.planes, captured.meta, slot, slot_tensor)
        self.pack_submit_s += time.perf_counter() - t0
        self._packing.append(_Packing(handle, slot, captured.batch, captured.wire_id, captured.holdout_pass_batches))

    def finished_packs(self) -> list[_Packing]:
        out = []
        while self._packing and self._packing[0].handle.done():
            p = self._packing.popleft()
            p.handle.wait()  # re-raises a pack error
            self.overlap.add_pack(p.handle)
            out.append(p)
        return out

    @property
    def packs_in_flight(self) -> int:
        return len(self._packing)

    def stats(self, final: bool = False) -> TargetWork:
        """Per-process figures; ``final`` also settles packs no later forward has followed."""
        wall = max(1e-9, time.perf_counter() - self.t_start)
        pk = self.packer.stats() if self.packer else {"packs": 0, "pending": 0, "pack_s_mean": 0.0}
        overlap = (
            self.overlap.stats(final=final) if self.overlap else {"packs_measured": 0, "pack_overlap_pct": 0.0, "pack_exposed_ms": 0.0}
        )
        work = TargetWork(
            forwards=self.forwards,
            forward_ms=1e3 * self.forward_s / max(1, self.forwards),
            pack_ms=1e3 * pk["pack_s_mean"],
            pack_submit_ms=1e3 * self.pack_submit_s / max(1, pk["packs"] + pk["pending"]),
            packs_measured=overlap["packs_measured"],
            pack_overlap_pct=overlap["pack_overlap_pct"],
            pack_exposed_ms=overlap["pack_exposed_ms"],
            slot_wait_ms=1e3 * self.slot_wait_s,
            busy_pct=100.0 * min(1.0, self.forward_s / wall),
            tokens_per_s=self.tokens_forwarded / wall,
            tokens=self.tokens_forwarded,
            batches_left=self.batches_left,
            planned=self.planned,
            skipped_ledgered=self.skipped_ledgered,
            tflops=self.flops / wall / 1e12,
            layers_run=self.model.layers_run,
            gpu=GpuMemory.of(self.device),
        )
        for observer in self.observers:
            work = observer.figures(work)
        return work

    def describe_kernels(self) -> str:
        """The forward's kernels, for the start-up log."""
        fp = self.fast_path
        if not fp.get("gated_delta_net_layers"):  # e.g. a Llama target: no linear-attention layers
            return f"{type(self.model.stack).__name__}, attention {self.model.attn_implementation}"
        fla = "active" if fp.get("fla") else "NOT active (slow torch fallback)"
        conv = "active" if fp.get("causal_conv1d") else "not active (torch conv fallback)"
        return f"GatedDeltaNet kernels: flash-linear-attention {fla}, causal-conv1d {conv} ({fp.get('implementations')})"

    def describe_forward(self) -> str:
        fused = self.model.fused_elementwise
        elementwise = (
            f"; elementwise fused by torch.compile: {fused['norms']} norms, {fused['gated_norms']} gated norms, {fused['mlps']} SwiGLU MLPs"
            if fused
            else "; elementwise eager"
        )
        return f"{'packed (varlen)' if self.model.varlen else 'padded'} ({self.model.varlen_reason}){elementwise}"

    def describe_pack_overlap(self) -> str:
        s = self.stats(final=True)
        return (
            f"forward {s.forward_ms:.1f} ms/batch; pack {s.pack_ms:.2f} ms/batch off the critical path, {s.pack_overlap_pct:.1f}% of it "
            f"while a forward ran (exposed {s.pack_exposed_ms:.2f} ms/batch over {s.packs_measured} packs); "
            f"handing a batch to the packer took {s.pack_submit_ms:.2f} ms"
        )

    def close(self) -> None:
        if self.packer is not None:
            self.packer.close()
            self.packer = None
