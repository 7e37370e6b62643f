"""Typed run configuration: TOML files loaded into small validated dataclasses, one per section.

Every section is a dataclass of its own module (:mod:`~dflash_ipc.config.run`,
:mod:`~dflash_ipc.config.topology`, :mod:`~dflash_ipc.config.transport`,
:mod:`~dflash_ipc.config.data` with ``[synth]`` and ``[chat_template]``,
:mod:`~dflash_ipc.config.target`, :mod:`~dflash_ipc.config.drafter`,
:mod:`~dflash_ipc.config.training`), validated in ``__post_init__`` with ``ValueError``s that say
what to change; each field is documented by the docstring under it (``docs/CONFIG.md`` is generated
from them). :func:`load_config` walks the TOML document against those dataclasses and refuses,
*before any process starts*:

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
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ipc.config.data import ChatTemplateConfig, DataConfig, SynthConfig
from dflash_ipc.config.drafter import DrafterConfig
from dflash_ipc.config.fields import SET_SOURCE, ConfigError, FieldError, build_section, did_you_mean, require
from dflash_ipc.config.run import RunConfig
from dflash_ipc.config.target import TargetConfig
from dflash_ipc.config.topology import TopologyConfig
from dflash_ipc.config.training import TrainingConfig
from dflash_ipc.config.transport import BACKENDS, TransportConfig
from dflash_ipc.rundir.fsutil import write_text_atomic

__all__ = [
    "RESOLVED_CONFIG_FILE",
    "SECTIONS",
    "SET_SOURCE",
    "DFlashConfig",
    "blame_sets",
    "config_from_dict",
    "load_config",
    "load_resolved_config",
    "parse_sets",
    "read_resolved_config",
    "write_resolved_config",
]


@dataclass
class DFlashConfig:
    """The whole config: one field per section, and the checks that span sections."""

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
        backend = BACKENDS.get(self.transport.backend)  # None: "auto"
        if backend is not None and backend.devices == "cpu":
            require(not self.topology.on_cuda, "transport.backend", f'{backend.name} needs cpu devices; use "auto" on GPUs')
        if backend is not None and backend.devices == "cuda":
            require(self.topology.on_cuda, "transport.backend", f'{backend.name} needs cuda devices; use "cpu-shm" or "auto" on CPU')
        off_host = " or ".join(f'"{b.name}"' for b in BACKENDS.values() if b.off_host)
        require(
            self.run.control == "ipc" or (backend is not None and backend.off_host),
            "run.control",
            f'is "tcp", which is for targets and drafters on different hosts: set transport.backend = {off_host} too, or use "ipc"',
        )
        if self.training.kl_weight > 0:
            require(
                self.target.capture_last_hidden,
                "training.kl_weight",
                "needs target.capture_last_hidden = true (the KL loss reads the target's last hidden state)",
            )
            require(self.drafter.draft_vocab_size == 0, "training.kl_weight", "needs drafter.draft_vocab_size = 0 (the whole vocabulary)")
        require(self.training.holdout_every == 0 or bool(self.data.holdout_paths), "training.holdout_every", "needs data.holdout_paths")
        self._check_attention_devices()
        shared = set(self.data.holdout_paths) & set(self.data.paths)
        require(not shared, "data.holdout_paths", f"{sorted(shared)} also in data.paths: held-out data is never trained on")

    def _check_attention_devices(self) -> None:
        """Kernels that exist on CUDA only, asked for on the CPU (whether they are installed: the preflight)."""
        cpu_targets = [i for i, d in enumerate(self.topology.targets) if not d.startswith("cuda")]
        require(
            self.target.attn_implementation != "flash_attention_2" or not cpu_targets,
            "target.attn_implementation",
            f'"flash_attention_2" runs on CUDA GPUs only, but topology.targets[{cpu_targets[0] if cpu_targets else 0}] is the CPU; '
            'use "sdpa"',
        )
        cpu_drafters = [i for i, d in enumerate(self.topology.drafters) if not d.startswith("cuda")]
        require(
            self.drafter.attention != "flex" or not cpu_drafters,
            "drafter.attention",
            f'"flex" (FlexAttention\'s block-sparse kernels) needs CUDA drafters, but '
            f'topology.drafters[{cpu_drafters[0] if cpu_drafters else 0}] is the CPU; use "auto", "blockwise" or "sdpa"',
        )

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


def load_config(path: str | Path, overrides: dict[str, Any] | None = None, *, sets: Sequence[str] = ()) -> DFlashConfig:
    """Load and validate a TOML config; raises :class:`ConfigError` naming file and key.

    ``sets``: the user's ``--set SECTION.KEY=VALUE`` items, applied over the file and checked like
    it; an error in a key they set names ``--set KEY`` instead of the file. ``overrides``: dotted
    keys the program itself sets (``up --max-steps``, a bench variant), applied last.
    """
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
    except RecursionError:  # tomllib recurses once per nested array or inline table
        raise ConfigError(f"{src}: not valid TOML here: arrays or tables nested deeper than its reader allows") from None
    for dotted, value in parse_sets(sets).items():
        _set_dotted(raw, dotted, value, SET_SOURCE)
    for dotted, value in (overrides or {}).items():
        _set_dotted(raw, dotted, value, src)
    try:
        return config_from_dict(raw, source=src)
    except ConfigError as e:
        raise blame_sets(e, sets) from None


# --------------------------------------------------------------------------- --set overrides


def parse_sets(sets: Sequence[str]) -> dict[str, Any]:
    """``["training.lr=3e-4", "run.name=x"]`` -> ``{"training.lr": 0.0003, "run.name": "x"}``.

    VALUE is read as a TOML value (numbers, booleans, strings in quotes, arrays, inline tables);
    text that is not one is taken as a string, so ``run.name=trial-2`` needs no quotes."""
    out: dict[str, Any] = {}
    for item in sets:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ConfigError(f"{SET_SOURCE} {item!r}: expected SECTION.KEY=VALUE, e.g. --set training.lr=3e-4")
        if len(key.split(".")) < 2 or not all(key.split(".")):
            raise ConfigError.at(SET_SOURCE, key, "name a key with its section, SECTION.KEY=VALUE, e.g. training.lr=3e-4")
        out[key] = toml_value(text.strip())
    return out


def toml_value(text: str) -> Any:
    """``text`` as a TOML value, or the text itself when it is not one."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except (tomllib.TOMLDecodeError, RecursionError):  # nested past tomllib's recursion: text, refused by its key's type
        return text


