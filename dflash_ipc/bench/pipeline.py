"""`dflash-ipc bench pipeline`: the whole pipeline, several variants, one invocation.

Variants (each a fresh run directory and a fresh process group):

* ``cuda-ipc``      the pipeline, hidden states GPU->GPU through CUDA IPC rings;
* ``host-pinned``   the same, staged through pinned shared host memory;
* ``forward-only``  targets alone, each slot released the moment it is packed: the ceiling
                    for the pipeline. Every batch runs three times: once captured and untimed (its
                    first pass: compiles and autotuning of a new shape, ``first_pass_vs_timed``),
                    then through the bare transformers stack (no hooks, no capture; the baseline
                    for the target's own overhead) and captured, both timed: the ceiling is the
                    warm forward's. It runs as many batches as a pipeline variant forwards (its
                    steps and a ring's depth), so later variants meet no new batch shape;
* ``depth-2`` / ``depth-8``  cuda-ipc with 2 and 8 ring slots: host memory must not grow;
* ``padded`` / ``varlen``  forward-only with ``target.varlen`` forced false / true (padded rows
                    vs one packed row): summary ``ratio_varlen_to_padded`` on the same batches
                    (``forward-only`` stands in for ``varlen`` when only it ran);
* ``anchors-N``     cuda-ipc with N anchors per batch, micro-batched in chunks of the config's
                    ``drafter.anchor_chunk`` (or, unset, its ``max_anchors_per_batch``: what one
                    forward held before): drafter wait, step split and peak GPU memory at N;
* ``anchors-auto``  cuda-ipc with ``drafter.anchor_budget = "follow-wait"`` from the config's
                    ``max_anchors_per_batch`` (or one chunk), chunked as ``anchors-N``: the anchor
                    count the drafter settled on (``anchors_final``, its moves in ``anchor_moves``)
                    and the drafter's wait at that count (``drafter_wait_pct_at_final_anchors``).
                    Its first move comes after ``ring_slots + 2 + drafter.anchor_window`` steps and
                    each further chunk takes a window: give it the steps to get there;
* ``warmup``        forward-only over the same batches through the first four decoder layers
                    (both layer types, the target's real widths): compiles fla's Triton kernels
                    at those widths into the on-disk cache, cheaply. Not a result, and not all a
                    cold machine compiles: the whole model's first passes can still cost several
                    timed forwards after it (docs/BENCHMARKS.md). What keeps compilation out of
                    the figures is forward-only's untimed first pass, so name forward-only before
                    the pipeline variants.

Throughput: ``tokens_per_s`` is the slower of the two sides' steady rates, target tokens
forwarded and shipped per second (``target_tokens_per_s``, after each target's first forward,
without the benchmark's own bare-baseline forwards) and tokens the drafters trained on per
second (``drafter_tokens_per_s``, after two optimizer steps). Over a run of N steps the two
differ by at most the ring's depth; in a short run the drafter's rate is inflated by the
backlog the target built while the drafter compiled, which is why the minimum is reported.

Each ``cuda-ipc[+MODS]`` variant is compared with the ``forward-only[+MODS]`` of the same target modifiers
(summary ``ratio_pipeline_to_forward_only[+MODS]``). Steady state of the pipeline (``steady_tokens_per_s``,
summary ``ratio_pipeline_to_forward_only_steady[+MODS]``):
tokens trained per second after the first ``ring_slots + 2`` steps (both sides warm, the start-up
backlog drained), next to the whole-run figure. ``target_slot_wait_s``: how long the targets
waited for a free slot in all (at start-up: until the drafter's first step freed one). The summary
also holds the measured per-GPU rates (``profile``: one target's forward-only rate, one drafter's
busy rate) and the best target:drafter split for this run's GPUs and for 8
(:mod:`dflash_ipc.bench.topology`; ``dflash-ipc plan --topology N --profile`` reads the saved result).

On CPU the same variants run with cpu-shm (``forward-only`` and depths only): the figures
are then only ratios. Steady state excludes each process's first forward / first two
optimizer steps (compilation, allocator warm-up). MFU counts the forward FLOPs actually run
(``target_model.forward_flops``: 2 x matmul parameters of the layers run x tokens + causal
attention of the full-attention layers + the GatedDeltaNet state update) against a peak of
``--peak-tflops`` (790 TFLOP/s: bf16 matrix products measured on an H200 here).
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import psutil

from dflash_ipc.bench.mps import mps_status
from dflash_ipc.bench.topology import Profile, best_split
from dflash_ipc.config import ConfigError, load_config
from dflash_ipc.control.stats import DrafterStats, TargetStats
from dflash_ipc.runtime.forkserver import ForkServer, up_preload, use_forkserver
from dflash_ipc.runtime.launch import child_env
from dflash_ipc.runtime.supervisor import Supervisor

# forward-only first: its untimed first pass of each batch absorbs what a cold machine compiles (fla's
# Triton kernels, torch.compile), into the on-disk caches the later variants then read; "warmup" on a
# 4-layer cut covers only part of it. A variant with other target modifiers (+eager, +fp8) calls other
# kernels: give it its own forward-only before its pipeline variant.
DEFAULT_VARIANTS = ("forward-only", "cuda-ipc", "host-pinned", "depth-2", "depth-8")
KNOWN_VARIANTS = (*DEFAULT_VARIANTS, "warmup", "padded", "varlen")


class TreeSampler:
    """Samples the RSS of this process and all its descendants, and the supervisor's view.

    Each child of this process is the root of one tree (a role process and its helpers, e.g.
    inductor compile workers), named by what the supervisor spawned under that pid
    (``dflash-ipc:ROLE:RANK``), never by its title: a child sampled before it set its title
    reads as "python3", and would be counted once more under that name. A child the supervisor
    does not know (yet) counts in the total only."""

    def __init__(self, sup: Supervisor, period_s: float = 0.5):
        self.sup = sup
        self.period_s = period_s
        self.peak_rss = 0
        self.peak_rss_by_tree: dict[str, int] = {}
        self.peak_procs_by_tree: dict[str, int] = {}
        self.occupancy: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _tree_names(self) -> dict[int, str]:
        """pid -> tree name, from the supervisor's own record of what it spawned."""
        return {ch.popen.pid: f"dflash-ipc:{ch.role}:{ch.rank}" for ch in list(self.sup.children) if ch.popen is not None}

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            try:
                total = me.memory_info().rss
                roots = me.children(recursive=False)
                server = next((c for c in roots if self.sup.launcher is not None and c.pid == self.sup.launcher.pid), None)
                if server is not None:  # run.launcher forkserver: each forked child is a tree of its own, the server adds its RSS
                    roots = [c for c in roots if c is not server] + server.children(recursive=False)
                    total += server.memory_info().rss
            except psutil.Error:
                total, roots = 0, []
            self.peak_rss_by_tree["supervisor"] = max(self.peak_rss_by_tree.get("supervisor", 0), total)
            names = self._tree_names()
            for root in roots:
                tree_rss, n = 0, 0
                try:
                    procs = [root, *root.children(recursive=True)]
                except psutil.Error:
                    continue
                for p in procs:
                    try:
                        tree_rss += p.memory_info().rss
                        n += 1
                    except psutil.Error:
                        pass
                total += tree_rss
                name = names.get(root.pid)
                if n == 0 or name is None:
                    continue
                self.peak_rss_by_tree[name] = max(self.peak_rss_by_tree.get(name, 0), tree_rss)
                self.peak_procs_by_tree[name] = max(self.peak_procs_by_tree.get(name, 0), n)
            self.peak_rss = max(self.peak_rss, total)
            for ch in list(self.sup.children):
                stats = ch.stats
                if isinstance(stats, TargetStats) and self.sup.state == "running":
                    slots = stats.plane.slots
                    n = slots.free + slots.filling + slots.queued + slots.ready
                    self.occupancy.append((n - slots.free) / max(1, n))
            self._stop.wait(self.period_s)


