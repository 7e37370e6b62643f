"""`dflash-ipc export` read by the field's own client code: z-lab's ``dflash`` (its ``DFlashDraftModel``,
its AutoModel route through the export's modeling file, its decoding loop) and vllm-project's
``speculators`` (its DFlash converter, config and model classes), on a drafter trained here.

One drafter, trained in this process on a tiny Llama checkpoint (attention only: caches crop, as
z-lab's loop needs) over a draft vocabulary of 256 of its 1,024 ids, is exported once per layout and
shared by the module. Greedy decoding of 16 prompts: every output equals the target's greedy one,
and τ equals `dflash-ipc eval`'s on the same prompts.
"""

from __future__ import annotations

import json
import stat
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.drafter.export.layout import CLIENTS, D2T_TENSOR, HEAD_TENSOR, MODELING_FILE
from dflash_ipc.drafter.export.serving import ENGINES_BY_CLIENT, EXAMPLE_MAX_NEW_LINE, EXAMPLE_MESSAGES_LINE

zl = pytest.importorskip("dflash.model", reason="z-lab's dflash (the test extra) is not installed")
ZLAB_CUDA_TIME = zl._cuda_time  # z-lab's own timer (torch.cuda.synchronize()): a CPU run replaces it

N_PROMPTS, MAX_NEW, DRAFT_ROWS, STEPS = 16, 24, 256, 40


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_llama):
    """(config, run directory, {client: (export directory, serving commands)}) of one short in-process
    run on the target's own greedy answers to 16 built-in questions (gen-data), as a user trains."""
    from loop_harness import InprocRun, small_config

    from dflash_ipc.data.builtin_corpus import builtin_conversations
    from dflash_ipc.datagen.gen import GenOptions, run_gen_data
    from dflash_ipc.runtime.probe import plan_data

    tmp = tmp_path_factory.mktemp("export")
    questions, answers = tmp / "questions.jsonl", tmp / "gen.jsonl"
    chats = builtin_conversations(N_PROMPTS, 256)
    questions.write_text("".join(json.dumps({"id": f"q{i}", **c}) + "\n" for i, c in enumerate(chats)))
    # not the last of its 4 layers: Hugging Face's hidden_states[4] is the final-normed output (export notes it)
    target = {"model_path": str(tiny_llama), "spec": {}, "layer_ids": [0, 1, 2]}
    (tmp / "gen").mkdir()
    (tmp / "train").mkdir()
    # 256-token sequences in 1,024-token batches (loop_harness.SMALL's are 128 and 512): questions and answers whole
    shape = {"max_seq_len": 256, "bucket_edges": [64, 128, 256], "token_budget": 1024}
    gen_cfg = small_config(tmp / "gen", targets=1, target=target, data={"paths": [str(questions)]} | shape)
    run_gen_data(gen_cfg, answers, GenOptions(batch_size=N_PROMPTS, max_new=MAX_NEW))
    cfg = small_config(
        tmp / "train",
        targets=1,
        target=target,
        data={"paths": [str(answers)], "num_epochs": 100} | shape,
        drafter={"draft_vocab_size": DRAFT_ROWS},
        training={"max_steps": STEPS, "lr": 1e-2, "warmup_steps": 2},
    )
    run_dir = tmp / "run"
    run_dir.mkdir(mode=0o700)
    plan_data(cfg, run_dir, 1)
    run = InprocRun(cfg, run_dir)
    try:
        run.run()
    finally:
        run.close()
    outs = {}
    for client in CLIENTS:
        r = CliRunner().invoke(main, ["export", "--from", str(run_dir), "--out", str(tmp / client), "--for", client, "--json"])
        assert r.exit_code == 0, r.output
        rep = json.loads(r.output.strip().splitlines()[-1])
        # the reduced head of the `all` layout does not fit speculators' converter: said at export time
        assert rep["step"] == STEPS and rep["client"] == client
        assert [n for n in rep["notes"] if "speculators" in n] == ([] if client != "all" else rep["notes"]) and len(rep["notes"]) == (
            client == "all"
        )
        outs[client] = (Path(rep["out"]), rep["commands"])
    return cfg, run_dir, outs