def _set_dotted(raw: dict[str, Any], dotted: str, value: Any, source: str) -> None:
    *parents, leaf = dotted.split(".")
    table = raw
    for depth, part in enumerate(parents):
        table = table.setdefault(part, {})
        if not isinstance(table, dict):
            raise ConfigError.at(source, dotted, f"{'.'.join(parents[: depth + 1])} is a value, not a table")
    table[leaf] = value


def blame_sets(err: ConfigError, sets: Sequence[str]) -> ConfigError:
    """``err`` named after the ``--set`` item that caused it; else, when ``--set`` items were given, ``err``
    with them appended (the file's value may be refused because of one of them)."""
    if not sets or err.key is None or err.detail is None or err.source is None:
        return err
    keys = [item.partition("=")[0].strip() for item in sets]
    if any(err.key == k or err.key.startswith((f"{k}.", f"{k}[")) or k.startswith(f"{err.key}.") for k in keys):
        return ConfigError.at(SET_SOURCE, err.key, err.detail)
    note = f"(with {' '.join(f'--set {s}' for s in sets)})"
    if err.source == SET_SOURCE or err.detail.endswith(note):
        return err
    return ConfigError.at(err.source, err.key, f"{err.detail} {note}")


def config_from_dict(raw: dict[str, Any], source: str = "<dict>") -> DFlashConfig:
    """Build and validate every section of ``raw`` (a parsed TOML document); errors name ``source`` and the key."""
    unknown = [k for k in raw if k not in SECTIONS]
    if unknown:
        raise ConfigError.at(source, unknown[0], f"unknown section{did_you_mean(unknown[0], SECTIONS)}")
    built = {}
    for name, cls in SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError.at(source, name, f"must be a table ([{name}])")
        built[name] = build_section(cls, table, name, source)
    try:
        return DFlashConfig(**built, source=source)
    except FieldError as e:
        raise ConfigError.at(source, e.key, e.message) from None


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
