"""``[target]``: the frozen target model, what it captures for the drafter, and how it runs.

``target.quantization`` says which precision its linear layers and an MoE's routed experts run in. ``"none"``:
the target's dtype throughout. ``"fp8"``: e4m3 weights and activations with per-row and per-token scales
(:mod:`dflash_ipc.target.fp8`, :mod:`dflash_ipc.target.fp8_experts`); its GEMMs write bf16, so the target's dtype
must be bfloat16.
Whether the devices can run it (CUDA, compute capability >= 8.9) is checked against the machine by
the preflight (:mod:`dflash_ipc.runtime.preflight`), still before any process starts, as are the
model directory, ``spec`` and the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from dflash_ipc.config.fields import MAX_SEED, require

__all__ = ["Quantization", "TargetConfig", "check_target_quantization"]

Quantization = Literal["none", "fp8"]


def check_target_quantization(quantization: str, dtype: str) -> None:
    """The combinations of ``target.quantization`` and ``target.dtype`` that can run."""
    require(
        quantization == "none" or dtype == "bfloat16",
        "quantization",
        f'"{quantization}" writes its GEMMs in bf16: set target.dtype = "bfloat16" (got "{dtype}") or target.quantization = "none"',
    )


@dataclass
class TargetConfig:
    model_path: str = ""
    """A Hugging Face checkpoint directory (config.json + safetensors); empty: a random-weight model built from
    ``spec``."""
    spec: dict[str, Any] = field(default_factory=dict)
    """Qwen3_5TextConfig fields of a random-weight target (only when ``model_path`` is empty); every key and value
    is checked against that config class."""
    tokenizer: str = ""
    """Tokenizer directory; "builtin": the offline byte-level tokenizer with a chat template; empty: the model's own
    (``model_path``) when a checkpoint is set, else "builtin"."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The target's weights and activations (and so the captured hidden states)."""
    layer_ids: list[int] = field(default_factory=list)
    """Decoder layers whose outputs are captured for the drafter, strictly ascending; empty: the DFlash default
    spread of ``num_capture_layers`` layers from 1 to L-3."""
    num_capture_layers: int = 5
    """How many layers the default spread captures (when ``layer_ids`` is empty)."""
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2", "flex_attention"] = "auto"
    """The target's attention kernels (transformers' ``attn_implementation``). "auto": sdpa where transformers
    supports it for the target's family, else eager (gpt-oss); a named one the family lacks is refused."""
    capture_last_hidden: bool = False
    """Also ship the target's final (normed) hidden state, needed by ``training.kl_weight`` > 0."""
    async_pack: bool = True
    """Pack captured planes into the ring slot on a side stream/thread while the next forward runs."""
    random_init_seed: int = 1234
    """Seed of a random-weight target's weights (``spec``): every target process builds the same model."""
    varlen: bool | Literal["auto"] = "auto"
    """Each batch's documents back to back in one row, no padding computed. "auto": packed wherever varlen kernels
    run it (flash/flex or sdpa's varlen_attn on CUDA; fla for GatedDeltaNet); true / false force it."""
    quantization: Quantization = "none"
    """Precision of the linear layers and an MoE's routed experts: "none" (``dtype``) or "fp8" (e4m3, needs bfloat16
    and a CUDA GPU of compute capability >= 8.9; the target logs the experts modules that stay in ``dtype``)."""
    fuse_elementwise: bool | Literal["auto"] = "auto"
    """Norms and SwiGLU (and an FP8 down projection's quantizer) as torch.compile'd fused kernels, for the families
    that name them (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; others stay eager). "auto": on CUDA, where Triton compiles
    them; true / false force it."""

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
        seed = self.random_init_seed
        require(0 <= seed <= MAX_SEED, "random_init_seed", f"must be in [0, 2**32 - 1] (got {seed}): torch's seeds are unsigned")
