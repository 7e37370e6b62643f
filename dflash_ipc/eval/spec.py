"""Greedy DFlash speculative decoding and the ``dflash-ipc eval`` report.

One prompt (:func:`speculative_generate`)::

    prefill: target(prompt) -> first token (the anchor), features of the prompt = drafter context
    loop until a stop token or max_new tokens:
        drafts   = drafter(context features, [anchor, MASK x (B-1)])      one drafter forward
        greedy   = target([anchor, drafts...]) on its KV cache             one verification step
        accepted = longest prefix with draft == greedy, + bonus token      (verify.verify_block)
        cache    : keep anchor + accepted drafts (crop, or snapshot + re-run for recurrent caches)
        context += the kept positions' features from the verification forward
        anchor   = last emitted token

τ = tokens emitted by verification steps / verification steps (the prefill's first token is
not a step). Plain greedy decoding (:func:`greedy_generate`) runs the same target on the same
cache type one token per forward; ``lossless`` means every prompt's speculative output equals
it token for token, and where one does not, :func:`first_divergence` says where and by how wide a
logit gap the target preferred greedy's token there. At temperature > 0 both take a :class:`~dflash_ipc.eval.sampling.SpecSampler`:
the drafts are sampled from the drafter's distributions and verified by speculative sampling, the
baseline is plain sampling, and losslessness is distributional (see that module).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dflash_ipc.drafter.loss.blocks import build_block_layout
from dflash_ipc.drafter.loss.masks import build_attention_masks
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter
from dflash_ipc.eval.sampling import SpecSampler
from dflash_ipc.eval.target_lm import TargetLM
from dflash_ipc.eval.verify import StepResult, verify_block

__all__ = ["DrafterProposer", "GenResult", "first_divergence", "greedy_generate", "speculative_generate", "summarize"]

# (context features [n, k*H], anchor token, number of drafts) -> draft tokens
Proposer = Callable[[torch.Tensor, int, int], list[int]]


class DrafterProposer:
    """Drafts from an exported DFlash drafter: one forward over [anchor, MASK...] on the context.

    One instance per prompt: the context only grows (the verified tokens' features are appended),
    so each context row's keys and values are computed once (``DFlashDrafter.context_kv``) and
    kept, instead of projecting the whole context again every step."""

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.device = drafter.device
        self._kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._rows = 0

    def __call__(self, context: torch.Tensor, anchor: int, num_drafts: int) -> list[int]:
        return self.logits(context, anchor, num_drafts).float().argmax(-1).tolist()

    @torch.no_grad()
    def logits(self, context: torch.Tensor, anchor: int, num_drafts: int) -> torch.Tensor:
        """The drafter's logits ``[num_drafts, V]`` at block positions 1..num_drafts."""
        d = self.drafter
        n, bs = context.shape[0], num_drafts + 1
        dev = self.device
        if n < self._rows:
            raise ValueError(f"the context shrank ({self._rows} -> {n} rows): use one DrafterProposer per prompt")
        if n > self._rows:
            new = d.context_kv(context[self._rows :].to(dev), torch.arange(self._rows, n, device=dev))
            self._kv = new if not self._kv else [(torch.cat([k, k2], 2), torch.cat([v, v2], 2)) for (k, v), (k2, v2) in zip(self._kv, new)]
            self._rows = n
        layout = build_block_layout(torch.tensor([n], device=dev), torch.tensor([n], device=dev), torch.tensor([0], device=dev), bs, n=n)
        masks = build_attention_masks(layout, d.config.layer_types, d.config.sliding_window, "sdpa")
        ids = torch.full((1, bs), d.config.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = anchor
        hidden = d.forward_blocks(self._kv, ids, layout.block_position_ids, masks)
        return d.compute_logits(hidden[1:])


@dataclass
class GenResult:
    tokens: list[int]
    steps: list[StepResult] = field(default_factory=list)
    seconds: float = 0.0
    target_forwards: int = 0
    divergence: dict | None = None  # speculative output that left greedy's: where, and how close a tie (first_divergence)

    @property
    def tau(self) -> float:
        return sum(len(s.tokens) for s in self.steps) / len(self.steps) if self.steps else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_generate(
    target: TargetLM, prompt: Sequence[int], max_new: int, stop_ids: set[int], sampler: SpecSampler | None = None
) -> GenResult:
    """Plain greedy decoding (with ``sampler``: plain sampling): one target forward per token on the KV cache."""
    _sync(target.device)
    t0 = time.perf_counter()
    cache = target.new_cache()
    out = [_next_token(target, list(prompt), cache, sampler)]
    forwards = 1
    while len(out) < max_new and out[-1] not in stop_ids:
        out.append(_next_token(target, [out[-1]], cache, sampler))
        forwards += 1
    _sync(target.device)
    return GenResult(tokens=out, seconds=time.perf_counter() - t0, target_forwards=forwards)


@torch.no_grad()
def first_divergence(target: TargetLM, prompt: Sequence[int], greedy: Sequence[int], spec: Sequence[int]) -> dict | None:
    """Where speculative output first left plain greedy decoding's, and how close to a tie the target was there.

    A target outside fp32 (bf16, an FP8 target's bf16 activations) does not compute a verification block of
    several tokens bit for bit as it computes one token at a time, so greedy decoding and its speculative
    twin may part at a position where the two best tokens are all but tied. The target forwards the prompt
    and greedy's tokens before that position once, on a fresh cache, and ``logit_gap`` is its logit of
    greedy's token minus its logit of the speculative one: a tie broken by rounding reads near zero, a bug
    in the decoder does not. None when the two agree; ``logit_gap`` None when one output ended there."""
    k = next((i for i, (a, b) in enumerate(zip(greedy, spec)) if a != b), min(len(greedy), len(spec)))
    if k == len(greedy) == len(spec):
        return None
    out: dict = {"token": k, "greedy": greedy[k] if k < len(greedy) else None, "spec": spec[k] if k < len(spec) else None}
    gap = None
    if out["greedy"] is not None and out["spec"] is not None:
        logits = target.forward_logits([*prompt, *greedy[:k]], target.new_cache(), capture=False)[0][-1].float()
        gap = round((logits[out["greedy"]] - logits[out["spec"]]).item(), 4)
    return out | {"logit_gap": gap}


def _next_token(target: TargetLM, ids: list[int], cache, sampler: SpecSampler | None) -> int:
    if sampler is None:
        return target.forward(ids, cache, capture=False)[0][-1]
    return sampler.next_token(target.forward_logits(ids, cache, capture=False)[0])


def speculative_generate(
    target: TargetLM,
    propose: Proposer,
    prompt: Sequence[int],
    max_new: int,
    stop_ids: set[int],
    block_size: int,
    context_device=None,
    sampler: SpecSampler | None = None,
) -> GenResult:
    """Speculative decoding of one prompt (see the module docstring): greedy, or with ``sampler``
    speculative sampling (:mod:`dflash_ipc.eval.sampling`; ``propose`` then needs ``.logits``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1 (got {block_size})")
    _sync(target.device)
    t0 = time.perf_counter()
    cache = target.new_cache()
    if sampler is None:
        greedy, feats = target.forward(list(prompt), cache)
        out = [greedy[-1]]
    else:
        logits, feats = target.forward_logits(list(prompt), cache)
        out = [sampler.next_token(logits)]
    context = feats.to(context_device) if context_device is not None else feats
    steps: list[StepResult] = []
    forwards = 1
    while len(out) < max_new and out[-1] not in stop_ids:
        anchor = out[-1]
        if sampler is None:
            drafts = propose(context, anchor, block_size - 1) if block_size > 1 else []
        else:
            drafts, q = sampler.draft(propose.logits(context, anchor, block_size - 1) if block_size > 1 else None)
        block = [anchor] + [int(t) for t in drafts]
        snapshot = copy.deepcopy(cache) if target.rollback == "recompute" else None
        if sampler is None:
            greedy, feats = target.forward(block, cache)
            res = verify_block(drafts, greedy, stop_ids, remaining=max_new - len(out))
        else:
            logits, feats = target.forward_logits(block, cache)
            res = sampler.verify(drafts, q, logits, stop_ids, remaining=max_new - len(out))
        forwards += 1
        steps.append(res)
        out.extend(res.tokens)
        if res.stopped or len(out) >= max_new:
            break
        keep = res.kept_positions
        if keep < len(block):
            cache = target.roll_back(cache, snapshot, block[:keep], len(block) - keep)
            forwards += int(target.rollback == "recompute")
        context = torch.cat([context, feats[:keep].to(context.device)], dim=0)
    _sync(target.device)
    return GenResult(tokens=out, steps=steps, seconds=time.perf_counter() - t0, target_forwards=forwards)


def summarize(spec: list[GenResult], plain: list[GenResult], block_size: int) -> dict:
    """Pooled and per-prompt τ, acceptance per block position, speeds, losslessness."""
    steps = [s for r in spec for s in r.steps]
    produced = sum(len(s.tokens) for s in steps)
    accept = []
    for pos in range(1, block_size):
        accept.append(round(sum(s.accepted >= pos for s in steps) / len(steps), 4) if steps else 0.0)
    spec_tokens, plain_tokens = sum(len(r.tokens) for r in spec), sum(len(r.tokens) for r in plain)
    spec_s, plain_s = sum(r.seconds for r in spec), sum(r.seconds for r in plain)
    mismatches = [i for i, (a, b) in enumerate(zip(spec, plain)) if a.tokens != b.tokens]
    divergences = [{"prompt": i, **spec[i].divergence} for i in mismatches if spec[i].divergence is not None]
    gaps = [abs(d["logit_gap"]) for d in divergences if d["logit_gap"] is not None]
    spec_tps = spec_tokens / spec_s if spec_s > 0 else 0.0
    plain_tps = plain_tokens / plain_s if plain_s > 0 else 0.0
    return {
        "prompts": len(spec),
        "block_size": block_size,
        "tau": round(produced / len(steps), 4) if steps else 0.0,
        "tau_per_prompt": [round(r.tau, 4) for r in spec],
        "verify_steps": len(steps),
        "acceptance_per_position": accept,
        "tokens": spec_tokens,
        "target_forwards_spec": sum(r.target_forwards for r in spec),
        "target_forwards_greedy": sum(r.target_forwards for r in plain),
        "tokens_per_s_spec": round(spec_tps, 2),
        "tokens_per_s_greedy": round(plain_tps, 2),
        "speedup": round(spec_tps / plain_tps, 4) if plain_tps > 0 else 0.0,
        "lossless": not mismatches and len(spec) == len(plain),
        "mismatched_prompts": mismatches,
        "divergences": divergences,
        "max_logit_gap_at_divergence": max(gaps) if gaps else None,
    }
