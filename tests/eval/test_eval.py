"""Speculative-decoding eval: the verification rule on hand-made drafts, and real decoding with
the tiny random Qwen3.5 target (GatedDeltaNet: recompute rollback) and a tiny Llama checkpoint
(attention only: crop rollback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import load_config
from dflash_ipc.data.tokenizer import load_tokenizer, mask_token_id, stop_token_ids
from dflash_ipc.drafter.export.destination import EXPORT_MARKER
from dflash_ipc.drafter.export.layout import export_drafter
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
from dflash_ipc.eval.run import format_suite_table, load_prompts
from dflash_ipc.eval.spec import GenResult, first_divergence, greedy_generate, speculative_generate, summarize
from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
from dflash_ipc.eval.verify import verify_block
from dflash_ipc.target_spec.heads import target_head_weights
from dflash_ipc.target_spec.hf_config import load_hf_config, resolve_layer_ids, text_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"


# --------------------------------------------------------------------------- the pure rule


def test_verify_all_accepted_gives_block_plus_bonus():
    r = verify_block([5, 6, 7], [5, 6, 7, 8])
    assert (r.accepted, r.tokens, r.stopped, r.kept_positions) == (3, (5, 6, 7, 8), False, 4)


def test_verify_none_accepted_gives_the_targets_token():
    r = verify_block([9, 6, 7], [5, 6, 7, 8])
    assert (r.accepted, r.tokens, r.kept_positions) == (0, (5,), 1)


def test_verify_partial_stops_at_first_mismatch_even_if_later_drafts_match():
    r = verify_block([5, 1, 7], [5, 6, 7, 8])
    assert (r.accepted, r.tokens, r.kept_positions) == (1, (5, 6), 2)


def test_verify_stop_token_inside_block_ends_the_output():
    r = verify_block([5, 2, 7], [5, 2, 7, 8], stop_ids={2})
    assert (r.accepted, r.tokens, r.stopped) == (3, (5, 2), True)
    r = verify_block([5, 6], [5, 6, 2], stop_ids={2})  # the bonus token is the stop
    assert (r.tokens, r.stopped) == ((5, 6, 2), True)


def test_verify_budget_cut_and_block_size_one():
    assert verify_block([5, 6, 7], [5, 6, 7, 8], remaining=2).tokens == (5, 6)
    r = verify_block([], [4])
    assert (r.accepted, r.tokens, r.kept_positions) == (0, (4,), 1)
    with pytest.raises(ValueError, match="one target token per block position"):
        verify_block([1, 2], [1, 2])


# --------------------------------------------------------------------------- real decoding


def _drafter(cfg, tokenizer, out: Path, seed: int = 0) -> Path:
    hf = load_hf_config(cfg.target, vocab_size=len(tokenizer))
    ids = resolve_layer_ids(cfg.target, int(text_config(hf).num_hidden_layers))
    mcfg = DrafterModelConfig.from_configs(cfg.drafter, hf, ids, mask_token_id(tokenizer))
    embed, head = target_head_weights(cfg.target, hf, "cpu", torch.float32)
    torch.manual_seed(seed)
    return export_drafter(DFlashDrafter(mcfg, embed, head, attention="sdpa"), out)


class _Oracle:
    """Drafts the greedy continuation; ``corrupt_every`` > 0 spoils one draft per block
    (at a position that cycles), so blocks are partly accepted and caches roll back."""

    def __init__(self, prompt_len: int, greedy: list[int], corrupt_every: int = 0, vocab: int = 2):
        self.prompt_len, self.greedy, self.corrupt, self.vocab, self.calls = prompt_len, greedy, corrupt_every, vocab, 0

    def __call__(self, context, anchor, k):
        start = context.shape[0] - self.prompt_len + 1  # index in greedy of the first draft
        drafts = [self.greedy[start + i] if start + i < len(self.greedy) else 0 for i in range(k)]
        if self.corrupt:
            pos = self.calls % (k + 1)
            if pos < k:
                drafts[pos] = (drafts[pos] + 1) % self.vocab
        self.calls += 1
        return drafts


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config(TINY, {"data.builtin_samples": 40})
    tok = load_tokenizer(cfg.target.tokenizer)
    lm = build_target_lm(cfg.target, "cpu", vocab_size=len(tok), dtype="float32")
    ids = resolve_layer_ids(cfg.target, int(text_config(lm.config).num_hidden_layers))
    target = TargetLM(lm, ids)
    prompts = load_prompts(cfg, tok, None, 3)
    yield cfg, tok, target, prompts, stop_token_ids(tok)
    target.close()


def test_block_size_one_gives_tau_one(tiny):
    _, _, target, prompts, stops = tiny
    res = speculative_generate(target, lambda *a: pytest.fail("no drafts at block size 1"), prompts[0], 12, stops, 1)
    assert res.steps and all(len(s.tokens) == 1 for s in res.steps)
    assert res.tau == 1.0
    assert res.tokens == greedy_generate(target, prompts[0], 12, stops).tokens


def test_oracle_drafter_gives_tau_block_size_except_last_step(tiny):
    _, _, target, prompts, _ = tiny
    assert target.rollback == "recompute"  # Qwen3.5: GatedDeltaNet state cannot be cropped
    bs, max_new = 4, 1 + 4 * 5 + 2
    for p in prompts:
        plain = greedy_generate(target, p, max_new, set())
        res = speculative_generate(target, _Oracle(len(p), plain.tokens), p, max_new, set(), bs)
        assert res.tokens == plain.tokens
        assert [len(s.tokens) for s in res.steps] == [bs] * 5 + [2]


def test_partly_accepted_blocks_roll_back_and_stay_lossless(tiny):
    _, tok, target, prompts, stops = tiny
    for p in prompts:
        plain = greedy_generate(target, p, 30, stops)
        oracle = _Oracle(len(p), plain.tokens, corrupt_every=1, vocab=len(tok))
        res = speculative_generate(target, oracle, p, 30, stops, 5)
        assert res.tokens == plain.tokens
        assert any(0 < s.accepted < 4 for s in res.steps)


def test_eval_cli_untrained_drafter_is_lossless(tiny, tmp_path):
    cfg, tok, *_ = tiny
    d = _drafter(cfg, tok, tmp_path / "drafter")
    r = CliRunner().invoke(main, ["eval", "--config", str(TINY), "--drafter", str(d), "--n", "3", "--max-new", "16", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["lossless"] is True and rep["mismatched_prompts"] == []
    assert rep["prompts"] == 3 and len(rep["tau_per_prompt"]) == 3
    assert 1.0 <= rep["tau"] <= cfg.drafter.block_size
    assert len(rep["acceptance_per_position"]) == cfg.drafter.block_size - 1
    assert rep["dtype"] == "float32" and rep["cache_rollback"] == "recompute"


def test_eval_on_the_cpu_does_not_advise_installing_gpu_kernels(tiny, tmp_path, shared_forkserver):
    """transformers advises flash-linear-attention / causal-conv1d when its GatedDeltaNet fallback runs;
    both are CUDA kernels, so a CPU-only eval leaves that advice out. Another process: transformers
    says each warning once per process, so one said earlier in this one would hide the check. It is
    forked from the worker's shared fork server where there is one (its preload imported torch and
    transformers and ran no model, so it said nothing yet), else a new Python."""
    import subprocess
    import sys

    from dflash_ipc.runtime.forkserver import ForkServer
    from dflash_ipc.runtime.launch import child_env

    cfg, tok, *_ = tiny
    d = _drafter(cfg, tok, tmp_path / "drafter")
    argv = [sys.executable, "-m", "dflash_ipc.cli", "eval", "--config", str(TINY), "--drafter", str(d), "--n", "1", "--max-new", "8"]
    if shared_forkserver:
        server = ForkServer.connect(shared_forkserver, child_env())
        try:
            with open(tmp_path / "eval.out", "w") as out:
                code = server.popen(argv, env=child_env(), stdout=out, stderr=subprocess.STDOUT).wait(timeout=300)
        finally:
            server.close()
        output = (tmp_path / "eval.out").read_text()
    else:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
        code, output = r.returncode, r.stdout + r.stderr
    assert code == 0, output[-2000:]
    assert "tau" in output  # the eval ran through the target's GatedDeltaNet layers
    assert "falling back to its reference PyTorch implementation" not in output


def test_eval_cli_refuses_an_fp8_target_on_cpu_before_loading_it(tiny, tmp_path):
    cfg, tok, *_ = tiny
    d = _drafter(cfg, tok, tmp_path / "drafter")
    args = ["eval", "--config", str(TINY), "--drafter", str(d), "--n", "1", "--target-quantization", "fp8"]
    for dtype, why in (("bfloat16", "compute capability >= 8.9"), ("float32", "must be bfloat16")):
        r = CliRunner().invoke(main, [*args, "--dtype", dtype])
        assert r.exit_code == 2 and "target.quantization" in r.output and why in r.output, r.output
        assert "Traceback" not in r.output


def test_a_divergence_is_located_and_the_targets_logit_gap_there_measured(tiny):
    """Where speculative output leaves greedy's (a bf16 target's rounding, or a bug), eval says at which
    token and by how wide a logit gap the target preferred greedy's token there, from one forward of the
    prompt and greedy's tokens before it on a fresh cache: here a runner-up token planted at token 5."""
    _, _, target, prompts, _ = tiny
    prompt = prompts[0]
    greedy = greedy_generate(target, prompt, 10, set()).tokens
    logits = target.forward_logits([*prompt, *greedy[:5]], target.new_cache(), capture=False)[0][-1].float()
    runner_up = int(logits.topk(2).indices[1])
    assert int(logits.argmax()) == greedy[5]
    planted = [*greedy[:5], runner_up, *greedy[6:]]
    d = first_divergence(target, prompt, greedy, planted)
    assert d["token"] == 5 and d["greedy"] == greedy[5] and d["spec"] == runner_up
    assert d["logit_gap"] == round((logits[greedy[5]] - logits[runner_up]).item(), 4) and d["logit_gap"] >= 0
    assert first_divergence(target, prompt, greedy, greedy) is None
    ended = first_divergence(target, prompt, greedy, greedy[:7])  # the speculative output stopped early
    assert ended == {"token": 7, "greedy": greedy[7], "spec": None, "logit_gap": None}

    plain = [GenResult(tokens=greedy), GenResult(tokens=greedy), GenResult(tokens=greedy)]
    spec = [GenResult(tokens=greedy), GenResult(tokens=planted, divergence=d), GenResult(tokens=greedy[:7], divergence=ended)]
    rep = summarize(spec, plain, 4)
    assert rep["lossless"] is False and rep["mismatched_prompts"] == [1, 2]
    assert rep["divergences"] == [{"prompt": 1, **d}, {"prompt": 2, **ended}]
    assert rep["max_logit_gap_at_divergence"] == abs(d["logit_gap"])
    rep |= {"tokens_per_s_spec": 1.0, "tokens_per_s_greedy": 1.0, "speedup": 1.0, "speed_tau": 1.0, "speedup_at_set_tau": 1.0}
    assert f"NO (2 differ, logit gap <= {abs(d['logit_gap']):g})" in format_suite_table({"sets": {"planted": rep}})