# "+"-joined after a variant's name: the target's precision and elementwise kernels for that variant
# (e.g. forward-only+fp8, cuda-ipc+eager), so one invocation compares them on the same machine state
TARGET_MODIFIERS = {
    "fp8": {"target.quantization": "fp8"},
    "bf16": {"target.quantization": "none"},
    "fused": {"target.fuse_elementwise": True},
    "eager": {"target.fuse_elementwise": False},
}


def variant_overrides(name: str, on_cuda: bool, anchor_chunk: int = 0, max_anchors: int = 0) -> tuple[dict, int]:
    """(config overrides, forward_only batches) for one variant; ``anchor_chunk`` and
    ``max_anchors`` are the config's own drafter settings (the anchors-N variants chunk by them).
    A variant may end in ``+MOD`` modifiers of the target (:data:`TARGET_MODIFIERS`)."""
    base, *mods = name.split("+")
    overrides, fwd = _base_variant_overrides(base, on_cuda, anchor_chunk, max_anchors)
    for mod in mods:
        if mod not in TARGET_MODIFIERS:
            raise ValueError(f"variant {name!r}: unknown modifier {mod!r}; use {', '.join('+' + m for m in TARGET_MODIFIERS)}")
        overrides |= TARGET_MODIFIERS[mod]
    return overrides, fwd


