"""The frozen target's description, read by every role: its transformers config, the captured layer ids,
and its embedding and LM-head weights.

A leaf: it imports only the config and device helpers, so ``data`` (tokenizer checks), ``target`` (builds
the model from it), ``drafter`` (mirrors its shape, reads its frozen heads), ``eval`` and ``runtime``
(preflight) share it without importing each other.
"""
