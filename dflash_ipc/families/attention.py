"""Which ``attn_implementation`` a target is loaded with: the one asked for, where its family supports it.

Every loader of the target (the training target, eval's and gen-data's causal LM, the serving check's) calls
:func:`choose_attention`, so one request resolves to one kernel everywhere and a kernel the family's
transformers class lacks (gpt-oss has no sdpa) is refused by its key, not met as a traceback while loading.
"""

from __future__ import annotations

from dflash_ipc.families.base import DecoderFamily

__all__ = ["AUTO", "choose_attention"]

#: Let the family decide: sdpa where transformers supports it for the family, else eager (always supported).
AUTO = "auto"


def choose_attention(family: DecoderFamily, requested: str) -> str:
    """The ``attn_implementation`` to load ``family``'s model with: ``requested`` when the family supports it,
    for ``"auto"`` sdpa if supported else eager; a named implementation the family lacks raises ValueError."""
    supported = family.attention_implementations()
    if requested == AUTO:
        return "sdpa" if "sdpa" in supported else "eager"
    if requested not in supported:
        raise ValueError(
            f"target.attn_implementation = {requested!r}: transformers has no {requested} attention for {family.name} "
            f"(supported: {', '.join(supported)}); set one of them, or {AUTO!r}"
        )
    return requested
