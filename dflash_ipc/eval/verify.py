"""Greedy verification of one draft block: the pure rule, no tensors, no model.

A verification step feeds the target the block ``[anchor, d_1, ..., d_{B-1}]`` (anchor = the
last verified token) and reads the target's greedy choice after every block position,
``t_0 .. t_{B-1}``. Draft ``d_s`` is accepted while every draft before it was accepted and
``d_s == t_{s-1}``; then the target's own choice after the last accepted position is the
*bonus* token. So a step emits ``accepted + 1`` tokens, all of them exactly what plain greedy
decoding would produce::

    drafts   d_1  d_2  d_3          (B = 4)
    target   t_0  t_1  t_2  t_3
    d_1 == t_0, d_2 == t_1, d_3 != t_2  ->  accepted 2, emitted [d_1, d_2, t_2]

The emitted tokens are cut after the first stop token (it is emitted, nothing after it) and
after ``remaining`` tokens (the generation budget).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["StepResult", "finish_step", "verify_block"]


@dataclass(frozen=True)
class StepResult:
    accepted: int  # drafts accepted (0 .. B-1), before any stop/budget cut
    tokens: tuple[int, ...]  # emitted: accepted drafts + bonus, cut at a stop token or the budget
    stopped: bool  # a stop token was emitted
    # Block positions whose target state stays valid: the anchor and the accepted drafts,
    # i.e. the first ``accepted + 1`` block positions (what the caches and the drafter keep).
    kept_positions: int


def verify_block(
    drafts: Sequence[int], target_argmax: Sequence[int], stop_ids: Collection[int] = (), remaining: int | None = None
) -> StepResult:
    """Accept the longest prefix of ``drafts`` that matches the target, then the bonus token.

    ``drafts``: ``B-1`` draft tokens (may be empty: block size 1). ``target_argmax``: the
    target's greedy token after each of the ``B`` block positions.
    """
    if len(target_argmax) != len(drafts) + 1:
        raise ValueError(f"need one target token per block position: {len(drafts)} drafts, {len(target_argmax)} target tokens")
    accepted = 0
    for d, t in zip(drafts, target_argmax):
        if int(d) != int(t):
            break
        accepted += 1
    return finish_step(drafts, accepted, int(target_argmax[accepted]), stop_ids, remaining)


def finish_step(
    drafts: Sequence[int], accepted: int, next_token: int, stop_ids: Collection[int] = (), remaining: int | None = None
) -> StepResult:
    """The step that accepted ``drafts[:accepted]`` and then emits ``next_token`` (the bonus or the
    correction, by whichever rule chose it): cut after a stop token and after ``remaining`` tokens."""
    if remaining is not None and remaining < 1:
        raise ValueError(f"remaining must be >= 1 (got {remaining})")
    if not 0 <= accepted <= len(drafts):
        raise ValueError(f"accepted must be in [0, {len(drafts)}] (got {accepted})")
    emitted = [int(x) for x in drafts[:accepted]] + [int(next_token)]
    stopped = False
    for i, tok in enumerate(emitted):
        if tok in stop_ids:
            emitted = emitted[: i + 1]
            stopped = True
            break
    if remaining is not None:
        emitted = emitted[:remaining]
    return StepResult(accepted=accepted, tokens=tuple(emitted), stopped=stopped and emitted[-1] in stop_ids, kept_positions=accepted + 1)
