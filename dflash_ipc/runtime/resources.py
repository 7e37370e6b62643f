"""Memory a run needs, estimated before any process starts, against what this machine has.

A config whose rings, models or optimizer state cannot fit used to start every process and fail
40 s later in one child's log ("need 147573952589682778112 bytes"), or hang until the handshake
timeout while a drafter allocated 100,000 layers. The preflight (in ``up``'s probe process and in
``check-config``) adds up, per place, what the run will certainly hold:

* each target: its weights (the spec's stack, or the checkpoint's tensors as its safetensors headers
  list them, every expert of an MoE included, all loaded before the unused layers are dropped: a float
  tensor in ``target.dtype``, a quantized one such as FP8 or MXFP4 in the bytes it is stored in) and one
  batch of captured planes;
* each drafter: its trainable parameters with the optimizer's state (fp32 master, gradient and
  two AdamW moments per parameter, plus the compute copy when it is not fp32) and the target's
  frozen embedding and LM head (with ``training.ce_fp8`` also the head's two e4m3 copies);
* each target's ring: ``transport.ring_slots`` slots of the slot layout, in shared memory
  (``cpu-shm``, ``host-pinned``: /dev/shm, which is host memory too) or on the target's GPU
  (``cuda-ipc``, ``nccl``);
* every process: what it holds of its own in host memory whatever its device (the interpreter, torch;
  :data:`FORKED_PROCESS_HOST_BYTES`, measured), and the fork server it is forked from;

and refuses a place whose total exceeds what it has: host memory (available RAM), /dev/shm (free
space, less a margin: a tmpfs that runs out kills the writer with SIGBUS), each GPU (free memory).
The figures are lower bounds (activations are left out), so nothing that would fit is refused.
The refusal names the key that drives the largest item: of the keys that size it, the one
furthest above its default.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from dflash_ipc.config import ConfigError, DataConfig, DFlashConfig, DrafterConfig, TargetConfig, TopologyConfig, TransportConfig
from dflash_ipc.config.transport import BACKENDS
from dflash_ipc.families import family_of
from dflash_ipc.transport.shm_names import SHM_DIR, shm_free_bytes

# Free space /dev/shm keeps beyond the rings (other processes, tmpfs rounding).
SHM_MARGIN_BYTES = 16 << 20
# AdamW per trainable parameter: fp32 master weight, fp32 gradient, two fp32 moments.
OPTIMIZER_BYTES_PER_PARAM = 16
# Host memory each target or drafter process holds of its own beyond the items below (interpreter, torch and
# transformers, their allocators and threads, its sentinel), whatever its device. Measured on configs/tiny-cpu.toml
# (2 targets, 2 drafters, 117 steps, 2 CPU cores): each child's unique set size (psutil USS, pages no other process
# shares) sampled every 0.3 s, its peak: 200-218 MiB for children forked from the fork server (run.launcher "auto" on
# CPU: the preloaded pages they still share are the server's, counted once below), 295-371 MiB for exec'd children
# (each imports torch itself); their RSS peaks 0.39-0.42 GiB (shared pages counted in each). The lowest peak of
# each launcher is the bound, as every figure here is one.
FORKED_PROCESS_HOST_BYTES = 200 << 20
EXEC_PROCESS_HOST_BYTES = 288 << 20
# The fork server itself (its preload: torch, transformers, the roles' modules), measured the same way: 0.33 GiB.
FORK_SERVER_HOST_BYTES = 320 << 20
HOST = "host memory"
SHM = f"shared memory ({SHM_DIR})"

# The sizes of a Qwen3_5TextConfig built without them: a spec value far above these drives its size.
_SPEC_REFERENCE = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


@dataclass
class Need:
    """One item of memory: ``nbytes`` at ``place``; ``factors`` (key, value, reference) size it."""

    what: str
    place: str
    nbytes: int
    factors: list[tuple[str, int, int]] = field(default_factory=list)

    def blamed_key(self) -> tuple[str, int]:
        key, value, _ = max(self.factors, key=lambda f: f[1] / max(1, f[2]))
        return key, value


@dataclass
class Available:
    """Bytes free per place: ``host`` RAM, ``shm`` (/dev/shm), ``cuda`` by device index."""

    host: int
    shm: int
    cuda: dict[int, int] = field(default_factory=dict)
    host_limited_by: str = ""  # the cgroup file whose limit caps ``host`` ("" when the machine's free memory does)


def human(n: int) -> str:
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            return f"{n} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- estimates


def slot_bytes(cfg: DFlashConfig, num_planes: int, hidden: int) -> int:
    from dflash_ipc.transport.slots import SlotLayout

    layout = SlotLayout(num_planes, hidden, cfg.data.token_budget + cfg.transport.slot_tokens, cfg.data.max_batch_size, cfg.target.dtype)
    return layout.slot_bytes


def drafter_trainable_params(m: Any) -> int:
    """Trainable parameters of a DFlash drafter of shape ``m`` (a DrafterModelConfig), as
    :class:`~dflash_ipc.drafter.model.dflash_drafter.DFlashDrafter` declares them (tests/runtime/test_resources.py holds the two equal)."""
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    per_layer = 2 * h + h * q + 2 * h * kv + q * h + 2 * m.head_dim + 3 * h * m.intermediate_size
    return m.num_context_planes * h * h + 2 * h + m.num_layers * per_layer


def target_weight_params(cfg: TargetConfig, hf_config: Any, n_build: int) -> int:
    """Parameters the target process loads: the checkpoint's every tensor, or the spec's stack."""
    if cfg.model_path:
        return checkpoint_params(Path(cfg.model_path))
    return qwen3_5_stack_params(hf_config, list(hf_config.layer_types)[:n_build])


def target_weight_bytes(cfg: TargetConfig, hf_config: Any, n_build: int) -> int:
    """Bytes of the weights the target process loads in ``cfg.dtype``: the spec's stack, or every tensor of the
    checkpoint (every expert of an MoE) as :func:`checkpoint_weight_bytes` sizes it."""
    from dflash_ipc.platform.devices import dtype_from_name

    itemsize = dtype_from_name(cfg.dtype).itemsize
    if cfg.model_path:
        return checkpoint_weight_bytes(Path(cfg.model_path), itemsize)
    return target_weight_params(cfg, hf_config, n_build) * itemsize


def qwen3_5_stack_params(c: Any, layer_types: list[str]) -> int:
    """Parameters of a ``Qwen3_5TextModel`` of config ``c`` built with these layers (embedding, decoder
    layers, final norm), as transformers declares them (tests/runtime/test_resources.py holds the two equal),
    counted without importing its modeling module: that import brings torch._dynamo, over a CPU-second
    of every `up`'s start."""
    h = c.hidden_size
    head = getattr(c, "head_dim", h // c.num_attention_heads)
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    attention = h * 2 * q + 2 * h * kv + q * h + 2 * head  # q_proj carries the output gate: 2 * q
    if c.attention_bias:
        attention += 2 * q + 2 * kv + h
    key, value = c.linear_key_head_dim * c.linear_num_key_heads, c.linear_value_head_dim * c.linear_num_value_heads
    conv, v_heads = 2 * key + value, c.linear_num_value_heads
    # conv1d, dt_bias + A_log, the gated norm, out_proj, in_proj_qkv, in_proj_z, in_proj_b + in_proj_a
    linear = conv * c.linear_conv_kernel_dim + 2 * v_heads + c.linear_value_head_dim + value * h + h * conv + h * value + 2 * h * v_heads
    per_layer = 3 * h * c.intermediate_size + 2 * h  # the MLP and the two norms
    mixers = sum(linear if t == "linear_attention" else attention for t in layer_types)
    largest = max(c.vocab_size, 2 * q, c.intermediate_size, conv) * h
    if largest * 8 > 2**63 - 1:  # torch sizes a tensor's storage in int64 bytes: it could not build this one
        raise ValueError(f"a weight of {largest} elements ({h} x {largest // h}) has no 64-bit byte size")
    return c.vocab_size * h + len(layer_types) * per_layer + mixers + h


#: safetensors dtypes transformers casts to the requested dtype when it loads them (``dtype=``).
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
#: Bytes per element of the other safetensors dtypes (quantized and packed weights, their scales, integers).
STORED_ITEMSIZE = {"F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F4": 1, "U8": 1, "I8": 1, "BOOL": 1, "I16": 2, "U16": 2}


def checkpoint_params(model_dir: Path) -> int:
    """Elements of every tensor of a safetensors checkpoint, from the files' headers alone."""
    return sum(elements for _, elements in _checkpoint_tensors(model_dir))


def checkpoint_weight_bytes(model_dir: Path, itemsize: int) -> int:
    """The least a checkpoint's tensors hold once loaded with ``itemsize``-byte floats, from its headers alone:
    a floating-point tensor (an MoE's every expert among them) ``itemsize`` bytes per element, as transformers
    casts it; a quantized or packed one (FP8 weights, MXFP4's two 4-bit values per byte, their scales) the
    bytes it is stored in, which its quantizer keeps or dequantizes into more."""
    total = 0
    for dtype, elements in _checkpoint_tensors(model_dir):
        total += elements * (itemsize if dtype in FLOAT_DTYPES else STORED_ITEMSIZE.get(dtype, 4))
    return total


def _checkpoint_tensors(model_dir: Path) -> list[tuple[str, int]]:
    """(safetensors dtype, elements) of every tensor of a checkpoint (sharded or not)."""
    index = model_dir / "model.safetensors.index.json"
    names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    return [tensor for name in names for tensor in _safetensors_tensors(model_dir / name)]


def _safetensors_tensors(path: Path) -> list[tuple[str, int]]:
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= 100 << 20:
            raise ValueError(f"{path} is not a safetensors file (no header)")
        try:
            header = json.loads(f.read(n))
            return [(str(info["dtype"]), math.prod(int(d) for d in info["shape"])) for key, info in header.items() if key != "__metadata__"]
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: a malformed safetensors header ({type(e).__name__}: {e})") from None


def estimate(cfg: DFlashConfig, hf_config: Any, layer_ids: list[int], drafter_shape: Any, backend: str) -> list[Need]:
    """What the run will hold, item by item (see the module docstring)."""
    from dflash_ipc.platform.devices import dtype_from_name
    from dflash_ipc.target_spec.hf_config import text_config

    tc = text_config(hf_config)
    hidden, vocab, n_layers = int(tc.hidden_size), int(tc.vocab_size), int(tc.num_hidden_layers)
    num_planes = len(layer_ids) + (1 if cfg.target.capture_last_hidden else 0)
    n_build = n_layers if cfg.target.capture_last_hidden else max(layer_ids) + 1
    t_size = dtype_from_name(cfg.target.dtype).itemsize
    d_size = dtype_from_name(cfg.drafter.dtype).itemsize
    spec_factors = _spec_factors(cfg, hidden)
    hidden_factor = next((f for f in spec_factors if f[0].endswith(".hidden_size")), ("target.model_path", hidden, hidden))
    tokens = cfg.data.token_budget + cfg.transport.slot_tokens
    data_ref, transport_ref = DataConfig(), TransportConfig()
    # the slot's tokens are the budget plus slot_tokens: the larger of the two is the one to lower
    token_key = "transport.slot_tokens" if cfg.transport.slot_tokens > cfg.data.token_budget else "data.token_budget"
    ring_factors = [
        (token_key, tokens, data_ref.token_budget),
        ("data.max_batch_size", cfg.data.max_batch_size, data_ref.max_batch_size),
        ("transport.ring_slots", cfg.transport.ring_slots, transport_ref.ring_slots),
        ("target.num_capture_layers", num_planes, TargetConfig().num_capture_layers),
        hidden_factor,
    ]
    plane_factors = [f for f in ring_factors if f[0] not in ("data.max_batch_size", "transport.ring_slots")]
    weights = target_weight_bytes(cfg.target, hf_config, n_build)
    ring = cfg.transport.ring_slots * slot_bytes(cfg, num_planes, hidden)
    trainable = drafter_trainable_params(drafter_shape)
    heads = (1 if _tied(hf_config) else 2) * vocab * hidden * d_size
    heads += 2 * vocab * hidden if cfg.training.ce_fp8 else 0  # the head's two e4m3 copies (drafter/model/fp8_head.py)
    drafter_bytes = trainable * (OPTIMIZER_BYTES_PER_PARAM + (0 if d_size == 4 else d_size)) + heads
    d_ref = DrafterConfig()
    drafter_factors = [
        ("drafter.num_layers", cfg.drafter.num_layers, d_ref.num_layers),
        ("drafter.intermediate_size", drafter_shape.intermediate_size, drafter_shape.intermediate_size),
        hidden_factor,
    ]
    if cfg.drafter.intermediate_size:
        drafter_factors[1] = ("drafter.intermediate_size", cfg.drafter.intermediate_size, family_of(hf_config).mlp_width())
    needs = []
    for rank, dev in enumerate(cfg.topology.targets):
        place = _place(dev)
        weights_what = f"target-{rank} weights ({_count(weights // t_size)} parameters, {cfg.target.dtype})"
        needs.append(Need(weights_what, place, weights, spec_factors or [("target.model_path", 1, 1)]))
        needs.append(Need(f"target-{rank} captured planes", place, num_planes * tokens * hidden * t_size, plane_factors))
        ring_place = SHM if backend in BACKENDS and BACKENDS[backend].ring_memory == "host" else place
        ring_what = f"target-{rank} ring ({cfg.transport.ring_slots} slots x {human(ring // cfg.transport.ring_slots)})"
        needs.append(Need(ring_what, ring_place, ring, ring_factors))
    for rank, dev in enumerate(cfg.topology.drafters):
        what = f"drafter-{rank} ({_count(trainable)} trainable parameters with AdamW state, frozen embedding and LM head)"
        needs.append(Need(what, _place(dev), drafter_bytes, drafter_factors))
    return [*needs, process_overhead(cfg)]


def process_overhead(cfg: DFlashConfig) -> Need:
    """What the run's processes hold of their own in host memory (:data:`FORKED_PROCESS_HOST_BYTES`), whatever their devices."""
    from dflash_ipc.runtime.forkserver import use_forkserver

    targets, drafters = len(cfg.topology.targets), len(cfg.topology.drafters)
    forked = use_forkserver(cfg.run.launcher, cfg.topology.on_cuda)
    each = FORKED_PROCESS_HOST_BYTES if forked else EXEC_PROCESS_HOST_BYTES
    how = f"{human(each)} each, forked from a fork server of {human(FORK_SERVER_HOST_BYTES)}" if forked else f"{human(each)} each"
    reference = TopologyConfig()
    factors = [("topology.targets", targets, len(reference.targets)), ("topology.drafters", drafters, len(reference.drafters))]
    what = f"{targets + drafters} processes' own memory (interpreter, torch: {how})"
    return Need(what, HOST, (targets + drafters) * each + (FORK_SERVER_HOST_BYTES if forked else 0), factors)


def _spec_factors(cfg: DFlashConfig, hidden: int) -> list[tuple[str, int, int]]:
    spec = {} if cfg.target.model_path else cfg.target.spec
    out = [(f"target.spec.{k}", int(v), ref) for k, ref in _SPEC_REFERENCE.items() if isinstance(v := spec.get(k), int) and v > 0]
    if not cfg.target.model_path and not any(k.endswith(".hidden_size") for k, _, _ in out):
        out.append(("target.spec.hidden_size", hidden, _SPEC_REFERENCE["hidden_size"]))
    return out


def _tied(hf_config: Any) -> bool:
    from dflash_ipc.target_spec.heads import is_tied

    return is_tied(hf_config)


def _count(n: int) -> str:
    return f"{n:.3g}" if n >= 1e6 else str(n)


def _place(device: str) -> str:
    return HOST if device == "cpu" else device


# --------------------------------------------------------------------------- this machine


def measure_available(cfg: DFlashConfig) -> Available:
    """Free host memory (under this process's cgroup limits), /dev/shm space and memory of each CUDA device the
    topology names."""
    import psutil

    from dflash_ipc.platform.host_memory import host_memory

    cuda: dict[int, int] = {}
    devices = {int(d[5:]) for d in (*cfg.topology.targets, *cfg.topology.drafters) if d.startswith("cuda:")}
    if devices:
        import torch

        for i in sorted(devices):
            cuda[i] = int(torch.cuda.mem_get_info(i)[0])
    host = host_memory(int(psutil.virtual_memory().available))
    return Available(host=host.available, shm=shm_free_bytes(), cuda=cuda, host_limited_by=host.limited_by)


def check_fits(cfg: DFlashConfig, needs: list[Need], available: Available) -> None:
    """Refuse the first place whose needs exceed what it has, naming the key that drives them."""
    shm_total = sum(n.nbytes for n in needs if n.place == SHM)
    if shm_total and shm_total + SHM_MARGIN_BYTES > available.shm:
        _refuse(
            cfg,
            [n for n in needs if n.place == SHM],
            f"the rings need {human(shm_total)} of shared memory in {SHM_DIR} (plus a {human(SHM_MARGIN_BYTES)} margin) "
            f"but {SHM_DIR} has {human(available.shm)} free",
            f"; or remove leftovers of killed runs ({SHM_DIR}/dflash-ipc-*), or enlarge {SHM_DIR} (docker: --shm-size)",
        )
    # tmpfs pages are host memory: shared rings count there too
    host = [n for n in needs if n.place in (HOST, SHM)]
    host_total = sum(n.nbytes for n in host)
    if host and host_total > available.host:
        capped = f" under the cgroup limit in {available.host_limited_by}" if available.host_limited_by else ""
        _refuse(cfg, host, f"the run needs at least {human(host_total)} of {HOST} but {human(available.host)} is available{capped}", "")
    for index, free in sorted(available.cuda.items()):
        place = f"cuda:{index}"
        on_device = [n for n in needs if n.place == place]
        total = sum(n.nbytes for n in on_device)
        if on_device and total > free:
            _refuse(cfg, on_device, f"{place} would hold at least {human(total)} but has {human(free)} free", "")


def _refuse(cfg: DFlashConfig, needs: list[Need], headline: str, hint: str) -> NoReturn:
    biggest = sorted(needs, key=lambda n: n.nbytes, reverse=True)
    items = "; ".join(f"{n.what}: {human(n.nbytes)}" for n in biggest[:4])
    more = f"; and {len(biggest) - 4} more" if len(biggest) > 4 else ""
    key, value = biggest[0].blamed_key()
    message = f"{headline} ({items}{more}); {key} = {value} sizes the largest: lower it{hint}"
    raise ConfigError.at(cfg.source, key, message)


def anchor_chunk_target_need(cfg, device) -> int | None:
    """What a drafter on ``device`` leaves to a target sharing its GPU when it sizes its anchor chunk to the GPU
    (``drafter.anchor_chunk = "auto"``: :func:`target_need_bytes`); None when the chunk is a fixed number."""
    return target_need_bytes(cfg, device) if cfg.drafter.anchor_chunk == "auto" else None


def target_need_bytes(cfg, device) -> int:
    """A target's certain needs on ``device`` when one shares it (0 otherwise): the preflight's weights,
    planes and ring (:func:`estimate`), plus one decoder layer's forward
    activations over a batch."""
    import torch

    from dflash_ipc.data.tokenizer import load_tokenizer
    from dflash_ipc.drafter.model.dflash_drafter import DrafterModelConfig
    from dflash_ipc.platform.devices import dtype_from_name
    from dflash_ipc.target_spec.hf_config import load_hf_config, resolve_layer_ids, text_config

    place = str(torch.device(device))
    if place not in [str(torch.device(d)) for d in cfg.topology.targets]:
        return 0
    hf = load_hf_config(cfg.target, vocab_size=len(load_tokenizer(cfg.target.tokenizer)))
    tc = text_config(hf)
    layer_ids = resolve_layer_ids(cfg.target, int(tc.num_hidden_layers))
    shape = DrafterModelConfig.from_configs(cfg.drafter, hf, layer_ids, 0)
    needs = estimate(cfg, hf, layer_ids, shape, cfg.transport.backend)
    held = sum(n.nbytes for n in needs if n.place == place and n.what.startswith("target-"))
    tokens = cfg.data.token_budget + cfg.transport.slot_tokens
    layer = tokens * (3 * family_of(hf).mlp_width() + 8 * int(tc.hidden_size)) * dtype_from_name(cfg.target.dtype).itemsize
    return held + layer