def _base_variant_overrides(name: str, on_cuda: bool, anchor_chunk: int, max_anchors: int) -> tuple[dict, int]:
    base_backend = "cuda-ipc" if on_cuda else "cpu-shm"
    if name == "cuda-ipc":
        return {"transport.backend": base_backend}, 0
    if name == "host-pinned":
        return {"transport.backend": "host-pinned" if on_cuda else "cpu-shm"}, 0
    if name in ("forward-only", "warmup"):
        return {"transport.backend": base_backend}, -1
    if name in ("padded", "varlen"):  # the forward-only ceiling with the forward forced either way
        return {"transport.backend": base_backend, "target.varlen": name == "varlen"}, -1
    if name.startswith("depth-"):
        return {"transport.backend": base_backend, "transport.ring_slots": _variant_number(name)}, 0
    if name.startswith("anchors-"):
        # more anchors per batch, in chunks of what one forward held before (the configured cap)
        chunk = anchor_chunk or max_anchors or 2048
        overrides = {"transport.backend": base_backend, "drafter.anchor_chunk": chunk}
        if name == "anchors-auto":  # from the configured cap (or one chunk), one chunk per window while the drafter waits
            overrides |= {"drafter.anchor_budget": "follow-wait", "drafter.max_anchors_per_batch": max_anchors or chunk}
        else:
            overrides["drafter.max_anchors_per_batch"] = _variant_number(name)
        return overrides, 0
    raise ValueError(f"unknown variant {name!r}; use {', '.join(KNOWN_VARIANTS)}, depth-N, anchors-N or anchors-auto")


def _variant_number(name: str) -> int:
    tail = name.split("-", 1)[1]
    if not tail.isdigit() or int(tail) < 1:
        raise ValueError(f"variant {name!r}: expected a positive integer after '-' (e.g. depth-8, anchors-6144)")
    return int(tail)


def anchor_budget_figures(recs: list[dict]) -> dict:
    """Where a follow-wait budget went: its moves ([step, anchors] from the first step on), the count
    it ended at and the drafter's wait over the steps at that count (after the first of them)."""
    moves = [[r["step"], r["anchors"]] for i, r in enumerate(recs) if i == 0 or r["anchors"] != recs[i - 1]["anchors"]]
    final = recs[-1]["anchors"]
    first = len(recs) - 1
    while first > 0 and recs[first - 1]["anchors"] == final:
        first -= 1
    at_final = recs[first + 1 :]  # the first step at a new count may still drain the backlog of the old one
    wait = sum(r["wait_s"] for r in at_final)
    busy = sum(r["step_s"] for r in at_final)
    return {
        "anchors_final": final,
        "anchor_moves": moves,
        "steps_at_final_anchors": len(at_final),
        "drafter_wait_pct_at_final_anchors": round(100 * wait / (wait + busy), 2) if at_final and wait + busy > 0 else None,
    }


