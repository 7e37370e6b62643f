"""Typed run configuration: TOML files loaded into small validated dataclasses.

Every component owns one small ``Config`` dataclass and validates it in ``__post_init__``
with ``ValueError``s that say what to change. :func:`load_config` walks the TOML document
against those dataclasses and refuses, *before any process starts*:

* unknown keys (with the closest valid name),
* values of the wrong type,
* impossible values and combinations (numbers are finite: ``inf``/``nan`` never pass),

always naming the file and the dotted key, e.g.::

    configs/x.toml: transport.ring_slots: must be >= 2 (got 1); raise it to at least 2

What a config says about the world (the model directory, the CUDA devices, the run directory)
is checked next, still before any process starts, by :mod:`dflash_ipc.runtime.preflight`.

Values that are valid but ignored by the component that would read them (for example
``target.spec`` next to ``target.model_path``) produce warnings, returned by
:meth:`DFlashConfig.ignored_value_warnings` and logged by the CLI.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dflash_ipc.chat_template import ChatTemplateConfig
from dflash_ipc.config_checks import tensorboard_installed, valid_device, valid_host, zmq_has_curve
from dflash_ipc.config_drafter import DrafterConfig
from dflash_ipc.config_fields import ConfigError, FieldError, build_section, did_you_mean, require
from dflash_ipc.config_quant import Quantization, check_target_quantization
from dflash_ipc.config_synth import SynthConfig, check_mix_weights
from dflash_ipc.fsutil import write_text_atomic

# --------------------------------------------------------------------------- components


# Longest accepted timeout: a week. Longer ones are typos that would hang a run, and ZeroMQ
# poll timeouts in milliseconds must fit an int.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass
class RunConfig:
    # One path component: the default run dir is runs/<name> and must stay inside runs/.
    name: str = "dflash"
    run_dir: str = ""  # empty: runs/<name> relative to the working directory
    # Fixes the drafter's initialisation, the data plan (order, mix draws) and anchor sampling on every rank.
    seed: int = 0
    # false: each batch goes to the least-busy drafter, so which rank trains which batch (with that rank's anchor
    # sampling) follows the timing, and two runs of one seed differ from step 1. true: batches are dealt round-robin in
    # plan order (control/router.py, deal_by_plan), each drafter trains its own in that order, credits still bound every
    # queue, and torch uses its deterministic algorithms where it has them (warning where not; on CUDA with
    # CUBLAS_WORKSPACE_CONFIG=:4096:8): one seed repeats its per-step losses bit for bit. Cost: a drafter waits for its
    # own next batch instead of taking any that is ready, and a target sends first-in first-out. Measured on CPU
    # (configs/tiny-cpu.toml, 40 steps, deterministic and not side by side, 3 pairs on 2 busy cores): 0.98x the
    # tokens/s (0.90-1.06 per pair, within the machine's noise). Still not repeated: a run stopped and resumed
    # (deterministic from its checkpoint, but not the uninterrupted run's steps), training.max_seconds (the clock picks
    # the last step), when held-out tau is measured, another machine, thread count, device or library build.
    deterministic: bool = False
    handshake_timeout_s: float = 120.0
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 60.0
    stall_timeout_s: float = 0.0  # beating, but its loop still this long: hung. 0: 10x heartbeat_timeout_s
    teardown_grace_s: float = 15.0
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # "auto": on GPU hosts give each process its own share of the CPU cores, so one process's
    # compile workers or data loading cannot starve another's kernel launches. "off": inherit.
    cpu_affinity: Literal["auto", "off"] = "auto"
    # TensorBoard events beside metrics.jsonl (drafter 0): loss, acc, tau, tau_holdout, ...; pip install "dflash-ipc[tensorboard]".
    tensorboard: bool = False
    # Serve the live status snapshot as Prometheus metrics on http://127.0.0.1:PORT/metrics
    # (loopback only: scrape through an SSH tunnel or a local Prometheus). 0: no endpoint.
    metrics_port: int = 0
    # TorchInductor compile workers per process. Above 1 every process starts a pool of workers, each a Python importing
    # torch and triton; 1 compiles in the process: slower only for the first compile, which the drafter's warm-up hides.
    compile_threads: int = 1
    # Control plane transport: "ipc" (Unix sockets in the 0700 run dir) or "tcp" (ZeroMQ over TCP
    # on control_host, every peer authenticated with the run's CURVE keys; only with
    # transport.backend = "nccl", the layout where a target and its drafters may be on different
    # hosts). control_host is also where a target's nccl rendezvous listens.
    control: Literal["ipc", "tcp"] = "ipc"
    control_host: str = "127.0.0.1"
    # How `up` starts the probe and its processes (runtime/forkserver.py): "exec" a new Python each; "forkserver" forked from
    # one server that imported torch once; "auto": forkserver when every device is the CPU, exec with any CUDA device.
    launcher: Literal["auto", "exec", "forkserver"] = "auto"

    def __post_init__(self) -> None:
        launchers = ("auto", "exec", "forkserver")
        require(self.launcher in launchers, "launcher", f"must be one of {', '.join(map(repr, launchers))} (got {self.launcher!r})")
        require(
            bool(self.name) and self.name not in (".", "..") and not any(c in self.name for c in "/\\\0"),
            "name",
            f"must be a plain name without '/', not '.' or '..' (got {self.name!r}): the run directory is runs/<name>",
        )
        require(
            not self.tensorboard or tensorboard_installed(),
            "tensorboard",
            'is true but the tensorboard package is not installed; pip install "dflash-ipc[tensorboard]" or set it to false',
        )
        require(1 <= self.compile_threads <= 64, "compile_threads", f"must be between 1 and 64 (got {self.compile_threads})")
        for key in ("handshake_timeout_s", "heartbeat_interval_s", "heartbeat_timeout_s"):
            value = getattr(self, key)
            require(0 < value <= MAX_TIMEOUT_S, key, f"must be > 0 and <= {MAX_TIMEOUT_S:g} seconds (7 days; got {value:g})")
        require(
            self.heartbeat_timeout_s >= 3 * self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            f"must be at least 3x run.heartbeat_interval_s ({3 * self.heartbeat_interval_s:g} s); raise it",
        )
        ok = self.stall_timeout_s == 0 or self.heartbeat_timeout_s <= self.stall_timeout_s <= MAX_TIMEOUT_S
        require(ok, "stall_timeout_s", "must be 0 (10x heartbeat_timeout_s) or between heartbeat_timeout_s and 7 days")
        require(
            0 <= self.teardown_grace_s <= MAX_TIMEOUT_S,
            "teardown_grace_s",
            f"must be >= 0 and <= {MAX_TIMEOUT_S:g} seconds (got {self.teardown_grace_s:g})",
        )
        require(0 <= self.metrics_port <= 65535, "metrics_port", "must be a TCP port in 1..65535, or 0 for no /metrics endpoint")
        require(
            valid_host(self.control_host),
            "control_host",
            f"must be one address or host name of this host, e.g. 127.0.0.1 or 10.0.0.5 (got {self.control_host!r}); "
            "a wildcard would listen on every interface",
        )
        require(
            self.control != "tcp" or zmq_has_curve(),
            "control",
            'is "tcp" but this pyzmq/libzmq has no CURVE support, so peers could not be authenticated; use "ipc"',
        )


@dataclass
class TopologyConfig:
    """Which device each process runs on: one OS process per entry."""

    targets: list[str] = field(default_factory=lambda: ["cpu"])
    drafters: list[str] = field(default_factory=lambda: ["cpu"])
    dist_backend: Literal["auto", "gloo", "nccl"] = "auto"

    def __post_init__(self) -> None:
        require(len(self.targets) >= 1, "targets", 'needs at least one target device, e.g. ["cuda:0"]')
        require(len(self.drafters) >= 1, "drafters", 'needs at least one drafter device, e.g. ["cuda:1"]')
        for name, devs in (("targets", self.targets), ("drafters", self.drafters)):
            for i, dev in enumerate(devs):
                require(valid_device(dev), f"{name}[{i}]", f'{dev!r} is not a device; use "cpu" or "cuda:N"')
        uses_cuda = any(d.startswith("cuda") for d in self.targets + self.drafters)
        require(
            not (self.dist_backend == "nccl" and any(d == "cpu" for d in self.drafters)),
            "dist_backend",
            'nccl needs every drafter on a cuda device; use "gloo" or "auto"',
        )
        require(
            not (uses_cuda and any(d == "cpu" for d in self.targets + self.drafters)),
            "targets",
            "mixing cpu and cuda processes in one run is not supported; put all on cuda or all on cpu",
        )
        if self.resolved_dist_backend() == "nccl":
            seen: dict[int, int] = {}
            for i, dev in enumerate(self.drafters):
                index = int(dev[5:])
                require(
                    index not in seen,
                    f"drafters[{i}]",
                    f"{dev!r} is already drafters[{seen.get(index)}]: NCCL needs one GPU per drafter; give each drafter its own device",
                )
                seen[index] = i

    @property
    def on_cuda(self) -> bool:
        return self.targets[0].startswith("cuda")

    def resolved_dist_backend(self) -> str:
        if self.dist_backend != "auto":
            return self.dist_backend
        return "nccl" if self.on_cuda else "gloo"


@dataclass
class TransportConfig:
    # "nccl": slots sent point to point over torch.distributed (NCCL on GPU, gloo on CPU), for
    # drafters on other hosts; never chosen by "auto".
    backend: Literal["auto", "cpu-shm", "host-pinned", "cuda-ipc", "nccl"] = "auto"
    ring_slots: int = 4
    # Credits: at most this many slots outstanding at one drafter (held or queued), from all targets.
    max_outstanding_per_drafter: int = 3
    # Batches a drafter keeps copied out of the rings, ready to train on.
    drafter_prefetch: int = 1
    # Extra slot capacity in tokens above the token budget (0: exactly data.token_budget).
    slot_tokens: int = 0

    def __post_init__(self) -> None:
        require(self.ring_slots >= 2, "ring_slots", f"must be >= 2 (got {self.ring_slots}); raise it to at least 2")
        require(self.ring_slots <= 64, "ring_slots", f"must be <= 64 (got {self.ring_slots})")
        require(self.max_outstanding_per_drafter >= 1, "max_outstanding_per_drafter", "must be >= 1")
        require(self.drafter_prefetch >= 1, "drafter_prefetch", "must be >= 1")
        require(self.slot_tokens >= 0, "slot_tokens", "must be >= 0")


@dataclass
class DataConfig:
    # JSONL files, or "builtin:stdlib-docs" for the bundled offline corpus.
    paths: list[str] = field(default_factory=lambda: ["builtin:stdlib-docs"])
    on_bad_line: Literal["skip", "error"] = "skip"
    max_seq_len: int = 2048
    bucket_edges: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048])
    token_budget: int = 16384
    max_batch_size: int = 64
    num_epochs: int = 1
    cache_dir: str = ""  # empty: RUN_DIR/data
    # Built-in corpus size (number of conversations); ignored for file paths.
    builtin_samples: int = 2000
    holdout_paths: list[str] = field(default_factory=list)  # held-out chat data (gen-data's OUT.holdout.jsonl), never trained on
    weights: list[float] = field(default_factory=list)  # the mix: one per path (data/mix.py); empty: every sample once an epoch

    def __post_init__(self) -> None:
        require(len(self.paths) >= 1, "paths", 'needs at least one JSONL path or "builtin:stdlib-docs"')
        require(self.max_seq_len >= 8, "max_seq_len", "must be >= 8 tokens")
        require(len(self.bucket_edges) >= 1, "bucket_edges", "needs at least one edge")
        require(
            all(b > a for a, b in zip(self.bucket_edges, self.bucket_edges[1:])),
            "bucket_edges",
            f"must be strictly increasing (got {self.bucket_edges})",
        )
        require(self.bucket_edges[0] >= 2, "bucket_edges", "edges must be >= 2 tokens")
        require(
            self.bucket_edges[-1] == self.max_seq_len,
            "bucket_edges",
            f"the last edge must equal data.max_seq_len ({self.max_seq_len}); got {self.bucket_edges[-1]}",
        )
        require(
            self.token_budget >= self.max_seq_len,
            "token_budget",
            f"must be >= data.max_seq_len ({self.max_seq_len}) so the longest sequence fits one batch",
        )
        require(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        require(self.num_epochs >= 1, "num_epochs", "must be >= 1")
        require(self.builtin_samples >= 1, "builtin_samples", "must be >= 1")
        check_mix_weights(self.paths, self.weights)


@dataclass
class TargetConfig:
    # A Hugging Face checkpoint directory; empty: build a random-weight model from ``spec``.
    model_path: str = ""
    # Qwen3_5TextConfig fields for a random-weight target (used when model_path is empty).
    spec: dict[str, Any] = field(default_factory=dict)
    # Tokenizer directory; "builtin" = the offline byte-level tokenizer with a chat template;
    # empty: the model's own tokenizer (model_path) when a checkpoint is set, else "builtin".
    tokenizer: str = ""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Decoder-layer outputs to capture; empty: DFlash default spread (5 layers from 1 to L-3).
    layer_ids: list[int] = field(default_factory=list)
    num_capture_layers: int = 5
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flex_attention"] = "sdpa"
    # Also ship the target's final (normed) hidden state, needed by training.kl_weight > 0.
    capture_last_hidden: bool = False
    async_pack: bool = True
    random_init_seed: int = 1234
    # Each batch's documents back to back in one row, no padding computed (target/varlen.py). "auto": packed wherever
    # varlen kernels run it (flash/flex or sdpa's varlen_attn on CUDA; fla for GatedDeltaNet); true / false force it.
    varlen: bool | Literal["auto"] = "auto"
    quantization: Quantization = "none"  # "fp8": e4m3 linear layers (config_quant.py, target/fp8.py)
    # Norms and SwiGLU (and an FP8 down projection's quantizer) as torch.compile'd fused kernels (target/fused.py).
    # "auto": on CUDA, where Triton compiles them; true / false force it.
    fuse_elementwise: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        if not self.tokenizer:
            self.tokenizer = self.model_path or "builtin"
        check_target_quantization(self.quantization, self.dtype)
        require(all(i >= 0 for i in self.layer_ids), "layer_ids", "layer ids must be >= 0")
        require(
            all(b > a for a, b in zip(self.layer_ids, self.layer_ids[1:])),
            "layer_ids",
            f"must be strictly ascending (got {self.layer_ids}): serving engines collect hidden states in layer order, "
            f"so a drafter trained on another order reads the wrong planes; use {sorted(set(self.layer_ids))}",
        )
        require(self.num_capture_layers >= 1, "num_capture_layers", "must be >= 1")


@dataclass
class TrainingConfig:
    lr: float = 6e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    # > 0: warm up over this share of the schedule's steps instead of warmup_steps (SpecForge: ~0.04).
    warmup_fraction: float = 0.0
    max_steps: int = 0  # 0: until the data (num_epochs) is exhausted
    weight_decay: float = 0.01  # AdamW, on matrices only (norms and biases: none); SpecForge uses 0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # AdamW; SpecForge uses [0.9, 0.999]
    grad_clip: float = 1.0
    loss_gamma: float = 7.0  # "decay" weighting: slot s >= 1 of a block weighs exp(-(s-1)/loss_gamma)
    # "dpace": D-PACE (arXiv 2605.18810), slot weights from the drafter's own confidence (drafter/loss.py)
    loss_weighting: Literal["decay", "dpace"] = "decay"
    dpace_alpha: float = 0.5  # D-PACE smoothing q~ = (1 - alpha) q + alpha of the confidence q; 1: fixed weights
    dpace_normalizer: Literal["blocks", "weights"] = "blocks"  # divide the loss by the blocks or by the sum of weights
    ce_chunk_tokens: int = 2048
    ce_compile: bool = False  # torch.compile each CE chunk's fp32 passes (cast, logsumexp, softmax grad) into fused kernels
    kl_weight: float = 0.0
    checkpoint_every: int = 0  # 0: only at the end and on shutdown
    keep_checkpoints: int = 2
    export_on_finish: bool = True
    # Write a checkpoint when training ends (benchmarks turn it off: at large shapes it is many GB).
    checkpoint_on_finish: bool = True
    holdout_every: int = 0  # ~every N steps a pass over data.holdout_paths measures tau_holdout (docs/EVAL.md); 0: off
    holdout_batches: int = 4  # batches per held-out pass; 0: all of them
    # tau_holdout simulates eval's decode over the first N tokens of each held-out answer: set it to eval's --max-new; 0: whole answers
    holdout_max_new: int = 0
    # Training time budget: the schedule's length is planned from the measured pace so the cosine ends as the
    # seconds run out (drafter/time_budget.py); max_steps, when set, caps it. 0: no budget.
    max_seconds: float = 0.0

    def __post_init__(self) -> None:
        for key in ("holdout_every", "holdout_batches"):
            require(getattr(self, key) >= 0, key, "must be >= 0 (0: off / every held-out batch in a pass)")
        require(self.holdout_max_new >= 0, "holdout_max_new", "must be >= 0 (eval's --max-new, or 0 for whole answers)")
        require(self.max_seconds >= 0 and math.isfinite(self.max_seconds), "max_seconds", "must be >= 0 seconds (0: no time budget)")
        require(self.lr > 0 and math.isfinite(self.lr), "lr", "must be a positive number")
        require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        require(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        require(
            0 <= self.warmup_fraction < 1,
            "warmup_fraction",
            f"must be in [0, 1) (got {self.warmup_fraction}); e.g. 0.04 warms up over 4% of the steps, 0 uses training.warmup_steps",
        )
        require(self.max_steps >= 0, "max_steps", "must be >= 0 (0 = until the data is exhausted)")
        require(
            0 <= self.weight_decay < 1 and math.isfinite(self.weight_decay),
            "weight_decay",
            f"must be in [0, 1) (got {self.weight_decay}); AdamW multiplies it by the learning rate, 0 disables it",
        )
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            f"must be two numbers in [0, 1), e.g. [0.9, 0.95] (got {self.betas})",
        )
        require(self.grad_clip >= 0, "grad_clip", "must be >= 0 (0 disables clipping)")
        require(self.loss_gamma > 0, "loss_gamma", "must be > 0")
        require(0 < self.dpace_alpha <= 1, "dpace_alpha", f"must be in (0, 1] (got {self.dpace_alpha}); 0.5 is the paper's")
        require(self.ce_chunk_tokens >= 16, "ce_chunk_tokens", "must be >= 16")
        require(self.kl_weight >= 0, "kl_weight", "must be >= 0")
        require(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")

    def resolved_warmup_steps(self, total_steps: int) -> int:
        """Warm-up length for a schedule of ``total_steps``: warmup_fraction of it (at least 1) if set."""
        if self.warmup_fraction > 0:
            return max(1, round(self.warmup_fraction * total_steps))
        return self.warmup_steps


@dataclass
class DFlashConfig:
    run: RunConfig = field(default_factory=RunConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    data: DataConfig = field(default_factory=DataConfig)
    target: TargetConfig = field(default_factory=TargetConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    chat_template: ChatTemplateConfig = field(default_factory=ChatTemplateConfig)
    source: str = "<defaults>"

    def __post_init__(self) -> None:
        if self.transport.backend == "cpu-shm":
            require(not self.topology.on_cuda, "transport.backend", 'cpu-shm needs cpu devices; use "auto" on GPUs')
        if self.transport.backend in ("cuda-ipc", "host-pinned"):
            require(
                self.topology.on_cuda,
                "transport.backend",
                f'{self.transport.backend} needs cuda devices; use "cpu-shm" or "auto" on CPU',
            )
        require(
            self.run.control == "ipc" or self.transport.backend == "nccl",
            "run.control",
            'is "tcp", which is for targets and drafters on different hosts: set transport.backend = "nccl" too, or use "ipc"',
        )
        if self.training.kl_weight > 0:
            require(
                self.target.capture_last_hidden,
                "training.kl_weight",
                "needs target.capture_last_hidden = true (the KL loss reads the target's last hidden state)",
            )
            require(self.drafter.draft_vocab_size == 0, "training.kl_weight", "needs drafter.draft_vocab_size = 0 (the whole vocabulary)")
        require(self.training.holdout_every == 0 or bool(self.data.holdout_paths), "training.holdout_every", "needs data.holdout_paths")
        shared = set(self.data.holdout_paths) & set(self.data.paths)
        require(not shared, "data.holdout_paths", f"{sorted(shared)} also in data.paths: held-out data is never trained on")

    def resolved_backend(self) -> str:
        """The transport backend, with "auto" resolved where no GPU probing is needed."""
        if self.transport.backend != "auto":
            return self.transport.backend
        return "cpu-shm" if not self.topology.on_cuda else "auto"

    def ignored_value_warnings(self) -> list[str]:
        out = []
        if self.target.model_path and self.target.spec:
            out.append("target.spec is ignored because target.model_path is set")
        if self.target.layer_ids and self.target.num_capture_layers != 5 and len(self.target.layer_ids) != self.target.num_capture_layers:
            out.append("target.num_capture_layers is ignored because target.layer_ids is set")
        if "sliding_attention" not in self.drafter.resolved_layer_types() and self.drafter.sliding_window != 2048:
            out.append("drafter.sliding_window is ignored: no drafter layer is sliding_attention")
        if not self.topology.on_cuda and self.topology.dist_backend == "nccl":
            out.append("topology.dist_backend=nccl is ignored on cpu")
        if self.target.capture_last_hidden and self.training.kl_weight == 0:
            out.append("target.capture_last_hidden ships an extra plane that nothing reads while training.kl_weight = 0")
        if self.training.warmup_fraction > 0 and self.training.warmup_steps != TrainingConfig.warmup_steps:
            out.append("training.warmup_steps is ignored because training.warmup_fraction is set")
        if not any(p.startswith("builtin:") for p in self.data.paths) and self.data.builtin_samples != 2000:
            out.append("data.builtin_samples is ignored: no builtin: data path is used")
        return out

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    def run_dir(self, override: str | None = None) -> Path:
        if override:
            return Path(override)
        return Path(self.run.run_dir) if self.run.run_dir else Path("runs") / self.run.name


SECTIONS: dict[str, type] = {
    "run": RunConfig,
    "topology": TopologyConfig,
    "transport": TransportConfig,
    "data": DataConfig,
    "target": TargetConfig,
    "drafter": DrafterConfig,
    "training": TrainingConfig,
    "synth": SynthConfig,
    "chat_template": ChatTemplateConfig,
}


# --------------------------------------------------------------------------- loading


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> DFlashConfig:
    """Load and validate a TOML config; raises :class:`ConfigError` naming file and key."""
    path = Path(path)
    src = str(path)
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{src}: file not found") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(f"{src}: not UTF-8 text ({e.reason} at line {line}, byte {e.start}); save the file as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{src}: cannot read: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{src}: not valid TOML: {e}") from None
    for dotted, value in (overrides or {}).items():
        section, _, key = dotted.partition(".")
        raw.setdefault(section, {})[key] = value
    return config_from_dict(raw, source=src)


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> DFlashConfig:
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise ConfigError(f"{source}: {unknown[0]}: unknown section{did_you_mean(unknown[0], SECTIONS)}")
    built = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{source}: {name}: must be a table ([{name}])")
        built[name] = build_section(cls, table, name, source)
    try:
        return DFlashConfig(**built, source=source)
    except FieldError as e:
        raise ConfigError(f"{source}: {e.key}: {e.message}") from None


RESOLVED_CONFIG_FILE = "config.json"


def write_resolved_config(cfg: DFlashConfig, run_dir: Path) -> Path:
    """Freeze the validated config into the run directory; children load exactly this."""
    path = Path(run_dir) / RESOLVED_CONFIG_FILE
    write_text_atomic(path, json.dumps({"source": cfg.source, "config": cfg.to_dict()}, indent=2))
    return path


def load_resolved_config(run_dir: Path) -> DFlashConfig:
    return read_resolved_config(Path(run_dir) / RESOLVED_CONFIG_FILE)


def read_resolved_config(path: Path) -> DFlashConfig:
    """A config frozen by :func:`write_resolved_config`; errors still name the original file."""
    d = json.loads(Path(path).read_text())
    return config_from_dict(d["config"], source=d.get("source", str(Path(path).parent)))