@pytest.fixture(scope="module")
def target(trained, tiny_llama):
    from transformers import AutoModelForCausalLM

    from dflash_ipc.data.tokenizer import load_tokenizer, stop_token_ids
    from dflash_ipc.eval.run import load_prompts

    cfg = trained[0]
    tok = load_tokenizer(cfg.target.tokenizer)
    lm = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32, attn_implementation="sdpa").eval()
    prompts, stops = load_prompts(cfg, tok, None, N_PROMPTS), sorted(stop_token_ids(tok))
    return lm, prompts, stops, _greedy(lm, prompts, stops)


@pytest.fixture(scope="module")
def eval_report(trained):
    """`dflash-ipc eval`'s report on the export of one layout, decoded once per module."""
    from dflash_ipc.eval.run import run_eval

    cfg, _, outs = trained
    reports: dict[str, dict] = {}

    def report(layout: str) -> dict:
        if layout not in reports:
            reports[layout] = run_eval(cfg, str(outs[layout][0]), n=N_PROMPTS, max_new=MAX_NEW, dtype="float32", speed_prompts=1)
        return reports[layout]

    return report


def _zlab_decode(draft, lm, prompts, stops) -> tuple[list[list[int]], list[int]]:
    """z-lab's loop on every prompt: (outputs, tokens of every step), cut at MAX_NEW tokens as eval cuts.

    z-lab's loop drafts a shorter block where the budget ends inside one (full layers see the whole
    block, so its drafts there differ); eval drafts whole blocks and cuts. Given a block more budget,
    z-lab's loop drafts whole blocks up to MAX_NEW too, and its steps are counted up to there."""
    zl._cuda_time = time.perf_counter  # z-lab times with torch.cuda.synchronize(); none on a CPU
    outputs, lengths = [], []
    for p in prompts:
        budget = MAX_NEW + draft.block_size
        z = zl.dflash_generate(draft, lm, torch.tensor([p]), budget, stops, temperature=0.0, return_stats=True)
        out = z.output_ids[0, len(p) :].tolist()[:MAX_NEW]
        outputs.append(out)
        left = len(out) - 1  # the first token comes from the prefill, the rest from the steps
        for n in z.acceptance_lengths:
            if left <= 0:
                break
            lengths.append(min(n, left))
            left -= n
    return outputs, lengths


def _greedy(lm, prompts, stops) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = lm.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stops, pad_token_id=stops[0])
        outs.append(ids[0, len(p) :].tolist())
    return outs


def test_every_layout_is_0644_with_the_fields_its_client_reads(trained):
    cfg, _, outs = trained
    from safetensors import safe_open

    for client, (out, commands) in outs.items():
        for f in out.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, (client, f.name)
        conf = json.loads((out / "config.json").read_text())
        dc = conf["dflash_config"]
        assert (dc["block_size"], conf["num_speculative_tokens"], conf["method"]) == (
            cfg.drafter.block_size,
            cfg.drafter.block_size - 1,
            "dflash",
        )
        assert dc["mask_token_id"] >= 0 and conf["chat_template_kwargs"] == cfg.chat_template.kwargs
        with safe_open(str(out / "model.safetensors"), "pt") as st:
            keys = set(st.keys())
        reduced = client != "sglang"
        assert ({HEAD_TENSOR, D2T_TENSOR} <= keys) == reduced and (conf.get("draft_vocab_size") == DRAFT_ROWS) == reduced
        assert ("eagle_aux_hidden_state_layer_ids" in conf) == (client in ("all", "vllm"))
        if "eagle_aux_hidden_state_layer_ids" in conf:  # vLLM counts "before layer i": one more than DFlash's ids
            assert conf["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in dc["target_layer_ids"]]
        assert ((out / MODELING_FILE).is_file() and "auto_map" in conf) == (client in ("all", "zlab"))
        assert list(commands) == list(ENGINES_BY_CLIENT[client])
        assert str(out.resolve()) in "".join(commands.values()) and str(cfg.target.model_path) in "".join(commands.values())
    print("\nserving commands:\n" + "\n\n".join(outs["all"][1].values()))
    vllm = outs["all"][1]["vllm"]
    assert "vllm serve" in vllm and f'"num_speculative_tokens": {cfg.drafter.block_size - 1}' in vllm and '"method": "dflash"' in vllm
    sglang = outs["all"][1]["sglang"]
    assert f"--speculative-num-draft-tokens {cfg.drafter.block_size}" in sglang
    assert "--mamba-scheduler-strategy" not in sglang  # an attention-only target: SGLang's default strategy serves it


def test_the_d2t_table_maps_each_head_row_to_the_target_id_it_drafts(trained):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from dflash_ipc.data.draft_vocab import DRAFT_VOCAB_FILE, read_draft_vocab

    _, run_dir, outs = trained
    chosen = read_draft_vocab(run_dir / DRAFT_VOCAB_FILE).tensor()
    st = load_file(str(outs["vllm"][0] / "model.safetensors"))
    d2t = st[D2T_TENSOR]
    assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_ROWS,)
    assert torch.equal(torch.arange(DRAFT_ROWS) + d2t, chosen)  # draft id + d2t[draft id] == target id

    lm = AutoModelForCausalLM.from_pretrained(trained[0].target.model_path, dtype=torch.float32)
    torch.testing.assert_close(st[HEAD_TENSOR], lm.get_output_embeddings().weight.detach()[chosen])  # the target's rows