def _steady(recs: list[dict], skip: int = 2) -> list[dict]:
    return recs[skip:] if len(recs) > skip + 1 else recs[-1:]


class VariantsForkServer:
    """One fork server for every variant whose ``run.launcher`` resolves to one (the CPU), started with
    the first such variant and preloaded once, instead of a server per variant; each variant's `up`
    connects to it as a client. The server is this process's child, so :class:`TreeSampler` finds it
    as it finds a variant's own. A server that cannot start: each variant starts its own. Call :meth:`close`."""

    def __init__(self, echo):
        self.echo = echo
        self._server: ForkServer | None = None
        self._unavailable = False

    def client(self, cfg) -> ForkServer | None:
        """A connection to the server for ``cfg``'s `up`, or None (its own launcher, as the config says)."""
        if self._unavailable or not use_forkserver(cfg.run.launcher, cfg.topology.on_cuda):
            return None
        if self._server is None:
            try:
                self._server = ForkServer.start_shared(up_preload(), child_env(), prefix="dflash-bench-fs-")
            except RuntimeError as e:
                self._unavailable = True
                self.echo(f"[bench pipeline] no fork server shared by the variants ({e}): each starts its own")
                return None
            self.echo(
                f"[bench pipeline] fork server for the variants ready after {self._server.ready['seconds']:.1f} s (pid {self._server.pid})"
            )
        return ForkServer.connect(self._server.listen_path, child_env(), up_preload())

    def close(self) -> None:
        if self._server is not None:
            self._server.close()


