"""``dflash-ipc bench gen-decode``: gen-data's KV-cache modes timed against the dynamic cache on a real (random)
SmolLM2-shaped model, and the budget rule that picks a mode for a gen-data run."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dflash_ipc.bench.gen_decode import pick_decode
from dflash_ipc.cli import main


def test_the_bench_times_each_mode_against_dynamic_with_the_same_greedy_ids(tmp_path):
    out = tmp_path / "gen_decode.json"
    args = ["bench", "gen-decode", "--layers", "1", "--device", "cpu", "--dtype", "float32", "--batch-sizes", "3", "--max-new", "4"]
    args += ["--batches", "1", "--modes", "dynamic,static", "--prompt-len", "5,9", "--out", str(out), "--json"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    result = json.loads(r.output.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == result
    dyn, static = result["rows"]
    assert (dyn["mode"], static["mode"]) == ("dynamic", "static")
    assert dyn["samples_per_s"] > 0 and static["ratio_vs_dynamic"] > 0
    assert static["same_ids_as_dynamic"] is True  # fp32 on the CPU: the static cache decodes the same greedy ids
    assert "pick" not in result


def test_the_bench_refuses_an_unknown_mode_before_building_a_model():
    r = CliRunner().invoke(main, ["bench", "gen-decode", "--device", "cpu", "--modes", "dynamic,turbo"])
    assert r.exit_code == 2 and "unknown ['turbo']" in r.output


def test_compiled_is_picked_only_when_it_answers_more_within_the_budget_after_its_compiles():
    rows = [
        {"mode": "dynamic", "batch_size": 8, "samples_per_s": 100.0, "warmup_s": 1.0},
        {"mode": "compiled", "batch_size": 8, "samples_per_s": 200.0, "warmup_s": 20.0},
    ]
    assert pick_decode(rows, 8, budget_s=400, graphs=4)[0] == "compiled"  # 200 * 320 = 1.6x of 100 * 400
    assert pick_decode(rows, 8, budget_s=100, graphs=4)[0] == "dynamic"  # the compiles eat 80 of 100 s
    assert pick_decode(rows, 8, budget_s=400, graphs=4, min_gain=2.0)[0] == "dynamic"
    mode, why = pick_decode(rows, 16, budget_s=400)
    assert mode == "dynamic" and "no dynamic and compiled rows at batch 16" in why
