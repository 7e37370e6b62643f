"""Speculative *sampling* at temperature T > 0: the rule that keeps the target's output distribution.

One verification step, block ``[anchor, x_1 .. x_k]`` (k = B - 1)::

    q_s = nucleus(softmax(drafter logits at block position s / T), top_p)   s = 1..k, one drafter forward
    x_s ~ q_s                                                               the drafts, sampled
    p_s = nucleus(softmax(target logits after block position s-1 / T), top_p)   one target forward
    for s = 1..k:  accept x_s with probability min(1, p_s(x_s) / q_s(x_s))  (u_s * q_s(x_s) < p_s(x_s))
                   on the first rejection: emit y ~ normalise(max(0, p_s - q_s)), stop
    all accepted:  emit the bonus y ~ p_{k+1}

Each emitted token is distributed as the target's own sampling would draw it (Leviathan et al.
2023, Chen et al. 2023): the DFlash drafter proposes all k positions in one forward from
``[anchor, MASK ...]``, so q_s depends on the context only, never on the other drafts, and the
per-position argument holds as for a chain of draft-model samples. ``lossless`` at T > 0 is this
distributional statement, checked statistically (tests/eval/test_eval_sampling.py), not a token-exact
comparison.

Top-p is applied the same way to p and to q (each its own nucleus: the smallest set of most likely
tokens whose mass reaches ``top_p``, renormalised), as vLLM and SGLang apply the request's sampling
parameters to the target and draft distributions; the rule is exact for any q, so the choice only
moves acceptance, never the output distribution. Ties in the sort are broken by token id.

One :class:`SpecSampler` per decoded prompt, seeded: its generator lives on the target's device and
all draws of a prompt come from it, so a run is reproducible for a given seed and device.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from dflash_ipc.eval.verify import StepResult, finish_step

__all__ = ["SpecSampler", "prompt_seed"]


def prompt_seed(seed: int, key: Sequence[int]) -> int:
    """A generator seed for one decoded prompt, by its place (set, prompt, turn) only, so the draws do
    not depend on which worker decodes it."""
    h = seed & 0xFFFFFFFF
    for k in key:
        h = (h * 1_000_003 + int(k) + 1) % (1 << 61)
    return h


class SpecSampler:
    """Temperature / top-p sampling and the speculative-sampling verification of one prompt."""

    def __init__(self, temperature: float, top_p: float, seed: int, device):
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0 for sampling (T = 0 is the greedy path), got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, V]`` logits -> the sampling distributions (float32, on the sampler's device)."""
        p = torch.softmax(logits.to(self.device, torch.float32) / self.temperature, dim=-1)
        if self.top_p >= 1:
            return p
        sorted_p, order = torch.sort(p, dim=-1, descending=True, stable=True)
        # keep a token while the mass before it is below top_p (the first token always stays)
        drop = (torch.cumsum(sorted_p, dim=-1) - sorted_p) >= self.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        p = torch.zeros_like(p).scatter_(-1, order, sorted_p)
        return p / p.sum(-1, keepdim=True)

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row of ``[n, V]`` probabilities."""
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]

    def next_token(self, logits: torch.Tensor) -> int:
        """A token sampled after the last row of ``[n, V]`` logits (plain sampling, the prefill)."""
        return int(self.sample(self.probs(logits[-1:]))[0])

    def draft(self, drafter_logits: torch.Tensor | None) -> tuple[list[int], torch.Tensor | None]:
        """The drafts sampled from the drafter's ``[k, V]`` logits, and their distributions q."""
        if drafter_logits is None or drafter_logits.shape[0] == 0:
            return [], None
        q = self.probs(drafter_logits)
        return self.sample(q).tolist(), q

    def residual(self, p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """What a rejection samples from: normalise(max(0, p - q)) (p itself where p <= q everywhere,
        which only float rounding can produce after a rejection)."""
        r = (p - q).clamp_min(0.0)
        total = r.sum()
        return r / total if total > 0 else p

    def accept(self, drafts: list[int], q: torch.Tensor, p: torch.Tensor) -> int:
        """How many drafts the rule accepts: u_s * q_s(x_s) < p_s(x_s), the first failure ends it."""
        idx = torch.tensor(drafts, device=self.device)[:, None]
        px, qx = p[: len(drafts)].gather(1, idx)[:, 0], q.gather(1, idx)[:, 0]
        u = torch.rand(len(drafts), generator=self.generator, device=self.device)
        ok = (u * qx < px).int()
        return int(torch.cumprod(ok, 0).sum())

    def verify(
        self,
        drafts: list[int],
        q: torch.Tensor | None,
        target_logits: torch.Tensor,
        stop_ids: Collection[int] = (),
        remaining: int | None = None,
    ) -> StepResult:
        """One verification step by speculative sampling (the module docstring); ``target_logits``:
        ``[k + 1, V]``, the target's logits after each block position."""
        if target_logits.shape[0] != len(drafts) + 1:
            raise ValueError(f"need target logits per block position: {len(drafts)} drafts, {target_logits.shape[0]} rows")
        p = self.probs(target_logits)
        accepted = self.accept(drafts, q, p) if drafts else 0
        last = p[accepted] if accepted == len(drafts) else self.residual(p[accepted], q[accepted])
        return finish_step(drafts, accepted, int(self.sample(last[None])[0]), stop_ids, remaining)
