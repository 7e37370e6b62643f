"""Speculative sampling at T > 0 keeps the target's output distribution: statistical tests.

Each test fixes its seeds, so its outcome is reproducible; the significance is α = 0.001 per
chi-square test (a correct rule fails one such test with probability 0.001 over seeds). Every
check has a negative control: the same test on a deliberately wrong rule (a rejection resampled from
p instead of the residual max(0, p - q); every draft accepted) must reject it, so the tests have the
power to see the error they guard against.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import load_config
from dflash_ipc.data.tokenizer import load_tokenizer, mask_token_id
from dflash_ipc.eval.run import load_prompts, run_eval
from dflash_ipc.eval.sampling import SpecSampler, prompt_seed
from dflash_ipc.eval.spec import DrafterProposer, greedy_generate, speculative_generate

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"
ALPHA = 0.001


class ResampleFromP(SpecSampler):
    """Wrong: a rejected draft is replaced by a fresh sample of p (not of the residual)."""

    def residual(self, p, q):
        return p


class AcceptAll(SpecSampler):
    """Wrong: every draft is accepted."""

    def accept(self, drafts, q, p):
        return len(drafts)


def gof_pvalue(counts: Counter, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs``: Pearson's statistic over the possible cells (an
    observed impossible one gives 0), those expected under 5 times pooled into one; its chi-square
    upper tail (df = cells - 1)."""
    n = sum(counts.values())
    probs = probs.double()
    observed = torch.tensor([counts.get(v, 0) for v in range(len(probs))], dtype=torch.float64)
    if observed[probs == 0].sum() > 0:
        return 0.0
    observed, expected = observed[probs > 0], probs[probs > 0] * n
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum(0, keepdim=True)])
        expected = torch.cat([expected[~small], expected[small].sum(0, keepdim=True)])
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.fixture(autouse=True)
def one_thread():
    # many tiny forwards: one thread is ~25x faster than torch's default pool on a shared CPU
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# --------------------------------------------------------------------------- the rule on fixed p and q


P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.05, 0.10, 0.20, 0.25, 0.35], [0.30, 0.20, 0.20, 0.10, 0.10, 0.10]])
Q = torch.tensor([[0.10, 0.10, 0.20, 0.30, 0.20, 0.10], [0.30, 0.30, 0.10, 0.10, 0.10, 0.10]])


def _step_tokens(cls, n: int, seed: int = 1234) -> tuple[Counter, Counter]:
    """First emitted token of n steps (drafts ~ Q), and the second one where the first was accepted."""
    s = cls(1.0, 1.0, seed, "cpu")
    first, second = Counter(), Counter()
    for _ in range(n):
        drafts = s.sample(Q).tolist()
        res = s.verify(drafts, Q, P.log())
        first[res.tokens[0]] += 1
        if res.accepted >= 1:
            second[res.tokens[1]] += 1
    return first, second


def test_the_rule_emits_the_target_distribution_and_the_test_sees_wrong_rules():
    first, second = _step_tokens(SpecSampler, 5000)
    assert gof_pvalue(first, P[0]) > ALPHA
    assert gof_pvalue(second, P[1]) > ALPHA  # the position-2 target distribution, drafts of position 1 accepted
    # far from p: a wrong rule's first token is off by a chi-square distance of 0.11 per step (ResampleFromP)
    # or 1.15 (AcceptAll), a noncentrality of 110 or 1,150 over 1,000 steps: rejected at p < 1e-17
    for wrong in (ResampleFromP, AcceptAll):
        bad_first, _ = _step_tokens(wrong, 1000)
        assert gof_pvalue(bad_first, P[0]) < ALPHA, wrong.__name__


def test_nucleus_is_applied_to_each_distribution():
    s = SpecSampler(1.0, 0.6, 0, "cpu")
    kept = s.probs(P.log())
    assert torch.allclose(kept[0], torch.tensor([0.40, 0.25, 0, 0, 0, 0]) / 0.65)  # 0.40 < 0.6, 0.65 >= 0.6
    assert torch.allclose(kept[1], torch.tensor([0, 0, 0, 0.20, 0.25, 0.35]) / 0.80)
    assert torch.allclose(SpecSampler(2.0, 1.0, 0, "cpu").probs(P.log()), torch.softmax(P.log() / 2, -1))
    with pytest.raises(ValueError, match="T = 0 is the greedy path"):
        SpecSampler(0.0, 1.0, 0, "cpu")
    assert prompt_seed(0, (0, 1, 0)) != prompt_seed(0, (1, 0, 0)) and prompt_seed(3, (2, 5)) == prompt_seed(3, (2, 5))