def test_zlab_draft_model_loads_the_sglang_layout_with_every_key(trained):
    cfg, _, outs = trained
    draft, info = zl.DFlashDraftModel.from_pretrained(outs["sglang"][0], dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    assert (draft.block_size, draft.mask_token_id) == (
        cfg.drafter.block_size,
        json.loads((outs["sglang"][0] / "config.json").read_text())["dflash_config"]["mask_token_id"],
    )


def test_zlab_class_skips_the_reduced_head_of_the_vllm_layout(trained):
    _, _, outs = trained
    _, info = zl.DFlashDraftModel.from_pretrained(outs["all"][0], dtype=torch.float32, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == [D2T_TENSOR, HEAD_TENSOR] and not info["missing_keys"]


def test_automodel_route_drafts_over_the_reduced_head_at_evals_tau(trained, target, eval_report):
    from transformers import AutoModel

    cfg, _, outs = trained
    lm, prompts, stops, greedy = target
    draft, info = AutoModel.from_pretrained(outs["zlab"][0], trust_remote_code=True, dtype=torch.float32, output_loading_info=True)
    assert type(draft).__name__ == "DFlashIpcDraftModel" and not any(info.values()), info
    assert draft.reduced_head
    outputs, lengths = _zlab_decode(draft.eval(), lm, prompts, stops)
    assert outputs == greedy
    rep = eval_report("zlab")  # eval drafts over the same rows (d2t)
    tau = round(sum(lengths) / len(lengths), 4)
    print(f"\nAutoModel route, {DRAFT_ROWS}-row head, z-lab's loop: tau {tau} (eval {rep['tau']})")
    assert rep["lossless"] is True and tau == rep["tau"] and len(lengths) == rep["verify_steps"]
    # its own greedy loop: the same outputs and steps
    own = []
    for p, g in zip(prompts, greedy):
        ids = draft.spec_generate(target=lm, input_ids=torch.tensor([p]), max_new_tokens=MAX_NEW, stop_token_ids=stops)
        assert ids[0, len(p) :].tolist() == g
        own += draft.acceptance_lengths
    assert own == lengths


def _run_printed_route(snippet: str, cfg, messages: list[dict]) -> tuple[list[int], list[int]]:
    """The printed Python lines executed as text, on one prompt at MAX_NEW: (output ids after the prompt, tokens
    of every verification step). Only the two example lines (the prompt, the length) are replaced."""
    assert EXAMPLE_MESSAGES_LINE in snippet and EXAMPLE_MAX_NEW_LINE in snippet
    code = snippet.replace(EXAMPLE_MESSAGES_LINE, f"messages = {messages!r}").replace(EXAMPLE_MAX_NEW_LINE, f"max_new_tokens = {MAX_NEW}")
    scope: dict = {}
    exec(compile(code, "<printed serving snippet>", "exec"), scope)  # noqa: S102 - the printed snippet is the test's subject
    return scope["output_ids"][0, scope["input_ids"].shape[1] :].tolist(), list(scope["steps"])


@pytest.mark.parametrize("route", ["zlab", "automodel"])
def test_the_printed_python_route_runs_as_printed_and_decodes_at_evals_tau(trained, target, eval_report, route, capsys, monkeypatch):
    """z-lab's route reads the sglang layout as z-lab's class does (the whole head), the AutoModel route the
    zlab layout over its reduced head; eval decodes the same export, so both count the same τ."""
    from dflash_ipc.data.readers import iter_records, prompt_messages

    cfg, _, outs = trained
    greedy = target[3]
    layout = "sglang" if route == "zlab" else "zlab"
    snippet = outs[layout][1][route]
    monkeypatch.setattr(zl, "_cuda_time", ZLAB_CUDA_TIME)  # as installed: the printed lines must run on this CPU themselves
    # eval's prompts (no --prompts): the first user turns of data.paths' chat records, in order
    records = iter_records(list(cfg.data.paths), cfg.data.builtin_samples, cfg.data.max_seq_len)
    chats = [m for m in (prompt_messages(rec) for _, rec in records) if m is not None][:N_PROMPTS]
    outputs, steps = [], []
    for messages in chats:
        out, prompt_steps = _run_printed_route(snippet, cfg, messages)
        outputs.append(out[:MAX_NEW])
        steps += prompt_steps
    printed = capsys.readouterr().out
    assert printed.count("tau ") == len(chats)
    rep = eval_report(layout)  # over the whole head (sglang layout, as SGLang and z-lab's class) or its reduced rows
    print(f"\nprinted {route} route, {len(chats)} prompts: tau {round(sum(steps) / len(steps), 4)} (eval {rep['tau']})")
    assert outputs == greedy and rep["lossless"] is True
    assert round(sum(steps) / len(steps), 4) == rep["tau"] and len(steps) == rep["verify_steps"]


def test_speculators_converts_and_loads_the_export_with_the_ids_it_expects(trained, tmp_path):
    pytest.importorskip("speculators", reason="speculators (installed by .ci/run, --no-deps) is not installed")
    from speculators.convert.dflash import DFlashConverter
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    cfg, _, outs = trained
    # its converter reads z-lab's whole-head layout (it sizes the head to the vocabulary): the sglang one here
    src = outs["sglang"][0]
    conf = json.loads((src / "config.json").read_text())
    DFlashConverter().convert(src, tmp_path / "spec", base_model=cfg.target.model_path, validate=True)
    sc = DFlashSpeculatorConfig.from_pretrained(tmp_path / "spec")
    ids = conf["dflash_config"]["target_layer_ids"]
    n_target = conf["num_target_layers"]
    assert sc.block_size == cfg.drafter.block_size and sc.mask_token_id == conf["dflash_config"]["mask_token_id"]
    # speculators counts hidden_states indices (z-lab's id + 1), the target's last layer implied
    assert sc.aux_hidden_state_layer_ids == [i + 1 for i in ids if i + 1 != n_target]
    assert sc.speculators_config.verifier.name_or_path == cfg.target.model_path
    assert sc.speculators_config.proposal_methods[0].speculative_tokens == cfg.drafter.block_size - 1
    model = DFlashDraftModel.from_pretrained(tmp_path / "spec")
    from safetensors.torch import load_file

    mine = load_file(str(src / "model.safetensors"))
    theirs = model.state_dict()
    for name in ("fc.weight", "layers.0.self_attn.q_proj.weight", "layers.1.mlp.down_proj.weight", "norm.weight"):
        torch.testing.assert_close(theirs[name], mine[name])
    # the `all` layout's reduced head is what export's note says it is: a head its converter cannot load
    with pytest.raises(RuntimeError, match="size mismatch for lm_head.weight"):
        DFlashConverter().convert(outs["all"][0], tmp_path / "reduced", base_model=cfg.target.model_path, validate=False)


def test_a_drafter_reading_the_targets_last_layer_is_noted(trained):
    import dataclasses

    from dflash_ipc.drafter.export.from_checkpoint import client_notes
    from dflash_ipc.drafter.export.layout import read_export

    conf = read_export(trained[2]["all"][0])
    assert client_notes(conf) == []
    last = dataclasses.replace(conf, target_layer_ids=[0, 1, conf.num_target_layers - 1])
    (note,) = client_notes(last)
    assert "last layer" in note and "target.layer_ids" in note