def variant_config(config_path: str, name: str, steps: int, sets: Sequence[str] = ()):
    """The config of variant ``name``, run for ``steps`` steps with no checkpoint or export; whether it
    is forward-only, and then how many batches each target forwards (0 for a pipeline variant)."""
    probe = load_config(config_path, sets=sets)
    overrides, fwd = variant_overrides(name, probe.topology.on_cuda, probe.drafter.anchor_chunk, probe.drafter.max_anchors_per_batch)
    overrides.update(
        {
            "training.max_steps": steps,
            "training.checkpoint_every": 0,
            "training.checkpoint_on_finish": False,
            "training.export_on_finish": False,
        }
    )
    n_targets = len(probe.topology.targets)
    # the pipeline variants forward up to a ring's depth of batches beyond their steps: the forward-only
    # kinds run those batches too, so no later variant meets a batch shape the bench has not run
    forward_only = max(2, -(-steps * len(probe.topology.drafters) // n_targets)) + probe.transport.ring_slots + 2 if fwd else 0
    if name == "warmup":
        overrides.update(warmup_overrides(probe))
    return load_config(config_path, overrides, sets=sets), fwd, forward_only


def run_variant(
    config_path: str,
    name: str,
    steps: int,
    peak_tflops: float,
    echo,
    fork_server: VariantsForkServer | None = None,
    sets: Sequence[str] = (),
) -> dict:
    cfg, fwd, forward_only = variant_config(config_path, name, steps, sets)
    run_dir = Path(tempfile.mkdtemp(prefix=f"dflash-bench-{name}-"))
    sup = Supervisor(cfg, run_dir, echo=lambda s: echo(f"[{name}] {s}"), forward_only=forward_only, bench_counters=True)
    if fork_server is not None:
        sup.launcher = fork_server.client(cfg)
    t0 = time.perf_counter()
    sup.prepare()
    with TreeSampler(sup) as sampler:
        code = sup.run()
    wall = time.perf_counter() - t0
    out: dict = {
        "variant": name,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "run_dir": str(run_dir),
        "backend": cfg.transport.backend,
        "ring_slots": cfg.transport.ring_slots,
        "peak_host_rss_bytes": sampler.peak_rss,
        "peak_host_rss_by_process_tree": sampler.peak_rss_by_tree,
        "processes_by_tree": sampler.peak_procs_by_tree,
        "slot_occupancy_mean": round(sum(sampler.occupancy) / len(sampler.occupancy), 3) if sampler.occupancy else None,
    }
    targets = [c for c in sup.children if c.role == "target"]
    works, gpu_peaks = target_figures(out, targets, run_dir, peak_tflops)
    if fwd:
        forward_only_figures(out, works)
    else:
        drafters = [c for c in sup.children if c.role == "drafter"]
        pipeline_figures(out, cfg, run_dir, works, len(drafters))
        for c in drafters:
            gpu = c.stats.work.gpu if isinstance(c.stats, DrafterStats) else None
            gpu_peaks[c.device] = max(gpu_peaks.get(c.device, 0), gpu.peak_bytes if gpu else 0)
    out["peak_gpu_mem_bytes"] = gpu_peaks
    return out


TARGET_WORK_FIGURES = (
    "forwards",
    "forward_ms",
    "pack_ms",
    "pack_overlap_pct",
    "pack_exposed_ms",
    "pack_submit_ms",
    "slot_wait_ms",
    "busy_pct",
    "steady_tokens_per_s",
    "steady_tflops",
    "steady_forward_tflops",
    "layers_run",
)


def target_figures(out: dict, targets: list, run_dir: Path, peak_tflops: float) -> tuple[list, dict[str, int]]:
    """Every target's final figures (forward-only: its Done) or its last heartbeat's into ``out``, and
    their sums; returns the targets' work figures and the GPU memory peak per device so far."""
    tstats: list[TargetStats] = [c.stats for c in targets if isinstance(c.stats, TargetStats)]
    if len(tstats) != len(targets):
        raise RuntimeError(f"{len(targets) - len(tstats)} target(s) reported no figures (see their logs in {run_dir}/logs)")
    works = [ts.work for ts in tstats]
    out["targets"] = [
        {
            **{k: getattr(w, k) for k in TARGET_WORK_FIGURES},
            "gpu_mem_peak_bytes": w.gpu.peak_bytes if w.gpu else None,
            "routed_per_drafter": ts.plane.routed_per_drafter,
        }
        for ts, w in zip(tstats, works)
    ]
    gpu_peaks: dict[str, int] = {}
    for c, w in zip(targets, works):
        gpu_peaks[c.device] = max(gpu_peaks.get(c.device, 0), w.gpu.peak_bytes if w.gpu else 0)
    out["target_tflops_steady"] = round(sum(w.steady_tflops for w in works), 2)
    out["target_mfu"] = round(sum(w.steady_forward_tflops for w in works) / len(works) / peak_tflops, 4)
    out["target_tokens_per_s"] = round(sum(w.steady_tokens_per_s for w in works), 1)
    return works, gpu_peaks


def forward_only_figures(out: dict, works: list) -> None:
    """A forward-only variant: the targets' throughput, the capture's cost over a bare forward, and
    each batch's untimed first pass against its timed forward (what a new batch shape costs)."""
    out["tokens_per_s"] = out["target_tokens_per_s"]
    capt = sum(w.steady_forward_s for w in works)
    bare = sum(w.bare_forward_s for w in works)
    out["bare_forward_s"] = round(bare, 3)
    out["capture_forward_s"] = round(capt, 3)
    out["capture_vs_bare"] = round(bare / capt, 4) if capt > 0 else None
    first = sum(w.first_pass_forward_s for w in works)
    timed = sum(w.forward_ms * w.forwards / 1e3 for w in works)
    out["first_pass_forward_s"] = round(first, 3)
    out["first_pass_vs_timed"] = round(first / timed, 3) if timed > 0 else None


def pipeline_figures(out: dict, cfg, run_dir: Path, works: list, n_drafters: int) -> None:
    """A pipeline variant, from the run's metrics.jsonl: the drafters' throughput (after the first
    steps, and with both sides warm), which side bounds it, the step's split and the loss."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    st = _steady(recs)
    span = st[-1]["elapsed_s"] - (recs[recs.index(st[0]) - 1]["elapsed_s"] if recs.index(st[0]) > 0 else 0.0)
    toks = sum(r["tokens"] for r in st)
    out["steps"] = len(recs)
    out["drafter_tokens_per_s"] = round(toks / max(1e-9, span), 1)
    out["whole_run_tokens_per_s"] = round(sum(r["tokens"] for r in recs) / max(1e-9, recs[-1]["elapsed_s"]), 1)
    # both sides warm: past the backlog a ring's depth of slots can hold, and past the first steps
    skip = cfg.transport.ring_slots + 2
    warm = recs[skip:]
    if len(warm) >= 2:
        span_warm = warm[-1]["elapsed_s"] - warm[0]["elapsed_s"]
        out["steady_tokens_per_s"] = round(sum(r["tokens"] for r in warm[1:]) / max(1e-9, span_warm), 1)
        out["steady_after_steps"] = skip + 1
    out["drafter_busy_tokens_per_s_per_gpu"] = round(toks / max(1e-9, sum(r["step_s"] for r in st)) / n_drafters, 1)
    out["target_slot_wait_s"] = round(sum(w.slot_wait_ms for w in works) / 1000, 2)
    out["tokens_per_s"] = min(out["drafter_tokens_per_s"], out["target_tokens_per_s"])
    out["bound_by"] = "target" if out["target_tokens_per_s"] <= out["drafter_tokens_per_s"] else "drafter"
    keys = ("wait_s", "copy_s", "forward_s", "backward_s", "allreduce_s", "optimizer_s", "step_s")
    out["drafter_step_split_s"] = {k: round(sum(r[k] for r in st) / len(st), 4) for k in keys}
    out["drafter_wait_pct"] = round(100 * sum(r["wait_s"] for r in st) / max(1e-9, sum(r["wait_s"] + r["step_s"] for r in st)), 2)
    out["loss_first_last"] = [recs[0]["loss"], recs[-1]["loss"]]
    if cfg.drafter.anchor_budget == "follow-wait":
        out.update(anchor_budget_figures(recs))


def warmup_overrides(probe) -> dict:
    """The first four decoder layers of the configured target (same widths, both layer types)."""
    spec = dict(probe.target.spec)
    if not spec:
        raise ValueError(
            "the warmup variant needs a target built from target.spec (a checkpoint's own layers "
            "cannot be cut); leave 'warmup' out of --variants"
        )
    n = min(4, int(spec.get("num_hidden_layers", 4)))
    spec["num_hidden_layers"] = n
    if isinstance(spec.get("layer_types"), list):
        spec["layer_types"] = spec["layer_types"][:n]
    return {"target.spec": spec, "target.layer_ids": [1, n - 1] if n > 2 else [n - 1]}


def run_pipeline_bench(
    config_path: str,
    steps: int,
    variants: list[str],
    peak_tflops: float = 790.0,
    echo=print,
    out_path: str | None = None,
    sets: Sequence[str] = (),
) -> dict:
    """``out_path``: each variant's result is appended there as one JSON line the moment it is
    known, so a run cut short by a time limit keeps the variants it finished. ``sets``: the
    ``--set`` items over the config file, under every variant's own overrides."""
    results: dict = {}
    fork_server = VariantsForkServer(echo)
    try:
        for name in variants:
            _run_one_variant(config_path, name, steps, peak_tflops, echo, fork_server, results, out_path, sets)
    finally:
        fork_server.close()
    return summarize_variants(config_path, steps, peak_tflops, results, sets)


def _run_one_variant(
    config_path: str,
    name: str,
    steps: int,
    peak_tflops: float,
    echo,
    fork_server: VariantsForkServer,
    results: dict,
    out_path: str | None,
    sets: Sequence[str] = (),
) -> None:
    """One variant into ``results`` (and a line of ``out_path``): a failure is its result, never the others'."""
    echo(f"[bench pipeline] variant {name}: {steps} steps")
    try:
        results[name] = run_variant(config_path, name, steps, peak_tflops, echo, fork_server, sets)
        if results[name]["exit_code"] != 0:  # its figures stay in the result, out of every ratio
            results[name]["error"] = (
                f"dflash-ipc up exited with code {results[name]['exit_code']} (why: the [{name}] [up] lines "
                f"above; logs: {results[name]['run_dir']}/logs)"
            )
            echo(f"[bench pipeline] {name} FAILED: {results[name]['error']}")
    except Exception as e:  # one failed variant must not lose the others' figures
        if isinstance(e, ConfigError) and not results:
            # The first variant's probe checks the model and devices (this process never imports
            # torch): a refusal there is the config's, for every variant; said before any ran.
            raise
        results[name] = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        echo(f"[bench pipeline] {name} FAILED: {e}")
    if out_path:
        with open(out_path, "a") as f:
            f.write(json.dumps(results[name]) + "\n")
    if "error" not in results[name]:
        echo(f"[bench pipeline] {name}: {json.dumps({k: v for k, v in results[name].items() if k not in ('targets',)})}")


def summarize_variants(config_path: str, steps: int, peak_tflops: float, results: dict, sets: Sequence[str] = ()) -> dict:
    """The summary over the variants' results: ratios, topology advice. A failed variant (an
    ``error``: an exception, or an ``up`` that exited non-zero) is listed but enters no figure."""
    summary: dict = {"config": config_path, "steps": steps, "peak_tflops": peak_tflops, "mps": mps_status(), "variants": results}
    failed = sorted(k for k, v in results.items() if "error" in v)
    if failed:
        summary["failed_variants"] = failed
    results_ok = {k: v for k, v in results.items() if "error" not in v and k.split("+")[0] != "warmup"}
    ipc = results_ok.get("cuda-ipc")
    results = results_ok
    # each pipeline against the ceiling with the same target modifiers (cuda-ipc+fp8 / forward-only+fp8, ...)
    for pipe_name in sorted(n for n in results if n.split("+")[0] == "cuda-ipc"):
        suffix = pipe_name.removeprefix("cuda-ipc")
        pipe, ceiling = results[pipe_name], results.get("forward-only" + suffix)
        if ceiling:
            rate = max(1e-9, ceiling["tokens_per_s"])
            summary[f"ratio_pipeline_to_forward_only{suffix}"] = round(pipe["tokens_per_s"] / rate, 4)
            if pipe.get("steady_tokens_per_s"):
                summary[f"ratio_pipeline_to_forward_only_steady{suffix}"] = round(pipe["steady_tokens_per_s"] / rate, 4)
    if ipc and results.get("host-pinned"):
        summary["ratio_cuda_ipc_to_host_pinned"] = round(ipc["tokens_per_s"] / max(1e-9, results["host-pinned"]["tokens_per_s"]), 4)
    if ipc:
        summary.update(_topology_advice(config_path, results, sets))
    packed = results.get("varlen") or results.get("forward-only")
    if packed and results.get("padded"):
        fo, pad = packed, results["padded"]
        summary["ratio_varlen_to_padded"] = round(fo["target_tokens_per_s"] / max(1e-9, pad["target_tokens_per_s"]), 4)
        summary["target_mfu_varlen_padded"] = [fo["target_mfu"], pad["target_mfu"]]
    for name, r in results.items():
        if name.startswith("anchors-") and ipc:
            summary[f"ratio_{name}_to_cuda_ipc"] = round(r["tokens_per_s"] / max(1e-9, ipc["tokens_per_s"]), 4)
    if results.get("depth-2") and results.get("depth-8"):
        summary["host_rss_depth8_over_depth2"] = round(
            results["depth-8"]["peak_host_rss_bytes"] / max(1, results["depth-2"]["peak_host_rss_bytes"]), 4
        )
    return summary


def _topology_advice(config_path: str, results: dict, sets: Sequence[str] = ()) -> dict:
    """The measured per-GPU rates and the best target:drafter split for this run's GPU count and for 8."""
    cfg = load_config(config_path, sets=sets)
    ipc = results["cuda-ipc"]
    ceiling = results.get("forward-only", ipc)
    profile = Profile(
        ceiling["target_tokens_per_s"] / len(cfg.topology.targets),
        ipc["drafter_busy_tokens_per_s_per_gpu"],
        source=f"bench pipeline {config_path}",
    )
    n = len(cfg.topology.targets) + len(cfg.topology.drafters)
    return {"profile": asdict(profile), "topology": {str(g): asdict(best_split(profile, g)) for g in sorted({n, 8}) if g >= 2}}
