"""Target families: what differs between the decoder-only models a drafter is trained for, in one place.

``family_of(hf_config)`` gives a :class:`~dflash_ipc.families.base.DecoderFamily` whose readers tell the
rest of dflash-ipc each layer's attention (window, chunks, sinks, soft-cap, position-scaled queries, head
sizes), the MoE experts, the effective embedding and LM head, the attention implementations transformers
supports for it, the modules the fused kernels may replace, where a decoder layer's hidden state is, and
which packed kernels reproduce it exactly. Read by the target (packed attention, capture, fusion, FLOPs),
the drafter (frozen embedding and head), eval, and the preflight.

Adding a family (docs/DESIGN.md walks through it): a row in :mod:`~dflash_ipc.families.registry`, a module
here only where the generic readers of :mod:`~dflash_ipc.families.base` misread its config, and a row in the
family matrix (tests/families/zoo.py) that builds a tiny checkpoint of it.

A leaf package: it imports only :mod:`~dflash_ipc.target_spec` (and torch/transformers lazily).
"""

from dflash_ipc.families.base import PACKED_KERNELS, DecoderFamily
from dflash_ipc.families.registry import FAMILIES, family_of
from dflash_ipc.families.traits import AttentionLayer, ExpertLayout, FrozenHead, FusibleModules

__all__ = ["FAMILIES", "PACKED_KERNELS", "AttentionLayer", "DecoderFamily", "ExpertLayout", "FrozenHead", "FusibleModules", "family_of"]
