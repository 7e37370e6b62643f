"""benchmarks/peers' τ comparison: a SpecForge 0.2.0 DFlash drafter in dflash-ipc's export layout. The mapping
is lossless (the block logits of SpecForge's own model equal those of dflash-ipc's drafter loaded from the
converted export, fp32, on a real tiny target's features), what dflash-ipc's drafter cannot hold is refused
by name, the fitted cosine is the one SpecForge would have built, and a tiny SpecForge-trained drafter goes
through SpecForge's own export, the conversion and `dflash-ipc eval` losslessly. The tests that run
SpecForge's code skip without it (.ci/run installs it with --no-deps; the GPU machine's wheels:
benchmarks/peers/README.md)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_ipc.cli import main as cli
from dflash_ipc.drafter.export.layout import load_exported_drafter
from dflash_ipc.drafter.model.dflash_drafter import DFlashDrafter, DrafterModelConfig
from dflash_ipc.eval.spec import DrafterProposer
from dflash_ipc.eval.target_lm import TargetLM

ROOT = Path(__file__).resolve().parents[2]
PEERS = ROOT / "benchmarks" / "peers"
needs_specforge = pytest.mark.skipif(importlib.util.find_spec("specforge") is None, reason="SpecForge 0.2.0 is not installed")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"peers_{name}", PEERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass resolves its annotations through its module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sx():
    return _load("specforge_export")


@pytest.fixture(scope="module")
def tau():
    return _load("specforge_tau")


def _shape(window: int = 8, layer_ids=(1, 3, 4), vocab: int = 256) -> DrafterModelConfig:
    return DrafterModelConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=window,
        block_size=8,
        vocab_size=vocab,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=1024,
        target_layer_ids=list(layer_ids),
        mask_token_id=vocab - 1,
        num_target_layers=6,
    )


def _tiny_target(vocab: int = 256) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float().eval()


def _specforge_save(draft, tmp: Path) -> Path:
    """SpecForge's own way out: its controller's checkpoint of the draft, then ``export_to_hf``."""
    from specforge.export.to_hf import export_to_hf

    tmp.mkdir(parents=True, exist_ok=True)
    torch.save({"draft_state_dict": dict(draft.state_dict())}, tmp / "training_state.pt")
    draft.config.to_json_file(str(tmp / "draft_config.json"))
    return Path(export_to_hf(str(tmp / "training_state.pt"), str(tmp / "draft_config.json"), str(tmp / "hf")))


@needs_specforge
def test_specforge_block_logits_equal_dflash_ipc_drafter_from_the_converted_export(tmp_path, sx, tau):
    from specforge.algorithms.common.dflash_family_model import create_dflash_sdpa_mask
    from specforge.modeling.draft.dflash import DFlashDraftModel, extract_context_feature

    shape = _shape()
    target = _tiny_target()
    torch.manual_seed(1)
    draft = DFlashDraftModel(tau.specforge_draft_config(shape, "sdpa")).float().eval()
    with torch.no_grad():  # non-unit norms: a norm mapped onto the wrong tensor shows
        for p in draft.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
            else:
                p.mul_(5.0)
    hf_dir = _specforge_save(draft, tmp_path / "sf")

    # the same inputs: a prompt's features (dflash-ipc's capture, as eval takes them; SpecForge's HF extraction)
    prompt = torch.randint(8, 250, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    tlm = TargetLM(target, shape.target_layer_ids)
    feats = tlm.forward(prompt, tlm.new_cache())[1].float()
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True, use_cache=False)
    feats_sf = extract_context_feature(out.hidden_states, shape.target_layer_ids)
    torch.testing.assert_close(feats_sf[0], feats, rtol=1e-5, atol=1e-5)
    embed, head = target.get_input_embeddings().weight.detach(), target.get_output_embeddings().weight.detach()

    # SpecForge's training forward: three blocks at once under its own masks (anchors past the window of 8)
    anchors = torch.tensor([[4, 13, 23]])
    n, b, s = anchors.shape[1], shape.block_size, len(prompt)
    noise = torch.full((1, n * b), shape.mask_token_id)
    noise[0, torch.arange(n) * b] = torch.tensor(prompt)[anchors[0]]
    keep = torch.ones(1, n, dtype=torch.bool)
    masks = {
        "full_attention": create_dflash_sdpa_mask(anchors, keep, s, b, "cpu"),
        "sliding_attention": create_dflash_sdpa_mask(anchors, keep, s, b, "cpu", sliding_window=shape.sliding_window),
    }
    pos = torch.cat([torch.arange(s), (anchors[0, :, None] + torch.arange(b)).reshape(-1)])[None]
    with torch.no_grad():
        hidden = draft(position_ids=pos, attention_mask=masks, noise_embedding=embed[noise], target_hidden=feats_sf)
    sf_logits = (hidden[0] @ head.T).view(n, b, -1)[:, 1:]

    def ipc_logits(export: Path) -> list[torch.Tensor]:
        ipc = load_exported_drafter(export, embed, head, attention="sdpa").float().eval()
        return [DrafterProposer(ipc).logits(feats[:a], prompt[a], b - 1).float() for a in anchors[0].tolist()]

    export = sx.convert(hf_dir, tmp_path / "export")
    for j, got in enumerate(ipc_logits(export)):
        torch.testing.assert_close(got, sf_logits[j], rtol=1e-5, atol=1e-4)
        assert torch.equal(got.argmax(-1), sf_logits[j].argmax(-1))
    # a mapping that loses the window is seen: the blocks whose context the window cuts differ
    cfg = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(cfg | {"sliding_window": 2048}))
    wrong = ipc_logits(sx.convert(hf_dir, tmp_path / "wrong"))
    assert all((w - sf).abs().max() > 1e-2 for w, sf in zip(wrong, sf_logits))


def _state_of(shape: DrafterModelConfig) -> dict[str, torch.Tensor]:
    zeros = torch.zeros(shape.vocab_size, shape.hidden_size)
    return dict(DFlashDrafter(shape, zeros, zeros, attention="sdpa", init_seed=3).state_dict())


def test_conversion_maps_every_tensor_and_refuses_what_the_drafter_cannot_hold(sx, tau):
    shape = _shape(window=32)
    cfg = tau.specforge_draft_config(shape, "sdpa").to_dict()  # SpecForge's config.json of this shape
    assert sx.drafter_config(cfg) == shape
    state = _state_of(shape)
    sf_state = {f"draft_model.{k}": v for k, v in state.items()} | {
        "draft_model.rotary_emb.inv_freq": torch.ones(8),  # recomputed from the theta
        "embed_tokens.weight": torch.zeros(shape.vocab_size, shape.hidden_size),  # the target's own table
    }
    back = sx.to_drafter(shape, sf_state).state_dict()
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)

    refused = {
        "layers.0.self_attn.q_proj.bias": {**state, "layers.0.self_attn.q_proj.bias": torch.zeros(64)},
        "has shape (64, 64)": {**state, "fc.weight": torch.zeros(64, 64)},
        "missing drafter tensors ['norm.weight']": {k: v for k, v in state.items() if k != "norm.weight"},
    }
    for says, bad in refused.items():
        with pytest.raises(sx.SpecForgeDraftError) as err:
            sx.drafter_state(bad, shape)
        assert says in str(err.value)
    bad_configs = {
        "attention_bias": cfg | {"attention_bias": True},
        "another draft family": cfg | {"dflash_config": {**cfg["dflash_config"], "projector_type": "mlp"}},
        "plain RoPE": cfg | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}},
        "a reduced head": cfg | {"draft_vocab_size": 128},
        "not ['DFlashDraftModel']": cfg | {"architectures": ["LlamaForCausalLM"]},
        "mask_token_id is missing": cfg | {"dflash_config": {"target_layer_ids": [1, 3, 4]}},
    }
    for says, bad in bad_configs.items():
        with pytest.raises(sx.SpecForgeDraftError) as err:
            sx.drafter_config(bad)
        assert says in str(err.value), says
    # SpecForge writes no window for a drafter without sliding layers; it maps to the full-attention drafter
    full = shape.__class__(**{**shape.to_dict(), "layer_types": ["full_attention"] * 2})
    assert sx.drafter_config(tau.specforge_draft_config(full, "sdpa").to_dict()).layer_types == ["full_attention"] * 2


@needs_specforge
def test_fitted_cosine_is_the_one_specforge_builds_for_that_length(tau):
    from specforge.optimizer import BF16Optimizer

    def optimizer(total):
        return BF16Optimizer(torch.nn.Linear(4, 4).to(torch.bfloat16), lr=1e-3, total_steps=total, warmup_ratio=0.04)

    fitted, fresh = optimizer(4000), optimizer(300)
    for _ in range(10):  # the steps before the fit ran on the provisional schedule
        fitted.step()
    tau.refit_schedule(fitted, 300, 10, 0.04)
    for _ in range(10):
        fresh.step()
    lrs = []
    for _ in range(250):
        assert fitted.scheduler.get_last_lr() == pytest.approx(fresh.scheduler.get_last_lr(), rel=1e-9)
        lrs.append(fitted.scheduler.get_last_lr()[0])
        fitted.step()
        fresh.step()
    assert max(lrs) == pytest.approx(1e-3, rel=1e-4) and lrs[-1] < 2e-4  # warmed up, then down the cosine


def _tiny_chain(tmp: Path, data: str = "") -> Path:
    """A tiny real-checkpoint target, random-token records with gen-data's token_ids and a held-out file, a config
    (``data``: its [data] paths and batching instead of the one file)."""
    _load("make_target").main(["--shape", "tiny-llama", "--out", str(tmp / "target"), "--device", "cpu"])
    make_data = _load("make_data")
    make_data.main(["--out", str(tmp / "data.jsonl"), "--n", "12", "--len", "60"])
    make_data.main(["--out", str(tmp / "held.jsonl"), "--n", "2", "--len", "20", "--seed", "1"])
    data = data or f'paths = ["{tmp / "data.jsonl"}"]\nmax_seq_len = 128\nbucket_edges = [128]\ntoken_budget = 256\nmax_batch_size = 4\n'
    cfg = tmp / "tiny.toml"
    cfg.write_text(
        f'[topology]\ntargets = ["cpu"]\ndrafters = ["cpu"]\n[transport]\nbackend = "cpu-shm"\n[data]\n{data}'
        f'[target]\nmodel_path = "{tmp / "target"}"\ndtype = "float32"\n'
        '[drafter]\nnum_layers = 2\nlayer_types = ["sliding_attention", "full_attention"]\nsliding_window = 16\nblock_size = 4\n'
        'num_anchors = 16\ndtype = "float32"\nattention = "sdpa"\n[training]\nlr = 1e-3\nloss_gamma = 4.0\n'
    )
    return cfg


@pytest.mark.slow  # SpecForge's step in its own process (a gloo rank), then eval: ~20 s on two cores
@needs_specforge
def test_a_specforge_trained_drafter_converts_and_decodes_losslessly_in_eval(tmp_path):
    cfg = _tiny_chain(tmp_path)
    out = tmp_path / "sf"
    argv = ["--config", str(cfg), "--train-s", "0.01", "--out", str(out), "--num-anchors", "16", "--token-budget", "256"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, str(PEERS / "specforge_tau.py"), *argv], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    train = json.loads((out / "train.json").read_text())
    assert train["steps"] >= 1 and train["tokens"] > 0 and train["drafter"]["block_size"] == 4
    assert train["drafter"]["draft_vocab_size"] == 0 and train["num_anchors_per_seq"] == 16

    # the export holds exactly the weights of SpecForge's checkpoint and of its own exporter's output
    sf_weights = load_file(str(Path(train["specforge_hf"]) / "model.safetensors"))
    ipc_weights = load_file(str(out / "export" / "model.safetensors"))
    checkpoint = torch.load(out / "specforge" / "training_state.pt", weights_only=True)["draft_state_dict"]
    assert set(ipc_weights) == set(sf_weights) == set(checkpoint)
    assert all(torch.equal(ipc_weights[k], sf_weights[k]) and torch.equal(checkpoint[k], sf_weights[k]) for k in sf_weights)

    argv = ["eval", "--config", str(cfg), "--drafter", str(out / "export"), "--suite", f"held={tmp_path / 'held.jsonl'}"]
    r = CliRunner().invoke(cli, [*argv, "--n", "1", "--max-new", "8", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout.strip().splitlines()[-1])
    held = rep["sets"]["held"]
    assert held["lossless"] is True and held["prompts"] == 1 and 1.0 <= held["tau"] <= 4
    assert rep["mask_token_id"] == train["drafter"]["mask_token_id"]


def test_the_seconds_a_resumed_dflash_ipc_run_trained_add_up_over_its_invocations(tmp_path):
    table = _load("tau_table")
    rows = [{"step": i + 1, "tokens": 100, "elapsed_s": 2.0 * (i + 1), "loss": 1.0} for i in range(5)]  # 10 s, then stopped
    rows += [{"step": 6 + i, "tokens": 100, "elapsed_s": 3.0 * (i + 1), "loss": 1.0} for i in range(4)]  # resumed: 12 s
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"holdout_step": 9, "tau_holdout": 2.0}\n')
    got = table.ipc_run_summary(tmp_path)
    assert got["steps"] == 9 and got["trained_s"] == 22.0 and got["tokens"] == 900
    with pytest.raises(ValueError, match="not a dflash-ipc run directory"):
        table.ipc_run_summary(tmp_path / "nothing")


def test_specforge_epoch_holds_the_records_tokens_and_masks_of_dflash_ipcs_epoch(tmp_path, tau):
    from dflash_ipc.config import load_config
    from dflash_ipc.data.corpus import load_corpus
    from dflash_ipc.data.plan import plan_epoch
    from dflash_ipc.data.tokenizer import config_tokenizer

    make_data = _load("make_data")
    make_data.main(["--out", str(tmp_path / "more.jsonl"), "--n", "30", "--lengths", "mixed", "--seq-len", "120", "--seed", "2"])
    paths = json.dumps([str(tmp_path / "data.jsonl"), str(tmp_path / "more.jsonl")])
    mix = f"paths = {paths}\nweights = [1.0, 3.0]\nmax_seq_len = 128\nbucket_edges = [32, 64, 128]\ntoken_budget = 256\nnum_epochs = 2\n"
    cfg = load_config(_tiny_chain(tmp_path, data=mix))
    tok = config_tokenizer(cfg)
    corpus = load_corpus(cfg.data, tok, tmp_path / "cache")
    planned = plan_epoch(corpus.lengths, cfg.data, cfg.run.seed, 0, 1, 0, sources=corpus.sources)  # dflash-ipc's epoch 0
    want = sorted((tuple(corpus.sample(i)[0].tolist()), tuple(corpus.sample(i)[1].tolist())) for b in planned for i in b.sample_indices)
    got, epochs = [], set()
    spec = dataclasses.replace(cfg.data, token_budget=1024, max_batch_size=64)  # SpecForge's own step size
    for epoch, ids, attn, loss_mask, real in tau.planned_batches(spec, cfg.run.seed, corpus, 0):
        epochs.add(epoch)
        if epoch == 0:
            assert ids.shape[0] * ids.shape[1] <= 1024 and int(attn.sum()) == real
            assert not bool(loss_mask[attn == 0].any())  # padding is never supervised
            got += [(tuple(i[a > 0].tolist()), tuple(m[a > 0].tolist())) for i, m, a in zip(ids, loss_mask, attn)]
    assert got and sorted(got) == want and epochs == {0, 1}
