"""A Parquet folder and a folder written by ``datasets``' save_to_disk (a Dataset, or a DatasetDict whose train
split is read) in ``data.paths`` are training input: `up`'s preflight admits them (a folder of neither kind
is refused, naming its key), the probe's data plan reads them like the same records in JSONL, and the
token cache follows a rewritten shard inside the folder."""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

import pytest
from conftest import write_toml

from dflash_ipc.config import ConfigError
from dflash_ipc.data.corpus import load_corpus
from dflash_ipc.data.tokenizer import config_tokenizer
from dflash_ipc.runtime.preflight import validate_for_up
from dflash_ipc.runtime.probe import plan_data

# the test extra installs both; a machine without them (a GPU image running only `-m gpu`) collects this file
datasets = pytest.importorskip("datasets", reason="the test extra's datasets is not installed")
pa = pytest.importorskip("pyarrow", reason="the test extra's pyarrow is not installed")
pq = pytest.importorskip("pyarrow.parquet", reason="the test extra's pyarrow is not installed")

REPO = Path(__file__).resolve().parents[2]


def chats(n: int, tag: str = "") -> list[dict]:
    return [
        {
            "conversations": [
                {"role": "user", "content": f"Question {tag}{i}: what does sorted() return for {list(range(i % 5))}?"},
                {"role": "assistant", "content": f"A new list{tag}, {list(range(i % 5))}, in ascending order."},
            ]
        }
        for i in range(n)
    ]


def config(tmp_path: Path, *paths: Path) -> Path:
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    raw["data"]["paths"] = [str(p) for p in paths]
    return write_toml(tmp_path / f"c{len(list(tmp_path.glob('c*.toml')))}.toml", raw)


@pytest.fixture
def sources(tmp_path):
    rows = chats(12)
    jsonl = tmp_path / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    pq.write_table(pa.Table.from_pylist(rows[:7]), parquet / "part-0.parquet")
    pq.write_table(pa.Table.from_pylist(rows[7:]), parquet / "part-1.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(chats(3, "t"))}).save_to_disk(
        str(tmp_path / "saved_dict")
    )
    return rows, jsonl, parquet, tmp_path / "saved", tmp_path / "saved_dict"


def test_folders_train_like_the_same_records_in_jsonl(tmp_path, sources):
    rows, jsonl, *folders = sources
    plans, corpora = [], []
    for source in (jsonl, *folders):
        cfg, run_dir = validate_for_up(config(tmp_path, source), str(tmp_path / f"run-{source.name}"))
        plans.append(plan_data(cfg, run_dir, 2))
        corpora.append(load_corpus(cfg.data, config_tokenizer(cfg), None))
    assert [p.samples for p in plans] == [len(rows)] * 4
    for c in corpora[1:]:
        assert c.tokens.tolist() == corpora[0].tokens.tolist() and c.loss_mask.tolist() == corpora[0].loss_mask.tolist()


def test_a_rewritten_shard_invalidates_the_token_cache(tmp_path, sources):
    _, _, parquet, *_ = sources
    cfg, _ = validate_for_up(config(tmp_path, parquet), str(tmp_path / "run"))
    tok, cache = config_tokenizer(cfg), tmp_path / "cache"
    first = load_corpus(cfg.data, tok, cache)
    assert load_corpus(cfg.data, tok, cache).report.loaded_from_cache
    pq.write_table(pa.Table.from_pylist(chats(5, "new")), parquet / "part-1.parquet")
    os.utime(parquet, ns=(0, 0))  # the folder's own stamp unchanged: only the shard's tells
    changed = load_corpus(cfg.data, tok, cache)
    assert not changed.report.loaded_from_cache and changed.num_samples == 7 + 5
    assert changed.tokens.tolist() != first.tokens.tolist()


def test_a_folder_of_neither_kind_is_refused_naming_its_key(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("no data here")
    path = config(tmp_path, tmp_path / "empty")
    with pytest.raises(ConfigError, match=r"data\.paths\[0\]: .*empty: a folder with neither \*\.parquet files nor a saved datasets"):
        validate_for_up(path, str(tmp_path / "run"))