def test_eval_cli_reports_where_a_speculative_output_diverged(tiny, tmp_path, monkeypatch):
    """A decoder fault stands in for bf16 rounding: the speculative output's third token replaced by
    another. eval exits 1, names the prompt, the token and the target's logit gap there (JSON and log)."""
    import dflash_ipc.eval.spec as spec_mod

    cfg, tok, *_ = tiny
    d = _drafter(cfg, tok, tmp_path / "drafter")
    real = spec_mod.speculative_generate

    def faulty(*args, **kwargs):
        res = real(*args, **kwargs)
        res.tokens[2] = (res.tokens[2] + 1) % len(tok)
        return res

    monkeypatch.setattr(spec_mod, "speculative_generate", faulty)
    r = CliRunner().invoke(main, ["eval", "--config", str(TINY), "--drafter", str(d), "--n", "2", "--max-new", "8", "--json"])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["lossless"] is False and rep["mismatched_prompts"] == [0, 1]
    assert [(x["prompt"], x["token"]) for x in rep["divergences"]] == [(0, 2), (1, 2)]
    assert all(x["logit_gap"] > 0 for x in rep["divergences"])  # fp32: greedy's token is the target's argmax there
    assert "DIFFERS from greedy at token 2, target logit gap" in r.output


def test_the_cpu_fp8_measurement_tool_evals_against_an_fp8_target(tiny, tmp_path):
    """tools/eval_fp8_cpu.py: eval's suite against the FP8 target with torch's CPU ``_scaled_mm`` for the GEMM
    (measurement only; the product itself refuses FP8 off CUDA, as the test above checks)."""
    import subprocess
    import sys

    cfg, tok, *_ = tiny
    d = _drafter(cfg, tok, tmp_path / "drafter")
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n" for i in range(2)))
    args = ["--config", str(TINY), "--drafter", str(d), "--suite", f"q={questions}", "--n", "2", "--max-new", "6"]
    proc = subprocess.run([sys.executable, "tools/eval_fp8_cpu.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "target linear layers in FP8 e4m3" in proc.stderr and "FP8 siblings merged" in proc.stderr
    rep = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rep["dtype"] == "bfloat16" and rep["sets"]["q"]["prompts"] == 2 and rep["sets"]["q"]["tau"] >= 1.0


def test_summary_counts_acceptance_per_position():
    from dflash_ipc.eval.spec import GenResult

    a = GenResult(tokens=[1, 2, 3, 4], steps=[verify_block([2, 3], [2, 3, 4]), verify_block([9, 9], [5, 6, 7])])
    rep = summarize([a], [GenResult(tokens=[1, 2, 3, 4])], 3)
    assert rep["tau"] == 2.0 and rep["acceptance_per_position"] == [0.5, 0.5] and rep["lossless"] is True


def test_llama_checkpoint_crops_its_cache_and_stays_lossless(tiny_llama):
    cfg = load_config(
        TINY, {"target.model_path": str(tiny_llama), "target.tokenizer": "builtin", "target.spec": {}, "data.builtin_samples": 20}
    )
    tok = load_tokenizer(cfg.target.tokenizer)
    lm = build_target_lm(cfg.target, "cpu", dtype="float32")
    target = TargetLM(lm, resolve_layer_ids(cfg.target, 4))
    try:
        assert target.rollback == "crop"
        for p in load_prompts(cfg, tok, None, 2):
            plain = greedy_generate(target, p, 25, set())
            res = speculative_generate(target, _Oracle(len(p), plain.tokens, corrupt_every=1, vocab=1024), p, 25, set(), 4)
            assert res.tokens == plain.tokens
            assert any(0 < s.accepted < 3 for s in res.steps)
    finally:
        target.close()


def test_export_untrained_matches_the_trained_layout_and_evals_lossless(tmp_path):
    cfg = load_config(TINY)
    out = tmp_path / "untrained"
    r = CliRunner().invoke(main, ["export-untrained", "--config", str(TINY), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "config.json", "model.safetensors", "modeling_dflash_ipc.py"]
    conf = json.loads((out / "config.json").read_text())
    assert conf["dflash_config"]["block_size"] == cfg.drafter.block_size
    assert conf["num_hidden_layers"] == cfg.drafter.num_layers
    r = CliRunner().invoke(main, ["eval", "--config", str(TINY), "--drafter", str(out), "--n", "2", "--max-new", "12", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert rep["lossless"] is True and rep["prompts"] == 2
    assert 1.0 <= rep["tau"] < 2.0  # a random drafter: the floor


def test_cached_context_keys_values_give_the_drafts_of_a_full_recompute(tiny, tmp_path):
    from dflash_ipc.drafter.export.layout import load_exported_drafter
    from dflash_ipc.drafter.loss.blocks import build_block_layout
    from dflash_ipc.drafter.loss.masks import build_attention_masks
    from dflash_ipc.eval.spec import DrafterProposer

    cfg, tok, target, prompts, stops = tiny
    hf = load_hf_config(cfg.target, vocab_size=len(tok))
    embed, head = target_head_weights(cfg.target, hf, "cpu", torch.float32)
    drafter = load_exported_drafter(_drafter(cfg, tok, tmp_path / "d", seed=3), embed, head, attention="sdpa", device="cpu").eval()
    bs = drafter.config.block_size

    def full(context, anchor):  # every step projects the whole context again (the decoder before the cache)
        n = context.shape[0]
        t = torch.tensor
        layout = build_block_layout(t([n]), t([n]), t([0]), bs, n=n)
        masks = build_attention_masks(layout, drafter.config.layer_types, drafter.config.sliding_window, "sdpa")
        ids = torch.full((1, bs), drafter.config.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        with torch.no_grad():
            return drafter(context, layout.context_position_ids, ids, layout.block_position_ids, masks)[1:]

    for p in prompts:
        cached = DrafterProposer(drafter)
        calls = []

        def both(context, anchor, k, cached=cached, calls=calls):
            drafts = cached(context, anchor, k)
            ref = drafter.compute_logits(full(context, anchor)).argmax(-1).tolist()
            calls.append((context.shape[0], drafts == ref))
            return drafts

        res = speculative_generate(target, both, p, 24, stops, bs)
        assert res.tokens == greedy_generate(target, p, 24, stops).tokens
        assert len(calls) >= 3 and len({n for n, _ in calls}) == len(calls)  # the context grew every step
        assert all(same for _, same in calls), calls
    with pytest.raises(ValueError, match="one DrafterProposer per prompt"):
        cached(torch.zeros(1, embed.shape[1] * len(drafter.config.target_layer_ids)), 1, bs - 1)