# --------------------------------------------------------------------------- real decoding against plain sampling


@pytest.fixture(scope="module")
def llama_target(tiny_llama):
    """The random 4-layer Llama checkpoint of conftest (attention only: cache crop) and a DFlash drafter for it."""
    from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
    from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
    from dflash_ipc.target_spec.heads import target_head_weights
    from dflash_ipc.target_spec.hf_config import load_hf_config, resolve_layer_ids

    d = tiny_llama
    cfg = load_config(TINY, {"target.model_path": str(d), "target.tokenizer": "builtin", "target.spec": {}, "data.builtin_samples": 20})
    tok = load_tokenizer(cfg.target.tokenizer)
    ids = resolve_layer_ids(cfg.target, 4)
    target = TargetLM(build_target_lm(cfg.target, "cpu", dtype="float32"), ids)
    hf = load_hf_config(cfg.target, vocab_size=len(tok))
    embed, head = target_head_weights(cfg.target, hf, "cpu", torch.float32)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterModelConfig.from_configs(cfg.drafter, hf, ids, mask_token_id(tok)), embed, head, attention="sdpa").eval()
    yield target, drafter, load_prompts(cfg, tok, None, 1)[0]
    target.close()


class _CloseFirstDraft:
    """q for block position 1 = the target's own next-token logits halved (a flatter neighbour of p:
    most first drafts are accepted, many are not), the later positions the DFlash drafter's. Any q
    keeps the output distribution; this one makes acceptance and rejection both frequent. The
    target's logits after ``prompt + [anchor]`` depend on the anchor alone: ``own`` keeps them
    across the seeded runs of one prompt (the same tensors a fresh forward gives)."""

    def __init__(self, target, drafter, prompt, own: dict[int, torch.Tensor]):
        self.target, self.drafter, self.prompt, self.own = target, DrafterProposer(drafter), list(prompt), own

    def logits(self, context, anchor, k):
        out = self.drafter.logits(context, anchor, k).float()
        if anchor not in self.own:
            logits, _ = self.target.forward_logits(self.prompt + [anchor], self.target.new_cache(), capture=False)
            self.own[anchor] = logits[-1].float() / 2
        out[0] = self.own[anchor]
        return out


def _first_tokens(target, drafter, prompt, sampler_cls, n: int, temperature: float, top_p: float, speculative: bool):
    """Tokens 1-3 of n seeded runs (token 1 is the prefill's; 2 and 3 come from the first steps),
    and the share of runs whose first draft was accepted."""
    runs, accepted, own = [], 0, {}
    for i in range(n):
        s = sampler_cls(temperature, top_p, 10_000 + i, "cpu")
        if speculative:
            res = speculative_generate(target, _CloseFirstDraft(target, drafter, prompt, own), prompt, 3, set(), 3, None, s)
            accepted += res.steps[0].accepted > 0
        else:
            res = greedy_generate(target, prompt, 3, set(), s)
        runs.append(tuple(res.tokens[:3]))
    return runs, accepted / n


@dataclass(frozen=True)
class ExactTokens:
    """The target's own sampling distribution of tokens 2 and 3 after ``prompt``, computed, not
    sampled: token 2's marginal over every token 1; token 3's over the likeliest (token 1, token 2)
    pairs holding ``COVER`` of the mass, the other pairs one cell of their own (``other``), so the
    cells still partition the outcomes and the expected counts are exact."""

    second: torch.Tensor  # [V]
    third: torch.Tensor  # [V + 1]: token 3 after a covered pair, then "the pair is not covered"
    covered: frozenset[tuple[int, int]]

    def third_cell(self, run: tuple[int, int, int]) -> int:
        return run[2] if run[:2] in self.covered else len(self.second)


COVER = 0.99


