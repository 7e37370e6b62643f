"""``target.quantization``: which precision the frozen target's linear layers run in.

``"none"``: the target's dtype throughout. ``"fp8"``: e4m3 weights and activations with per-row
and per-token scales (:mod:`dflash_ipc.target.fp8`); its GEMMs write bf16, so the target's dtype
must be bfloat16. Whether the devices can run it (CUDA, compute capability >= 8.9) is checked
against the machine by the preflight (:mod:`dflash_ipc.runtime.preflight`), still before any
process starts.
"""

from __future__ import annotations

from typing import Literal

from dflash_ipc.config_fields import require

Quantization = Literal["none", "fp8"]


def check_target_quantization(quantization: str, dtype: str) -> None:
    """The combinations of ``target.quantization`` and ``target.dtype`` that can run."""
    require(
        quantization == "none" or dtype == "bfloat16",
        "quantization",
        f'"{quantization}" writes its GEMMs in bf16: set target.dtype = "bfloat16" (got "{dtype}") or target.quantization = "none"',
    )
