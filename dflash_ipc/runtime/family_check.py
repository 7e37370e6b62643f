"""The preflight's look at the target's family (:mod:`dflash_ipc.families`), before any process starts: the
attention implementation the target will be built with (``target.attn_implementation``: "auto" chooses one
the family supports, a named one it lacks is refused), whether that one is installed here, and whether the
packed forward can reproduce the family on each target device (``target.varlen = true`` where it cannot is
refused naming the family and what is missing; "auto" says why it pads). :func:`describe_target` is the line
``check-config`` and ``up`` print on what the target will run: the family, its attention, its experts, its
frozen head and the forward per device."""

from __future__ import annotations

from typing import Any, NoReturn

from dflash_ipc.config import ConfigError, DFlashConfig
from dflash_ipc.families import DecoderFamily, family_of

__all__ = ["check_attn_implementation", "check_target_family", "describe_target"]


def check_target_family(cfg: DFlashConfig, hf_config: Any) -> DecoderFamily:
    """The attention implementation and each target device's forward, for the config ``cfg`` of a target whose
    transformers config is ``hf_config``: refused by the key that cannot run (module docstring)."""
    family = family_of(hf_config)
    _forwards(cfg, family, check_attn_implementation(cfg.source, cfg.target.attn_implementation, family))
    return family


def describe_target(cfg: DFlashConfig) -> str:
    """One line on what a checked config's target runs: the family, its attention and traits, its experts and frozen
    head, and per target device the packed forward or why it pads (check-config and up print it)."""
    from dflash_ipc.data.tokenizer import load_tokenizer
    from dflash_ipc.target_spec.hf_config import load_hf_config

    family = family_of(load_hf_config(cfg.target, vocab_size=len(load_tokenizer(cfg.target.tokenizer))))
    attention = check_attn_implementation(cfg.source, cfg.target.attn_implementation, family)
    return f"{describe_family(family, attention)}; {'; '.join(_forwards(cfg, family, attention))}"


def _forwards(cfg: DFlashConfig, family: DecoderFamily, attention: str) -> list[str]:
    """Per target device: whether the packed forward runs there and how, or why it pads (``target.varlen = true`` where
    it cannot be exact is refused by that key)."""
    from dflash_ipc.platform.devices import dtype_from_name  # torch: the probe has it, the supervisor never imports it
    from dflash_ipc.target.varlen import plan_packed_attention

    dtype = dtype_from_name(cfg.target.dtype)
    forwards = []
    for device in sorted(set(cfg.topology.targets)):
        try:
            packs, why = plan_packed_attention(cfg.target.varlen, family, attention, device.split(":")[0], dtype)
        except ValueError as e:
            _fail(cfg.source, "target.varlen", str(e).removeprefix("target.varlen = true: "))
        forwards.append(f"{device}: {'packed' if packs else 'padded'}" + (f" ({why})" if why else ""))
    return forwards


def describe_family(family: DecoderFamily, attention: str) -> str:
    experts = family.experts()
    parts = [f"{family.name} family ({type(family).__name__})", f"attention {attention}"]
    features = family.attention_features()
    if features:
        parts.append(", ".join(features))
    if experts is not None:
        parts.append(f"{experts.num_experts} experts, {experts.active} active")
    head = family.frozen_head()
    if not head.is_plain:
        parts.append(f"frozen head: {head.describe()}")
    return "; ".join(parts)


def check_attn_implementation(source: str, requested: str, family: DecoderFamily) -> str:
    """The implementation ``target.attn_implementation = requested`` builds the target with, refused (naming
    the key) when the family's transformers class lacks it or this machine cannot run it (flash_attn does not
    import, this torch has no flex attention): else every target would fail while loading."""
    key = "target.attn_implementation"
    try:
        chosen = family.attention_implementation(requested)
    except ValueError as e:
        _fail(source, key, str(e))
    if chosen.startswith("flash_attention"):
        from transformers.utils import is_flash_attn_2_available

        if not is_flash_attn_2_available():
            _fail(
                source,
                key,
                'needs the flash_attn package and a CUDA device, and flash_attn does not import here; pip install flash-attn or use "auto"',
            )
    if chosen == "flex_attention":
        from transformers.utils import is_torch_flex_attn_available

        if not is_torch_flex_attn_available():
            _fail(source, key, 'this torch has no flex attention; use "auto"')
    return chosen


def _fail(source: str, key: str, message: str) -> NoReturn:
    raise ConfigError.at(source, key, message)