@torch.no_grad()
def exact_tokens(target, prompt: list[int], sampler: SpecSampler, chunk: int = 512) -> ExactTokens:
    """Batched full forwards of ``prompt + [t1]`` and ``prompt + [t1, t2]`` (no cache: another path
    than the decoding under test), each row's last logits through the sampler's own temperature and
    nucleus."""

    def last_probs(rows: list[list[int]]) -> torch.Tensor:
        parts = [sampler.probs(target.lm(input_ids=torch.tensor(rows[i : i + chunk])).logits[:, -1]) for i in range(0, len(rows), chunk)]
        return torch.cat(parts).double()

    p1 = last_probs([list(prompt)])[0]
    firsts = torch.nonzero(p1 > 0)[:, 0].tolist()
    joint = p1[firsts, None] * last_probs([[*prompt, t] for t in firsts])  # P(t1, t2), rows: firsts
    mass, order = joint.flatten().sort(descending=True)
    keep = int((mass.cumsum(0) < COVER).sum()) + 1
    pairs = [(firsts[int(i) // joint.shape[1]], int(i) % joint.shape[1]) for i in order[:keep]]
    third = (mass[:keep, None] * last_probs([[*prompt, a, b] for a, b in pairs])).sum(0)
    other = torch.tensor([1.0 - float(mass[:keep].sum())], dtype=torch.float64)
    return ExactTokens(joint.sum(0), torch.cat([third, other]), frozenset(pairs))


def assert_fits(runs, exact: ExactTokens, fits: bool = True) -> None:
    """Tokens 2 and 3 of ``runs`` against the exact distribution: a goodness-of-fit p-value above
    ALPHA for each (``fits``), or below it for token 2 (a wrong rule)."""
    second = gof_pvalue(Counter(r[1] for r in runs), exact.second)
    if not fits:
        assert second < ALPHA, second
        return
    third = gof_pvalue(Counter(exact.third_cell(r) for r in runs), exact.third)
    assert second > ALPHA and third > ALPHA, (second, third)


# Runs are tested against the target's exact distribution (goodness of fit: n runs have the power a
# two-sample test against plain sampling has with 2n runs on each side). One negative control, where
# the wrong rule's output is furthest from p in total variation (0.12 at T = 0.6, computed exactly
# from this target's distributions over the 40 likeliest first tokens): these 600 runs reject it at
# p = 5e-5, and 600 runs of other seeds about 96 times in 100 (400 runs: 75). The other case runs
# the plain sampler through the same test (temperature and nucleus).
@pytest.mark.parametrize(("temperature", "top_p", "control"), [(0.6, 1.0, True), (0.7, 0.9, False)])
def test_speculative_and_plain_sampling_emit_the_targets_exact_distribution(llama_target, temperature, top_p, control):
    target, drafter, prompt = llama_target
    n = 600
    exact = exact_tokens(target, prompt, SpecSampler(temperature, top_p, 0, "cpu"))
    spec, acc = _first_tokens(target, drafter, prompt, SpecSampler, n, temperature, top_p, speculative=True)
    assert 0.2 < acc < 0.95  # both branches of the rule ran many times
    assert_fits(spec, exact)
    if control:
        wrong, _ = _first_tokens(target, drafter, prompt, ResampleFromP, n, temperature, top_p, speculative=True)
        assert_fits(wrong, exact, fits=False)
    else:
        plain, _ = _first_tokens(target, drafter, prompt, SpecSampler, n // 2, temperature, top_p, speculative=False)
        assert_fits(plain, exact)


def test_eval_at_temperature_reports_tau_and_a_distributional_check(tmp_path):
    out = tmp_path / "untrained"
    assert CliRunner().invoke(main, ["export-untrained", "--config", str(TINY), "--out", str(out)]).exit_code == 0
    argv = ["eval", "--config", str(TINY), "--drafter", str(out), "--n", "2", "--max-new", "8", "--temperature", "1", "--top-p", "0.9"]
    r = CliRunner().invoke(main, [*argv, "--seed", "7", "--workers", "2", "--speed-prompts", "1", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["lossless"] is None and rep["lossless_check"].startswith("distributional at T=1")
    assert (rep["temperature"], rep["top_p"], rep["seed"]) == (1.0, 0.9, 7) and "plain sampling" in rep["baseline"]
    assert 1.0 <= rep["tau"] and rep["prompts"] == 2
    # each prompt's draws depend on the seed and its place only: one process gives the same run
    one = run_eval(
        load_config(TINY), str(out), n=2, max_new=8, temperature=1.0, top_p=0.9, seed=7, target_device="cpu", drafter_device="cpu"
    )
    assert one["tau_per_prompt"] == rep["tau_per_prompt"] and one["tokens"] == rep["tokens"]
    r = CliRunner().invoke(main, ["eval", "--config", str(TINY), "--drafter", str(out), "--n", "1", "--top-p", "0.9"])
    assert r.exit_code == 2 and "--top-p needs --temperature > 0" in r.output
