"""Every decoder of a target, on every family of the zoo, past its windows and through rejections and rollbacks:
eval's speculative decoding (``TargetLM``'s cache, rolled back by crop or recompute), the export's own decoder
(``spec_generate``) and gen-data's batched ``generate`` (dynamic and static caches, left-padded), each token for
token against transformers' own greedy decoding of the same checkpoint (``generate(do_sample=False)`` on its
default cache, one prompt at a time), which shares none of eval's cache code.

The prompts are three windows or more long (the zoo's sliding windows and attention chunks are 8 tokens), so
every rollback happens past a full window. The drafter is the untrained export (its sliding layer's window 8 tokens too):
its drafts are rejected, so nearly every verification rolls the cache back; one more decode drafts transformers'
own continuation with one draft per block spoiled, so blocks are accepted in part and the cache keeps some drafts
and drops the rest. Gemma 3n and Gemma 4 run twice: as the zoo builds them, and with KV-shared layers (the last
layers read the keys and values of an earlier one) as their real checkpoints have; Gemma 3 and Qwen3.5 once more
inside their image-text wrappers, as their checkpoints ship.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from family_zoo import FAMILIES, VISION_WRAPPED, WINDOW, build_vision_wrapped_checkpoint, family_config
from transformers import AutoModelForCausalLM

from dflash_ipc.config import load_config
from dflash_ipc.data.tokenizer import build_builtin_tokenizer, config_tokenizer, stop_token_ids
from dflash_ipc.datagen.gen import GenOptions, run_gen_data
from dflash_ipc.drafter.export.hf_modeling import DFlashIpcDraftModel
from dflash_ipc.drafter.export.layout import load_exported_drafter
from dflash_ipc.drafter.export.untrained import export_untrained
from dflash_ipc.eval.run import load_prompts
from dflash_ipc.eval.spec import DrafterProposer, speculative_generate
from dflash_ipc.eval.target_lm import TargetLM, build_target_lm
from dflash_ipc.families import family_of
from dflash_ipc.target_spec.heads import target_head_weights
from dflash_ipc.target_spec.hf_config import load_hf_config

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
MAX_NEW = 24
BLOCK = 4
#: GatedDeltaNet layers cannot forget tokens: their caches roll back by re-running the kept ones.
RECURRENT = frozenset({"qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5-vl"})
#: Gemma 3n and Gemma 4 with their last two layers reading the keys and values of the last earlier layer of their kind.
KV_SHARED = {"gemma3n-kv-shared": "gemma3n", "gemma4-kv-shared": "gemma4"}
#: Text models inside their image-text wrapper, as Gemma 3 and Qwen3.5 checkpoints ship.
VISION = {f"{name}-vl": name for name in VISION_WRAPPED}
CHATS = [
    {"id": f"p{i}", "conversations": [{"role": "user", "content": text}, {"role": "assistant", "content": "-"}]}
    for i, text in enumerate(
        (
            "Explain what a sliding window does to attention, and why a model with one still reads a long prompt.",
            "Write a short poem about the sea, the wind over the harbour and the boats that come home at night.",
            "How do I reverse a list in Python without copying it, and what does that cost me?",
        )
    )
]


def _checkpoint(name: str, family_checkpoint, root: Path) -> Path:
    if name in VISION:
        return build_vision_wrapped_checkpoint(VISION[name], root)
    if name not in KV_SHARED:
        return family_checkpoint(name)
    config = family_config(KV_SHARED[name])
    config.num_kv_shared_layers = 2
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    build_builtin_tokenizer().save_pretrained(root)
    return root


class _SpoiledContinuation:
    """Drafts the reference continuation with one draft per block spoiled, at a position that moves each step
    (and every draft right for one step in ``BLOCK``): blocks accepted in part, some in whole."""

    def __init__(self, prompt_len: int, continuation: list[int], vocab: int):
        self.prompt_len, self.continuation, self.vocab, self.steps = prompt_len, continuation, vocab, 0

    def __call__(self, context: torch.Tensor, anchor: int, k: int) -> list[int]:
        first = context.shape[0] - self.prompt_len + 1  # the continuation's index of the first draft
        drafts = [self.continuation[first + i] if first + i < len(self.continuation) else 0 for i in range(k)]
        spoil = self.steps % (k + 1)
        if spoil < k:
            drafts[spoil] = (drafts[spoil] + 1) % self.vocab
        self.steps += 1
        return drafts


def _transformers_greedy(model, prompt: list[int], stops: set[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=sorted(stops), pad_token_id=min(stops))
    return out[0, len(prompt) :].tolist()


def _rolled_back_logits_equal_a_forward_without_cache(target: TargetLM, prompt: list[int]) -> None:
    """After a verification block rolled back to its anchor, the next block's logits equal one forward over the
    whole sequence without a cache: the masks transformers builds over a cache that keeps every token apply the
    windows and chunks as its forward over the whole sequence does (fp32, <= 1e-4)."""
    cache = target.new_cache()
    target.forward_logits(prompt, cache, capture=False)
    block = [5, 6, 7, 8]
    snapshot = copy.deepcopy(cache) if target.rollback == "recompute" else None
    target.forward_logits(block, cache, capture=False)
    cache = target.roll_back(cache, snapshot, block[:1], len(block) - 1)
    logits, _ = target.forward_logits([9, 10, 11], cache, capture=False)
    with torch.no_grad():
        whole = target.lm(torch.tensor([[*prompt, 5, 9, 10, 11]]), use_cache=False).logits[0, -3:]
    torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)


def _eval_decodes(target: TargetLM, drafter, prompts: list[list[int]], want: list[list[int]], stops: set[int], family: str) -> None:
    for prompt, expected in zip(prompts, want):
        spec = speculative_generate(target, DrafterProposer(drafter), prompt, MAX_NEW, stops, BLOCK)
        assert spec.tokens == expected, f"{family}: eval's speculative output left transformers' greedy decoding"
        assert any(s.kept_positions < BLOCK for s in spec.steps), f"{family}: no verification rolled the cache back"
    longest = max(range(len(prompts)), key=lambda i: len(want[i]))
    spoiled = _SpoiledContinuation(len(prompts[longest]), want[longest], vocab=1024)
    spec = speculative_generate(target, spoiled, prompts[longest], MAX_NEW, stops, BLOCK)
    assert spec.tokens == want[longest], f"{family}: eval left transformers' greedy decoding after partly accepted blocks"
    assert any(0 < s.accepted < BLOCK - 1 for s in spec.steps), "a block accepted in part: the cache keeps drafts and drops the rest"


def _gen_data_answers(cfg, lm, prompts_file: Path, out: Path, decode: str) -> dict[str, list[int]]:
    opts = GenOptions(batch_size=len(CHATS), max_new=MAX_NEW, decode=decode)
    run_gen_data(cfg, out, opts, prompts_path=str(prompts_file), get_lm=lambda: lm)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {rec["id"]: rec["conversations"][-1]["token_ids"] for rec in records}


@pytest.mark.parametrize("family", [*FAMILIES, *KV_SHARED, *VISION])
def test_eval_the_export_decoder_and_gen_data_equal_transformers_greedy_past_the_window(family, family_checkpoint, tmp_path):
    path = _checkpoint(family, family_checkpoint, tmp_path / "checkpoint")
    attention = family_of(family_config({**KV_SHARED, **VISION}.get(family, family))).attention_implementation("auto")
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps(chat) + "\n" for chat in CHATS))
    cfg = load_config(
        TINY,
        {
            "target.model_path": str(path),
            "target.tokenizer": str(path),
            "target.spec": {},
            "data.paths": [str(prompts_file)],
            "drafter.sliding_window": WINDOW,  # the drafter's own sliding layer is past its window too
            "drafter.block_size": BLOCK,
        },
    )
    tokenizer = config_tokenizer(cfg)
    prompts = load_prompts(cfg, tokenizer, str(prompts_file), len(CHATS))
    assert min(map(len, prompts)) >= 3 * WINDOW and len(set(map(len, prompts))) == len(prompts)  # gen-data pads them
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention).eval()
    stops = stop_token_ids(tokenizer, reference.generation_config)
    want = [_transformers_greedy(reference, p, stops) for p in prompts]

    lm = build_target_lm(cfg.target, "cpu", dtype="float32")
    assert lm.config._attn_implementation == attention  # target.attn_implementation = "auto", as the training target
    drafter_dir = export_untrained(cfg, tmp_path / "drafter")  # eval's untrained floor, as `export-untrained` writes it
    embed, head = target_head_weights(cfg.target, load_hf_config(cfg.target), "cpu", torch.float32)
    drafter = load_exported_drafter(drafter_dir, embed, head, attention="sdpa")
    target = TargetLM(lm, drafter.config.target_layer_ids)
    try:
        assert target.rollback == ("recompute" if family in RECURRENT else "crop")
        _rolled_back_logits_equal_a_forward_without_cache(target, prompts[0])
        _eval_decodes(target, drafter, prompts, want, stops, family)
    finally:
        target.close()

    export_decoder = DFlashIpcDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    out = export_decoder.spec_generate(lm, torch.tensor([prompts[0]]), MAX_NEW, sorted(stops))
    assert out[0, len(prompts[0]) :].tolist() == want[0], f"{family}: the export's spec_generate left transformers' greedy"

    for decode in ("dynamic", "static"):
        answers = _gen_data_answers(cfg, lm, prompts_file, tmp_path / f"gen-{decode}.jsonl", decode)
        for chat, expected in zip(CHATS, want):
            expected = expected[:-1] if expected[-1] in stops else expected  # a record leaves the stop token out
            assert answers[chat["id"]] == expected, f"{family}: gen-data ({decode} cache) answered {chat['id']} otherwise"
