"""Multi-turn synthesis (``synth.multi_turn_fraction`` > 0): after gen-data answered the synthesized
requests, the target also writes the user's *next* turn after its own answer (the pre-query prefix of
the conversation so far, :func:`~dflash_ipc.datagen.synth.pre_query_template` with history), then answers it.

Which records get a second turn is a hash of their id (``synth.multi_turn_fraction`` of those whose
answer ended, ``finish == "stop"``: a cut answer has no natural follow-up). A second turn passes the
filters of the first (unfinished, length, leakage, repetition) but not the duplicate ones: "Can you give
an example?" after two different answers is two different conversations.

Files: ``OUT.turns.jsonl`` keeps every second turn sampled, or why it was dropped
(``{"id": <record id>, "content": str | null, "dropped": reason | null}``), so a resumed run samples only
the missing ones; the answered two-turn records go beside their first turn (``OUT`` or ``OUT.holdout.jsonl``,
so the held-out split stays by the first prompt) as ``<id>/t2``::

    {"id": "<id>/t2", "conversations": [user 1, assistant 1 (text), user 2, assistant 2 (+ token_ids)], "finish": ...}

They train as chat records: the last answer supervised by its ids, the first turn as context.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_ipc.config import DFlashConfig
from dflash_ipc.data.answer_message import answer_message
from dflash_ipc.data.records import ANSWER_IDS_FIELD, VOCAB_FIELD
from dflash_ipc.datagen.gen import GenOptions, generate_batch, holdout_path, is_holdout, read_complete_jsonl
from dflash_ipc.datagen.prequery import pre_query_template, user_turn_stops
from dflash_ipc.datagen.synth_filters import PromptFilter

__all__ = ["TURN_SUFFIX", "extend_turns", "turns_path"]

TURN_SUFFIX = "/t2"


def turns_path(out: Path) -> Path:
    return Path(out).with_name(Path(out).stem + ".turns.jsonl")


def extend_turns(
    cfg: DFlashConfig,
    tokenizer,
    get_lm: Callable[[], Any],
    out: Path,
    opts: GenOptions,
    echo: Callable[[str], None] = lambda s: None,
) -> dict:
    """Sample and answer the second turns still missing; returns counts."""
    from dflash_ipc.data.tokenizer import stop_token_ids, vocab_identity

    sc = cfg.synth
    out = Path(out)
    files = {False: out, True: holdout_path(out)}
    parents: list[tuple[dict, bool]] = []
    answered: set[str] = set()
    for held, path in files.items():
        for rec in read_complete_jsonl(path):
            rid = str(rec.get("id", ""))
            if rid.endswith(TURN_SUFFIX):
                answered.add(rid[: -len(TURN_SUFFIX)])
            elif rid.startswith("synth-") and rec.get("finish") == "stop" and len(rec.get("conversations", [])) == 2:
                if is_holdout("multi-turn:" + rid, sc.multi_turn_fraction):  # by hash: the same records on every run
                    parents.append((rec, held))
    tpath = turns_path(out)
    turns = {str(t["id"]): t for t in read_complete_jsonl(tpath) if "id" in t}
    todo = [(rec, held) for rec, held in parents if rec["id"] not in answered]
    result = {"multi_turn_candidates": len(parents), "turns_sampled": 0, "turns_dropped": 0, "turns_written": 0}
    if not todo:
        return result
    lm = get_lm()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    filt = PromptFilter(dataclasses.replace(sc, near_dup_threshold=1.0), list(tokenizer.all_special_tokens), dedup=False)

    def history(rec: dict) -> list[dict]:
        u, a = rec["conversations"]  # the answer's text fields as gen-data wrote them (thinking, content)
        return [{"role": "user", "content": u["content"]}, {k: v for k, v in a.items() if k != ANSWER_IDS_FIELD}]

    # 1. the next user turns still missing, sampled in batches (longest conversations together)
    missing = sorted((r for r, _ in todo if r["id"] not in turns), key=lambda r: r["id"])
    if missing:
        stops = user_turn_stops(tokenizer, getattr(lm, "generation_config", None))
        sample = opts.sampling(sc.max_prompt_tokens, sc.temperature, sc.top_p)
        ids = {
            r["id"]: tokenizer(pre_query_template(tokenizer, history=history(r)), add_special_tokens=False)["input_ids"] for r in missing
        }
        missing.sort(key=lambda r: len(ids[r["id"]]))
        with open(tpath, "a", encoding="utf-8") as f:
            for b in range(0, len(missing), opts.batch_size):
                batch = missing[b : b + opts.batch_size]
                rows = generate_batch(lm, [ids[r["id"]] for r in batch], pad_id, stops, sample, seed=sc.seed * 1_000_003 + 7 + b)
                lines = []
                for r, (gen_ids, finish) in zip(batch, rows):
                    text = tokenizer.decode(gen_ids, skip_special_tokens=False).strip()
                    why = filt.reason(text, finish == "stop")
                    turns[r["id"]] = {"id": r["id"], "content": None if why else text, "dropped": why}
                    lines.append(json.dumps(turns[r["id"]], ensure_ascii=False))
                f.write("".join(line + "\n" for line in lines))
                f.flush()
                result["turns_sampled"] += len(batch)
                echo(f"synth: second turns {result['turns_sampled']}/{len(missing)} sampled ({sum(filt.dropped.values())} dropped)")
    result["turns_dropped"] = sum(1 for t in turns.values() if t.get("dropped"))

    # 2. their answers, written beside the first turn
    pending = []
    for rec, held in todo:
        turn = turns.get(rec["id"])
        if turn and turn.get("content"):
            msgs = history(rec) + [{"role": "user", "content": turn["content"]}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            pending.append((rec["id"], msgs, held, tokenizer(text, add_special_tokens=False)["input_ids"][: cfg.data.max_seq_len]))
    pending.sort(key=lambda p: len(p[3]))
    stops = stop_token_ids(tokenizer, getattr(lm, "generation_config", None))
    vocab = vocab_identity(tokenizer)
    with open(files[False], "a", encoding="utf-8") as f_out, open(files[True], "a", encoding="utf-8") as f_hold:
        for b in range(0, len(pending), opts.batch_size):
            batch = pending[b : b + opts.batch_size]
            answers = generate_batch(lm, [p[3] for p in batch], pad_id, stops, opts, seed=opts.seed * 1_000_003 + 11 + b)
            for (rid, msgs, held, _), (ids, finish) in zip(batch, answers):
                answer = {**answer_message(tokenizer, msgs, ids), ANSWER_IDS_FIELD: ids}
                rec = {"id": rid + TURN_SUFFIX, "conversations": msgs + [answer], "finish": finish, VOCAB_FIELD: vocab}
                (f_hold if held else f_out).write(json.dumps(rec, ensure_ascii=False) + "\n")
                result["turns_written"] += 1
            f_out.flush()
            f_hold.flush()
            echo(f"synth: second turns answered {result['turns_written']}/{len(pending)}")
    return result
