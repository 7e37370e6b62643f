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

ROOT = Path(__file__).resolve().parents[1]
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


def _pvalue(observed: torch.Tensor, expected: torch.Tensor, df_lost: int) -> float:
    """Pearson's statistic over the cells, cells with an expected count under 5 pooled into one (by
    column: every row of a column pooled together); its chi-square upper tail."""
    small = (expected < 5).any(0)
    if small.any():
        observed = torch.cat([observed[:, ~small], observed[:, small].sum(1, keepdim=True)], 1)
        expected = torch.cat([expected[:, ~small], expected[:, small].sum(1, keepdim=True)], 1)
    stat = float(((observed - expected) ** 2 / expected).sum())
    df = observed.numel() - df_lost
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


def chi2_pvalue(table: list[list[int]]) -> float:
    """Homogeneity: the rows of a count table come from one distribution (df = (rows-1)(cols-1))."""
    t = torch.tensor(table, dtype=torch.float64)
    t = t[:, t.sum(0) > 0]
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    small = (expected < 5).any(0)
    cols = int((~small).sum()) + int(bool(small.any()))
    return _pvalue(t, expected, df_lost=t.shape[0] + cols - 1)


def gof_pvalue(counts: Counter, probs: torch.Tensor) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (df = cells - 1)."""
    n = sum(counts.values())
    observed = torch.tensor([[counts.get(v, 0) for v in range(len(probs))]], dtype=torch.float64)
    return _pvalue(observed, probs.double()[None] * n, df_lost=1)


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
    first, second = _step_tokens(SpecSampler, 20000)
    assert gof_pvalue(first, P[0]) > ALPHA
    assert gof_pvalue(second, P[1]) > ALPHA  # the position-2 target distribution, drafts of position 1 accepted
    for wrong in (ResampleFromP, AcceptAll):
        bad_first, _ = _step_tokens(wrong, 20000)
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
    from dflash_ipc.drafter.model import DFlashDrafter, DrafterModelConfig
    from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
    from dflash_ipc.target.heads import target_head_weights
    from dflash_ipc.target.hf_config import load_hf_config, resolve_layer_ids

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
    """Tokens 2 and 3 of n seeded runs (token 1 is the prefill's; 2 and 3 come from the first steps)."""
    seconds, thirds, accepted, own = Counter(), Counter(), 0, {}
    for i in range(n):
        s = sampler_cls(temperature, top_p, 10_000 + i, "cpu")
        if speculative:
            res = speculative_generate(target, _CloseFirstDraft(target, drafter, prompt, own), prompt, 3, set(), 3, None, s)
            accepted += res.steps[0].accepted > 0
        else:
            res = greedy_generate(target, prompt, 3, set(), s)
        seconds[res.tokens[1]] += 1
        thirds[res.tokens[2]] += 1
    return seconds, thirds, accepted / n


# The negative control runs where the wrong rule's output is furthest from p in total variation
# (0.12 at T = 0.6, computed exactly from this target's distributions over the 40 likeliest first
# tokens; 0.08-0.09 at T = 1 or with top-p 0.9, spread over too many tokens for 1,500 runs to see).
@pytest.mark.parametrize(("temperature", "top_p", "control"), [(0.6, 1.0, True), (0.7, 0.9, False)])
def test_speculative_sampling_matches_plain_sampling_on_a_real_target(llama_target, temperature, top_p, control):
    target, drafter, prompt = llama_target
    n = 1500
    plain2, plain3, _ = _first_tokens(target, drafter, prompt, SpecSampler, n, temperature, top_p, speculative=False)
    spec2, spec3, acc = _first_tokens(target, drafter, prompt, SpecSampler, n, temperature, top_p, speculative=True)
    assert 0.2 < acc < 0.95  # both branches of the rule ran many times
    vocab = sorted(set(plain2) | set(spec2) | set(plain3) | set(spec3))
    for plain, spec in ((plain2, spec2), (plain3, spec3)):
        assert chi2_pvalue([[plain[v] for v in vocab], [spec[v] for v in vocab]]) > ALPHA
    if control:
        wrong2, _, _ = _first_tokens(target, drafter, prompt, ResampleFromP, n, temperature, top_p, speculative=True)
        assert chi2_pvalue([[plain2[v] for v in vocab], [wrong2[v] for v in vocab]]) < ALPHA


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
