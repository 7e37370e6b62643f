"""The frozen target model: build it, run it, and capture the hidden states DFlash trains on.

* :func:`build_target` loads a local Hugging Face checkpoint (straight to the device, in the
  configured dtype) or builds a random-weight Qwen3.5-family stack from ``TargetConfig.spec``.
  Only the decoder stack is kept (no LM head, no logits); layers after the last captured one
  are never allocated (random build) or dropped after loading (checkpoint), unless
  ``capture_last_hidden`` needs the whole stack.
* :meth:`TargetModel.capture` runs one right-padded batch under ``torch.inference_mode`` and
  returns the outputs of the chosen decoder layers (layer id ``i`` = output of decoder layer
  ``i``, i.e. ``hidden_states[i + 1]`` of HF's ``output_hidden_states``), stopping the forward
  right after the last captured layer.

Around it: :mod:`~dflash_ipc.target_spec.hf_config` (specs, configs, layer ids),
:mod:`~dflash_ipc.target_spec.heads` (the frozen embedding / LM head for the drafter, without building
the target), :mod:`~dflash_ipc.target.fast_path` (fast kernels or slow fallbacks?) and
:mod:`~dflash_ipc.target.flops` (FLOPs of the forward actually run, for MFU).

With ``varlen`` (config ``target.varlen``), :meth:`TargetModel.capture_packed` runs the batch's
documents back to back in one row instead, no padding computed; :mod:`~dflash_ipc.target.varlen`
says how each layer type keeps the documents apart.

Right padding needs no attention mask: every layer of the stack is causal (full attention) or
a causal recurrence / causal conv (GatedDeltaNet), so a real token never sees the pad tokens
that follow it; the packer strips the pad positions afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dflash_ipc.config import TargetConfig
from dflash_ipc.families import family_of
from dflash_ipc.platform.devices import as_device, cuda_device, dtype_from_name
from dflash_ipc.target.flops import ForwardFlops
from dflash_ipc.target.fp8 import fp8_device_problem, input_quantizer, quantize_linears
from dflash_ipc.target.fp8_experts import quantize_experts
from dflash_ipc.target.fp8_merge import merge_sibling_linears
from dflash_ipc.target.fused import fuse_elementwise, wants_fused_elementwise
from dflash_ipc.target.packed_attention import PackedRow, packed_attention, register_packed_attention, varlen_kernel_usable
from dflash_ipc.target.varlen import (
    PackedDocs,
    attention_modules,
    fla_packed_conv,
    install_document_reset,
    resolve_varlen,
    uses_packed_attention,
)
from dflash_ipc.target_spec.heads import derived_seed, target_head_weights
from dflash_ipc.target_spec.hf_config import make_hf_config, resolve_layer_ids, text_config, truncated_spec_config

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- building


class _StopForward(Exception):
    """Raised by the last capture hook: nothing after the last captured layer is computed."""


def find_decoder_stack(model: nn.Module) -> nn.Module:
    """The decoder stack (a module with ``.layers`` and input embeddings) inside a causal LM."""
    for path in ("model.language_model", "language_model", "model", "transformer", ""):
        mod = model
        ok = True
        for part in filter(None, path.split(".")):
            mod = getattr(mod, part, None)
            if mod is None:
                ok = False
                break
        if ok and isinstance(getattr(mod, "layers", None), nn.ModuleList):
            return mod
    for _, mod in model.named_modules():
        if isinstance(getattr(mod, "layers", None), nn.ModuleList) and hasattr(mod, "get_input_embeddings"):
            return mod
    raise ValueError(f"cannot find a decoder stack with .layers in {type(model).__name__}")


@torch.no_grad()
def _deterministic_init(stack: nn.Module, seed: int, std: float) -> None:
    """Re-draw every random parameter from its own generator seeded by (seed, parameter name):
    identical weights whatever the build depth (truncated or full) or construction order."""
    for name, p in stack.named_parameters():
        if name.startswith("embed_tokens."):
            continue  # set from target_head_weights
        gen = torch.Generator(device=p.device)
        gen.manual_seed(derived_seed(seed, name))
        if name.endswith("A_log"):
            tmp = torch.empty(p.shape, device=p.device, dtype=torch.float32).uniform_(0.01, 16.0, generator=gen)
            p.copy_(tmp.log_())
        elif p.dim() >= 2:
            tmp = torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, std, generator=gen)
            p.copy_(tmp)
        # 1-D parameters (norm weights, dt_bias, biases) keep their constant HF init


def build_target(cfg: TargetConfig, device, vocab_size: int | None = None) -> TargetModel:
    """Build the frozen target on ``device`` (checkpoint or random spec); see the module docstring."""
    device = as_device(device)
    dtype = dtype_from_name(cfg.dtype)
    if cfg.model_path:
        return _build_from_checkpoint(cfg, device, dtype)
    hf_config = make_hf_config(cfg.spec, vocab_size)
    attention = family_of(hf_config).attention_implementation(cfg.attn_implementation)
    hf_config._attn_implementation = attention
    n_layers = int(hf_config.num_hidden_layers)
    layer_ids = resolve_layer_ids(cfg, n_layers)
    n_build = n_layers if cfg.capture_last_hidden else max(layer_ids) + 1
    build_conf = hf_config if n_build == n_layers else truncated_spec_config(hf_config, n_build)
    build_conf.use_cache = False

    from transformers import Qwen3_5TextModel

    with torch.device(device):
        stack = Qwen3_5TextModel._from_config(build_conf, dtype=dtype, attn_implementation=attention)
    stack.to(device)
    _deterministic_init(stack, cfg.random_init_seed, float(getattr(hf_config, "initializer_range", 0.02)))
    embed, _ = target_head_weights(cfg, hf_config, device, dtype)
    with torch.no_grad():
        stack.embed_tokens.weight.copy_(embed)
    del embed
    return _target_model(cfg, stack, hf_config, layer_ids, device, dtype, attention)


def target_from_stack(cfg: TargetConfig, stack: nn.Module, hf_config: Any, device) -> TargetModel:
    """A decoder stack built elsewhere (a benchmark's random-weight model at a published shape) as the target of
    ``cfg``: its capture layers, precision levers and packed forward as :func:`build_target` would set them."""
    device = as_device(device)
    attention = family_of(hf_config).attention_implementation(cfg.attn_implementation)
    if getattr(stack, "config", None) is not None:
        stack.config.use_cache = False
    return _target_model(cfg, stack, hf_config, resolve_layer_ids(cfg, len(stack.layers)), device, dtype_from_name(cfg.dtype), attention)


def _target_model(cfg: TargetConfig, stack: nn.Module, hf_config: Any, layer_ids: list[int], device, dtype, attention: str) -> TargetModel:
    compile_kernels = wants_fused_elementwise(cfg.fuse_elementwise, device)
    if cfg.quantization == "fp8":
        apply_fp8(stack, device, dtype, compile_quantizer=compile_kernels)
    fused = fuse_elementwise(stack) if compile_kernels else None
    if fused is not None and not any(fused.values()):  # a family fused.py has no kernels for (e.g. Llama): eager
        fused = None
    return TargetModel(
        stack,
        hf_config,
        layer_ids,
        device,
        dtype,
        capture_last_hidden=cfg.capture_last_hidden,
        varlen=cfg.varlen,
        attn_implementation=attention,
        fused_elementwise=fused,
    )


def apply_fp8(stack: nn.Module, device, dtype: torch.dtype, compile_quantizer: bool) -> None:
    """``target.quantization = "fp8"``: the stack's linear layers in e4m3 (:mod:`~dflash_ipc.target.fp8`), an MoE's
    routed experts too (:mod:`~dflash_ipc.target.fp8_experts`), the siblings that project one input merged into one
    quantization and one GEMM (:mod:`~dflash_ipc.target.fp8_merge`).

    ``compile_quantizer``: the per-token input quantizer through ``torch.compile``. The target builder ties it
    to the elementwise fusion (``target.fuse_elementwise``), so an eager target compiles nothing; eval passes
    False for the reason it leaves the elementwise work unfused: it forwards a few tokens at a time in every
    worker process, where each process's compiles cost more than they save."""
    problem = fp8_device_problem(device, dtype)
    if problem:
        raise ValueError(f'target.quantization = "fp8": {problem}; set target.quantization = "none"')
    counts = quantize_linears(stack, compile_quantizer=compile_quantizer)
    log.info("target linear layers in FP8 e4m3: %d (%.2f GB), %d kept in %s", counts["fp8"], counts["bytes"] / 1e9, counts["kept"], dtype)
    experts = quantize_experts(stack, input_quantizer(compile_quantizer))
    if experts.fp8 or experts.kept:
        log.info("%s", experts.describe())
    merged = merge_sibling_linears(stack)
    log.info(
        "FP8 siblings merged: %d linears into %d GEMMs, %d input quantizations fewer per forward",
        merged["linears"],
        merged["groups"],
        merged["quantizations_saved"],
    )


def _build_from_checkpoint(cfg: TargetConfig, device: torch.device, dtype: torch.dtype) -> TargetModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.from_pretrained(cfg.model_path)
    attention = family_of(hf_config).attention_implementation(cfg.attn_implementation)
    kwargs: dict[str, Any] = {"dtype": dtype, "attn_implementation": attention}
    move_after = False
    if device.type != "cpu":
        if importlib.util.find_spec("accelerate") is not None:
            # weights go straight from the (memory-mapped) safetensors to the device
            kwargs["device_map"] = {"": str(cuda_device(device) if device.type == "cuda" else device)}
        else:  # transformers needs accelerate for device_map: load to host memory, then move
            log.warning("accelerate is not installed: loading %s through host memory (pip install accelerate)", cfg.model_path)
            move_after = True
    model = AutoModelForCausalLM.from_pretrained(cfg.model_path, **kwargs)
    stack = find_decoder_stack(model)
    del model  # drops the LM head (and any vision tower) with it
    n_layers = len(stack.layers)
    layer_ids = resolve_layer_ids(cfg, n_layers)
    if not cfg.capture_last_hidden and max(layer_ids) + 1 < n_layers:
        stack.layers = nn.ModuleList(list(stack.layers)[: max(layer_ids) + 1])
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if move_after:
        stack.to(device)
    if getattr(stack, "config", None) is not None:
        stack.config.use_cache = False
    return _target_model(cfg, stack, hf_config, layer_ids, device, dtype, attention)


# --------------------------------------------------------------------------- the model


class TargetModel:
    """A frozen decoder stack that returns the outputs of ``layer_ids`` for a right-padded batch."""

    def __init__(
        self,
        stack: nn.Module,
        hf_config: Any,
        layer_ids: Sequence[int],
        device,
        dtype: torch.dtype,
        capture_last_hidden: bool = False,
        varlen: bool | str = False,
        attn_implementation: str | None = None,
        fused_elementwise: dict[str, int] | None = None,
    ):
        self.stack = stack
        self.fused_elementwise = fused_elementwise or {}
        self.hf_config = hf_config
        self.layer_ids = list(layer_ids)
        self.device = as_device(device)
        self.dtype = dtype
        self.capture_last_hidden = bool(capture_last_hidden)
        if max(self.layer_ids) >= len(stack.layers):
            raise ValueError(f"layer id {max(self.layer_ids)} but only {len(stack.layers)} layers were built")
        stack.eval()
        stack.requires_grad_(False)
        self.attn_implementation = attn_implementation or str(getattr(text_config(hf_config), "_attn_implementation", None) or "sdpa")
        self.family = family_of(hf_config)
        self.varlen, self.varlen_reason = resolve_varlen(varlen, stack, self.attn_implementation, self.family)
        # after any weight init: the wrappers rename the GatedDeltaNet parameters (linear_attn.inner.*)
        self._mixers, self.linear_attention_kernels = install_document_reset(stack) if self.varlen else ([], False)
        # sdpa/eager over a packed row would attend across documents through a dense n x n mask
        self.packed_attention = self.varlen and uses_packed_attention(self.attn_implementation)
        if self.packed_attention:
            register_packed_attention()
            self._attention_layers = attention_modules(stack, self.family)

    @property
    def num_layers_built(self) -> int:
        return len(self.stack.layers)

    @property
    def num_layers_total(self) -> int:
        return int(text_config(self.hf_config).num_hidden_layers)

    @property
    def layers_run(self) -> int:
        """Decoder layers computed per forward (layers 0 .. layers_run-1)."""
        return self.num_layers_total if self.capture_last_hidden else max(self.layer_ids) + 1

    @property
    def hidden_size(self) -> int:
        return int(text_config(self.hf_config).hidden_size)

    @property
    def num_planes(self) -> int:
        return len(self.layer_ids) + (1 if self.capture_last_hidden else 0)

    def capture(self, input_ids: torch.Tensor, capture_last_hidden: bool | None = None) -> list[torch.Tensor]:
        """Run ``input_ids`` [B, L] (right-padded; no mask needed) and return the outputs of the
        decoder layers ``layer_ids`` as k tensors [B, L, H] (+ the final normed hidden state
        when capture_last_hidden). Pad positions hold garbage; the packer drops them."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, L] (got shape {tuple(input_ids.shape)})")
        return self._run_captured({"input_ids": input_ids.to(self.device)}, capture_last_hidden)

    def capture_packed(
        self, input_ids: torch.Tensor, seq_lens: Sequence[int], capture_last_hidden: bool | None = None
    ) -> list[torch.Tensor]:
        """Run the documents of ``input_ids`` (flat [n] or [1, n], back to back, lengths
        ``seq_lens``) as one packed row, no padding computed (see :mod:`~dflash_ipc.target.varlen`),
        and return the captured planes as [1, n, H] in the same order: the slot's layout."""
        kwargs, docs = self._packed_kwargs(input_ids, seq_lens)
        try:
            with self._packed_attention(docs):
                return self._run_captured(kwargs, capture_last_hidden)
        finally:
            for m in self._mixers:
                m.set_docs(None)

    def forward_bare(self, input_ids: torch.Tensor, seq_lens: Sequence[int] | None = None) -> None:
        """The whole built stack without hooks or capture (the benchmark's ceiling): packed when
        ``seq_lens`` is given, else the right-padded [B, L] batch."""
        kwargs, docs = ({"input_ids": input_ids.to(self.device)}, None) if seq_lens is None else self._packed_kwargs(input_ids, seq_lens)
        try:
            with torch.inference_mode(), self._packed_attention(docs):
                self.stack(**kwargs, use_cache=False)
        finally:
            for m in self._mixers:
                m.set_docs(None)

    def _packed_attention(self, docs: PackedDocs | None) -> contextlib.AbstractContextManager:
        """The attention layers of one forward over ``docs`` through the packed attention (a padded forward,
        ``docs`` None, or attention on transformers' own varlen path: unchanged)."""
        if docs is None or not self.packed_attention:
            return contextlib.nullcontext()
        row = PackedRow(layers=self._attention_layers, docs=docs, use_kernel=varlen_kernel_usable(self.device, self.dtype))
        return packed_attention(self.stack.config, row)

    def _packed_kwargs(self, input_ids: torch.Tensor, seq_lens: Sequence[int]) -> tuple[dict[str, Any], PackedDocs]:
        """Stack-forward kwargs for one packed row, and its documents; arms the GatedDeltaNet wrappers (the
        caller disarms them)."""
        if not self.varlen:
            raise ValueError("a packed forward needs a target built with varlen=True (config target.varlen)")
        ids = input_ids.reshape(1, -1) if input_ids.dim() == 1 else input_ids
        if ids.dim() != 2 or ids.shape[0] != 1:
            raise ValueError(f"packed input_ids must be [n] or [1, n] (got shape {tuple(input_ids.shape)})")
        lens = [int(x) for x in seq_lens]
        if sum(lens) != ids.shape[1]:
            raise ValueError(f"seq_lens sum to {sum(lens)} but the packed row has {ids.shape[1]} tokens")
        docs = PackedDocs.build(lens, self.device)
        padded_index = docs.padded_index() if any(not m.use_kernels for m in self._mixers) else None
        fla_conv = fla_packed_conv(docs) if any(m.conv == "fla" for m in self._mixers) else None
        kwargs = {"input_ids": ids.to(self.device, non_blocking=True), "position_ids": docs.position_ids}
        kwargs.update(docs.attention_kwargs(self.attn_implementation))  # cu_seqlens for flash / packed attention
        for m in self._mixers:
            m.set_docs(docs, padded_index, fla_conv)
        return kwargs, docs

    def _run_captured(self, forward_kwargs: dict[str, Any], capture_last_hidden: bool | None) -> list[torch.Tensor]:
        last = self.capture_last_hidden if capture_last_hidden is None else bool(capture_last_hidden)
        if last and self.num_layers_built < self.num_layers_total:
            raise ValueError("capture_last_hidden needs the full stack; build the target with capture_last_hidden=True")
        slots: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        stop_at = None if last else max(self.layer_ids)
        handles = []

        def make_hook(j: int, layer_id: int):
            def hook(module, args, output):
                slots[j] = self.family.captured(output)
                if layer_id == stop_at:
                    raise _StopForward

            return hook

        try:
            for j, li in enumerate(self.layer_ids):
                handles.append(self.stack.layers[li].register_forward_hook(make_hook(j, li)))
            out = None
            with torch.inference_mode():
                try:
                    out = self.stack(**forward_kwargs, use_cache=False)
                except _StopForward:
                    pass
        finally:
            for h in handles:
                h.remove()
            handles.clear()
        result: list[torch.Tensor] = []
        for j, t in enumerate(slots):
            if t is None:
                raise RuntimeError(f"decoder layer {self.layer_ids[j]} did not run")
            result.append(t)
        slots.clear()
        if last:
            lh = getattr(out, "last_hidden_state", None)
            result.append(lh if lh is not None else out[0])
        return result

    @functools.cached_property
    def flop_count(self) -> ForwardFlops:
        """The FLOP count of this target's forward (:mod:`~dflash_ipc.target.flops`), its layers counted once."""
        return ForwardFlops(self.hf_config)

    def forward_flops(self, seq_lens: Iterable[int]) -> float:
        return self.flop_count(self.layers_run, seq_lens)
