"""Status snapshot: typed validation and the table / Prometheus / JSON renderings."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families
from status_examples import example_status

from dflash_ipc.control.protocol import ProtocolError, to_wire
from dflash_ipc.control.status import StatusSnapshot, decode_status
from dflash_ipc.ops import status_view as sv
from dflash_ipc.ops.prometheus import render_prometheus
from dflash_ipc.rundir.fsutil import write_text_atomic

NOW = 1_800_000_000.0


@pytest.fixture
def status() -> StatusSnapshot:
    return example_status(2, 3, now=NOW)


def edit(status: StatusSnapshot, change) -> StatusSnapshot:
    """The snapshot with ``change(wire_dict)`` applied, decoded (and so validated) again."""
    wire = to_wire(status)
    change(wire)
    return decode_status(wire)


def wire_with(status: StatusSnapshot, path: tuple, value) -> dict:
    wire = to_wire(status)
    obj = wire
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value
    return wire


# --------------------------------------------------------------------------- a strict exposition parser

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r"[a-zA-Z_][a-zA-Z0-9_]*"
_SAMPLE = re.compile(rf"^({_NAME})(\{{.*\}})? (\S+)$")
_VALUE = re.compile(r"^(NaN|[+-]Inf|[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?)$")


def _parse_labels(text: str) -> dict[str, str]:
    assert text[0] == "{" and text[-1] == "}", text
    body, i, out = text[1:-1], 0, {}
    while i < len(body):
        m = re.match(rf"({_LABEL})=\"", body[i:])
        assert m, f"bad label at {body[i:]!r}"
        name = m.group(1)
        assert not name.startswith("__") and name not in out, name
        i += m.end()
        val = []
        while True:
            assert i < len(body), f"unterminated label value in {text!r}"
            c = body[i]
            if c == "\\":
                nxt = body[i + 1]
                assert nxt in '\\"n', f"bad escape \\{nxt}"
                val.append({"\\": "\\", '"': '"', "n": "\n"}[nxt])
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                assert c != "\n"
                val.append(c)
                i += 1
        out[name] = "".join(val)
        if i < len(body):
            assert body[i] == ",", f"expected ',' in {text!r}"
            i += 1
            assert i < len(body), "trailing comma"
    return out


def parse_exposition(text: str) -> dict[str, dict]:
    """Families {name: {"help": str, "type": str, "samples": [(labels, value)]}}; asserts the
    text format rules: HELP/TYPE before samples, one family block each, no duplicate series."""
    assert text.endswith("\n")
    families: dict[str, dict] = {}
    current = None
    closed: set[str] = set()
    for line in text[:-1].split("\n"):
        assert line, "empty line"
        if line.startswith("# HELP "):
            name, _, help_text = line[7:].partition(" ")
            assert re.fullmatch(_NAME, name) and name not in families, line
            if current:
                closed.add(current)
            families[name] = {"help": help_text, "type": None, "samples": []}
            current = name
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            assert name == current and families[name]["type"] is None and not families[name]["samples"], line
            assert typ in ("gauge", "counter", "untyped", "summary", "histogram"), line
            families[name]["type"] = typ
        elif line.startswith("#"):
            continue
        else:
            m = _SAMPLE.match(line)
            assert m, f"bad sample line {line!r}"
            name, labels, value = m.groups()
            assert name == current and name not in closed, f"sample outside its family: {line!r}"
            assert families[name]["type"] is not None, f"no TYPE before {line!r}"
            assert _VALUE.match(value), f"bad value {value!r}"
            lbl = _parse_labels(labels) if labels else {}
            key = tuple(sorted(lbl.items()))
            assert key not in {tuple(sorted(s.items())) for s, _ in families[name]["samples"]}, f"dup {line!r}"
            families[name]["samples"].append((lbl, float(value)))
    return families


def test_parser_rejects_bad_text():
    for bad in (
        "x 1\n",
        '# HELP a h\n# TYPE a gauge\na{b="1} 1\n',
        "# HELP a h\n# TYPE a gauge\na 1\na 2\n",
        "# HELP a h\n# TYPE a gauge\na one\n",
    ):
        with pytest.raises(AssertionError):
            parse_exposition(bad)


# --------------------------------------------------------------------------- validation


def test_example_round_trips_through_json(status):
    assert decode_status(json.loads(json.dumps(to_wire(status)))) == status
    assert decode_status(to_wire(example_status(1, 1, now=NOW))) == example_status(1, 1, now=NOW)


@pytest.mark.parametrize(
    "path, expect",
    [
        (("state",), "missing_field: status.state missing"),
        (("totals", "eta_s"), "missing_field: status.totals.eta_s missing"),
        (("processes", 1, "heartbeat_age_s"), "missing_field: status.processes[1].heartbeat_age_s missing"),
        (("processes", 0, "slots", "ready"), "missing_field: status.processes[0].slots.ready missing"),
    ],
)
def test_a_missing_field_names_its_dotted_path(status, path, expect):
    wire = to_wire(status)
    obj = wire
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]
    with pytest.raises(ProtocolError) as e:
        decode_status(wire)
    assert str(e.value) == expect


def test_a_renamed_nested_key_is_rejected_not_read_as_none(status):
    wire = to_wire(status)
    p = wire["processes"][3]
    p["heartbeat_age"] = p.pop("heartbeat_age_s")
    with pytest.raises(ProtocolError, match=r"status\.processes\[3\]\.heartbeat_age_s missing"):
        decode_status(wire)
    p["heartbeat_age_s"] = 1.0  # both: the stray key alone is still refused
    with pytest.raises(ProtocolError, match=r"unknown_field: status\.processes\[3\] has unknown fields \['heartbeat_age'\]"):
        decode_status(wire)


@pytest.mark.parametrize(
    "path, value, expect",
    [
        (("supervisor_pid",), "123", "bad_field_type: status.supervisor_pid"),
        (("supervisor_pid",), True, "bad_field_type: status.supervisor_pid"),
        (("updated_unix",), "now", "bad_field_type: status.updated_unix"),
        (("updated_unix",), None, "bad_field_type: status.updated_unix"),
        (("schema",), 2, "out_of_range: status: schema must be 1"),
        (("state",), "paused", "out_of_range: status: state must be one of"),
        (("run_dir",), 5, "bad_field_type: status.run_dir"),
        (("totals", "step"), 1.5, "bad_field_type: status.totals.step"),
        (("totals", "max_steps"), "10", "bad_field_type: status.totals.max_steps"),
        (("totals", "tokens_per_s"), -1.0, "out_of_range: status.totals: tokens_per_s must be finite and >= 0"),
        (("totals", "tokens_per_s"), float("nan"), "out_of_range: status.totals: tokens_per_s must be finite"),
        (("processes", 0, "role"), "teacher", "out_of_range: status.processes[0]: role must be one of"),
        (("processes", 0, "rank"), -1, "out_of_range: status.processes[0].rank = -1 < 0"),
        (("processes", 0, "slots"), [1, 2, 3, 4], "bad_field_type: status.processes[0].slots is list"),
        (("processes", 0, "slots", "free"), "1", "bad_field_type: status.processes[0].slots.free"),
        (("processes", 0, "inflight_per_drafter"), [1, "2"], "bad_field_type: status.processes[0].inflight_per_drafter[1]"),
        (("processes", 0, "inflight_per_drafter"), 3, "bad_field_type: status.processes[0].inflight_per_drafter is int"),
        (("processes", 2, "busy_pct"), 150.0, "out_of_range: status.processes[2]: busy_pct must be in [0, 100]"),
        (("processes", 2, "rejected_messages"), None, "bad_field_type: status.processes[2].rejected_messages"),
        (("processes", 2, "rejected_by_kind"), {"undecodable": "2"}, "bad_field_type: status.processes[2].rejected_by_kind.undecodable"),
        (("processes", 2, "device"), "", "out_of_range: status.processes[2]: device and state must not be empty"),
        (("processes", 2, "exit_code"), "1", "bad_field_type: status.processes[2].exit_code"),
        (("processes",), {}, "bad_field_type: status.processes is dict"),
        (("totals",), None, "bad_field_type: status.totals is NoneType"),
    ],
)
def test_mistyped_fields_name_their_dotted_path(status, path, value, expect):
    with pytest.raises(ProtocolError) as e:
        decode_status(wire_with(status, path, value))
    assert str(e.value).startswith(expect), str(e.value)


def test_optional_fields_accept_null_and_ints_for_floats(status):
    def change(w):
        for k in ("max_steps", "loss", "eta_s"):
            w["totals"][k] = None
        p = w["processes"][0]
        for k in (
            "pid",
            "heartbeat_age_s",
            "slots",
            "inflight_per_drafter",
            "gpu_mem_allocated_bytes",
            "gpu_mem_reserved_bytes",
            "rss_bytes",
            "busy_pct",
            "wait_pct",
            "exit_code",
        ):
            p[k] = None
        p["uptime_s"] = 5  # int where float is expected
        w["processes"][2]["loss"] = float("nan")  # a diverged loss is reportable

    s = edit(status, change)
    assert s.processes[0].uptime_s == 5.0 and type(s.processes[0].uptime_s) is float
    assert math.isnan(s.processes[2].loss) and s.totals.max_steps is None


def test_unknown_keys_duplicates_and_non_objects(status):
    with pytest.raises(ProtocolError, match=r"unknown_field: status has unknown fields \['extra'\]"):
        edit(status, lambda w: w.update(extra=1))
    with pytest.raises(ProtocolError, match=r"status: processes\[4\]: duplicate drafter rank 1"):
        edit(status, lambda w: w["processes"][4].update(rank=1))
    with pytest.raises(ProtocolError, match="started_unix is later"):
        edit(status, lambda w: w.update(started_unix=NOW + 1))
    for bad in ([], None, "x"):
        with pytest.raises(ProtocolError, match="bad_field_type: status is"):
            decode_status(bad)


# --------------------------------------------------------------------------- prometheus

TARGET_ONLY = {"process_slots_free", "process_slots_filling", "process_slots_ready", "process_slots_copying", "process_inflight_slots"}
DRAFTER_ONLY = {"process_queue_depth", "process_step", "process_loss", "process_anchors_per_batch"}
DRAFTER0_ONLY = {"process_tau_holdout"}  # the held-out passes go to drafter 0


def test_prometheus_parses_with_one_sample_per_process(status):
    text = render_prometheus(status)
    fams = parse_exposition(text)
    # the reference parser reads the same families and values
    lib = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(lib) == set(fams)
    assert all(name.startswith("dflash_ipc_") for name in fams)
    assert all(f["type"] == "gauge" and f["help"] for f in fams.values())
    procs = {(p.role, str(p.rank), p.device) for p in status.processes}
    per_process = [n for n in fams if n.startswith("dflash_ipc_process_") and n != "dflash_ipc_process_inflight_to_drafter"]
    assert len(per_process) >= 15
    for name in per_process:
        short = name[len("dflash_ipc_") :]
        seen = [(s["role"], s["rank"], s["device"]) for s, _ in fams[name]["samples"]]
        assert len(seen) == len(set(seen)), name  # at most one sample per process
        expected = {
            p for p in procs if not (short in TARGET_ONLY and p[0] == "drafter") and not (short in DRAFTER_ONLY and p[0] == "target")
        }
        if short == "process_exit_code":
            expected = set()  # nothing has exited
        if short in DRAFTER0_ONLY:
            expected = {p for p in procs if p[:2] == ("drafter", "0")}
        assert set(seen) == expected, name
        for labels, _ in fams[name]["samples"]:
            assert set(labels) - {"state"} == {"role", "rank", "device"}, labels
    inflight = fams["dflash_ipc_process_inflight_to_drafter"]["samples"]
    assert len(inflight) == 2 * 3 and {s["drafter"] for s, _ in inflight} == {"0", "1", "2"}
    state = {s["state"]: v for s, v in fams["dflash_ipc_state"]["samples"]}
    assert state == {"preparing": 0, "starting": 0, "running": 1, "stopping": 0, "finished": 0, "stopped": 0, "failed": 0, "lost": 0}
    assert fams["dflash_ipc_step"]["samples"] == [({}, 1234.0)]
    assert [s.value for s in lib["dflash_ipc_step"].samples] == [1234.0]
    busy = {s["rank"]: v for s, v in fams["dflash_ipc_process_busy_ratio"]["samples"] if s["role"] == "target"}
    assert busy == {"0": 0.91, "1": 0.91}


def test_prometheus_values_escapes_and_absent_samples(status):
    def change(w):
        w["run_dir"] = 'C:\\runs\n"x"'
        w["processes"][0]["device"] = 'cuda:"0"'
        w["processes"][2]["loss"] = float("nan")
        w["processes"][3]["loss"] = float("inf")
        w["processes"][4]["exit_code"] = 137
        w["processes"][4]["pid"] = None
        w["processes"][1]["rejected_messages"] = 3
        w["processes"][1]["rejected_by_kind"] = {"undecodable": 2, "out_of_range": 1}
        w["totals"]["max_steps"] = None

    s = edit(status, change)
    text = render_prometheus(s, extra_labels={"run": "my\\run"})
    fams = parse_exposition(text)
    lib = {f.name: f for f in text_string_to_metric_families(text)}
    ((info_labels, _),) = fams["dflash_ipc_info"]["samples"]
    assert info_labels["run_dir"] == 'C:\\runs\n"x"' and info_labels["run"] == "my\\run"
    assert lib["dflash_ipc_info"].samples[0].labels["run_dir"] == 'C:\\runs\n"x"'
    devices = {lbl["device"] for lbl, _ in fams["dflash_ipc_process_up"]["samples"]}
    assert 'cuda:"0"' in devices
    losses = {lbl["rank"]: v for lbl, v in fams["dflash_ipc_process_loss"]["samples"]}
    assert math.isnan(losses["0"]) and losses["1"] == math.inf
    assert "dflash_ipc_max_steps" not in fams  # None: no sample, no family
    assert fams["dflash_ipc_process_exit_code"]["samples"] == [
        ({"run": "my\\run", "role": "drafter", "rank": "2", "device": "cuda:4"}, 137.0)
    ]
    kinds = {lbl["kind"]: v for lbl, v in fams["dflash_ipc_process_rejected_by_kind"]["samples"]}
    assert kinds == {"undecodable": 2.0, "out_of_range": 1.0}
    up = {(lbl["role"], lbl["rank"]): v for lbl, v in fams["dflash_ipc_process_up"]["samples"]}
    assert up[("drafter", "2")] == 0 and up[("target", "0")] == 1
    assert len(fams["dflash_ipc_process_pid"]["samples"]) == 4
    with pytest.raises(ValueError):
        render_prometheus(s, extra_labels={"role": "x"})
    with pytest.raises(ValueError):
        render_prometheus(s, extra_labels={"bad-name": "x"})


# --------------------------------------------------------------------------- table


def test_table_has_every_process_and_totals(status):
    text = sv.render_table(status, now=NOW + 2)
    for p in status.processes:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"{p.role}{p.rank} "))
        assert str(p.pid) in line and p.device in line
    assert "RUNNING" in text and "updated 2.0s ago" in text
    assert "TOTAL  18.2k tok/s  step 1,234/10,000 (12.3%)  loss 2.346" in text
    assert "30.0/34.0G" in text and "q1 s1234" in text and "1/1/1/1 i3" in text
    assert "\nTRAIN  anchors/batch 6,144  held-out tau 3.78\n" in text
    assert "!" not in text  # nothing to warn about
    assert all(len(ln) <= 100 for ln in text.splitlines())
    plain = dataclasses.replace(
        status, processes=[dataclasses.replace(p, anchors_per_batch=None, tau_holdout=None) for p in status.processes]
    )
    assert "TRAIN" not in sv.render_table(plain, now=NOW + 2)  # nothing to say: no line


def test_table_fits_100_columns_in_the_worst_case():
    def change(w):
        w["config"] = "/very/long/path/" + "x" * 150 + ".toml"
        w["run_dir"] = "/runs/" + "y" * 200
        w["totals"].update(
            tokens_per_s=987_654_321.0, step=12_345_678, max_steps=99_999_999, loss=1e-9, pipeline_rss_bytes=2**50, eta_s=9e7
        )
        for p in w["processes"]:
            p.update(
                pid=4_194_304,
                device="cuda:15",
                state="handshaking-forever",
                uptime_s=8.6e7,
                heartbeat_age_s=99_999.0,
                tokens_per_s=999_999.0,
                gpu_mem_allocated_bytes=140 * 2**30,
                gpu_mem_reserved_bytes=141 * 2**30,
                rss_bytes=1000 * 2**30,
                busy_pct=100.0,
                wait_pct=100.0,
                rejected_messages=10**9,
                rejected_by_kind={"undecodable": 10**9 - 1, "x" * 80: 1},
                exit_code=-9,
            )
            if p["role"] == "target":
                p.update(slots={"free": 64, "filling": 64, "ready": 64, "copying": 64}, inflight_per_drafter=[64] * 16)
            else:
                p.update(queue_depth=1000, step=12_345_678, loss=-123456.0)

    s = edit(example_status(8, 16, now=NOW), change)
    text = sv.render_table(s, now=NOW + 1e6)
    lines = text.splitlines()
    assert max(len(ln) for ln in lines) <= 100, "\n".join(ln for ln in lines if len(ln) > 100)
    assert "STALE" in text and "! target0 exited with code -9" in text
    assert sum(1 for ln in lines if re.match(r"(target|drafter)\d+ ", ln)) == 24


def test_table_warnings_and_edge_cases(status):
    def change(w):
        w["processes"][3].update(exit_code=1, state="exited", pid=None)
        w["processes"][1]["heartbeat_age_s"] = 42.0
        w["processes"][0].update(rejected_messages=3, rejected_by_kind={"undecodable": 3})
        w["processes"][4]["loss"] = float("nan")

    text = sv.render_table(edit(status, change), now=NOW)
    assert "! drafter1 exited with code 1" in text
    assert "! target1 last heartbeat 42s ago" in text
    assert "! target0 rejected 3 control message(s): undecodable 3" in text
    assert "! drafter2 loss is nan" in text
    empty = edit(example_status(0, 0, now=NOW), lambda w: w.update(state="starting"))
    text = sv.render_table(empty, now=NOW)
    assert "(no processes)" in text and "STARTING" in text


def test_formatters_stay_short():
    for exp in range(0, 64):
        for m in (1.0, 1.5, 9.99, 99.9, 999.4, 1000.0, 1023.9):
            n = int(m * 2**exp)
            assert len(sv.fmt_bytes(n)) <= 5, (n, sv.fmt_bytes(n))
    for exp in range(-3, 25):
        for m in (1.0, 9.994, 9.996, 99.94, 99.96, 999.4, 999.6):
            x = m * 10**exp
            assert len(sv.fmt_rate(x)) <= 5, (x, sv.fmt_rate(x))
            assert len(sv.fmt_loss(x)) <= 6 and len(sv.fmt_loss(-x)) <= 7, x
    for s in (0, 0.04, 9.94, 9.96, 59.4, 59.6, 3599.4, 3599.6, 86399.6, 999 * 86400 + 3599):
        assert len(sv.fmt_duration(s)) <= 6, (s, sv.fmt_duration(s))
    assert sv.fmt_bytes(1536) == "1.5K" and sv.fmt_bytes(12 * 2**30, long=True) == "12.0 GiB"
    assert sv.fmt_rate(18_200) == "18.2k" and sv.fmt_rate(999) == "999"
    assert sv.fmt_duration(3725) == "1h02m" and sv.fmt_duration(0.42) == "0.4s"


# --------------------------------------------------------------------------- json and dispatch


def test_json_round_trip_is_strict(status):
    s = edit(status, lambda w: w["processes"][2].update(loss=float("nan")))

    def refuse(c):
        raise AssertionError(f"non-standard JSON constant {c}")

    text = sv.render_json(s, indent=None)
    assert text.endswith("}\n") and text.count("\n") == 1
    back = json.loads(text, parse_constant=refuse)
    assert back["processes"][2]["loss"] is None
    back["processes"][2]["loss"] = 1.0
    assert decode_status(back) == edit(status, lambda w: w["processes"][2].update(loss=1.0))


def test_render_status_dispatch(status):
    assert sv.render_status(status, "json", indent=None).count("\n") == 1
    assert sv.render_status(status, "prometheus").startswith("# HELP dflash_ipc_")
    assert "PROC" in sv.render_status(status, "table", now=NOW)
    with pytest.raises(ValueError, match="unknown status format"):
        sv.render_status(status, "xml")


def test_atomic_write_leaves_no_temporary_file(tmp_path):
    # status.json and .prom files are read while being rewritten: the one writer is fsutil's
    target = tmp_path / "dflash.prom"
    write_text_atomic(target, "a\n")
    write_text_atomic(target, "b\n")
    assert target.read_text() == "b\n" and [p.name for p in tmp_path.iterdir()] == ["dflash.prom"]


@pytest.mark.parametrize("flag", ["--json", "--prometheus", None])
def test_status_cli_ends_in_exactly_one_newline(status, tmp_path, flag):
    """`dflash-ipc status --json | tail -1` is the whole JSON object (a real subprocess and pipe)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    status = dataclasses.replace(status, state="finished")  # a live state with no live supervisor reads as "lost"
    write_text_atomic(run_dir / "status.json", json.dumps(to_wire(status)))
    cmd = f"{sys.executable} -m dflash_ipc.cli status --run-dir {run_dir} {flag or ''}"
    full = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60, check=True).stdout
    assert full.endswith("\n") and not full.endswith("\n\n"), full[-40:]
    if flag == "--json":
        last = subprocess.run(cmd + " | tail -1", shell=True, capture_output=True, text=True, timeout=60, check=True).stdout
        assert decode_status(json.loads(last)) == status


def test_status_json_of_a_dead_supervisor_reads_lost(status, tmp_path):
    """status.json left "running" by a supervisor that was SIGKILLed: the reader says "lost"."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cli = [sys.executable, "-m", "dflash_ipc.cli", "status", "--run-dir", str(run_dir)]
    gone = dataclasses.replace(status, supervisor_pid=dead.pid, started_unix=time.time() - 5, updated_unix=time.time())
    write_text_atomic(run_dir / "status.json", json.dumps(to_wire(gone)))
    r = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1])["state"] == "lost"
    table = subprocess.run(cli, capture_output=True, text=True, timeout=60).stdout
    assert "LOST" in table and f"supervisor (pid {dead.pid}) is gone" in table
    # the same snapshot while its supervisor (this test process) lives reads as written
    alive = dataclasses.replace(status, supervisor_pid=os.getpid(), started_unix=time.time() - 1, updated_unix=time.time())
    write_text_atomic(run_dir / "status.json", json.dumps(to_wire(alive)))
    r = subprocess.run([*cli, "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(r.stdout.splitlines()[-1])["state"] == "running"


def _row(text: str, name: str) -> list[str]:
    return next(line.split() for line in text.splitlines() if line.startswith(name + " "))


def test_a_stopped_run_says_stopped_with_its_step_and_a_failed_one_why(status):
    stopped = edit(status, lambda w: w.update(state="stopped", end_reason="SIGINT at step 23", updated_unix=NOW - 5))
    text = sv.render_table(stopped, now=NOW)
    assert "STOPPED" in text and "FINISHED" not in text and "ended    SIGINT at step 23" in text
    assert "ran 1h02m" in text and "ended 5.0s ago" in text and "STALE" not in text
    failed = edit(status, lambda w: w.update(state="failed", end_reason="drafter-1 (pid 7) exit code 1"))
    assert "why      drafter-1 (pid 7) exit code 1" in sv.render_table(failed, now=NOW)
    finished = edit(status, lambda w: w.update(state="finished", end_reason="max_steps 40"))
    assert "FINISHED" in sv.render_table(finished, now=NOW) and "ended    max_steps 40" in sv.render_table(finished, now=NOW)


def test_a_live_run_is_as_old_as_its_start_not_its_last_snapshot(status):
    """A snapshot written when the run began preparing, read 4 s later: up 4.0s, not "up 0.0s updated 4.0s ago"."""
    preparing = edit(status, lambda w: w.update(state="preparing", started_unix=NOW - 4, updated_unix=NOW - 4))
    text = sv.render_table(preparing, now=NOW)
    assert "PREPARING" in text and "up 4.0s" in text and "up 0.0s" not in text


def test_exited_processes_show_no_live_fields(status):
    """Even a snapshot that still carries an exited target's slots and heartbeat (an older supervisor's)."""

    def change(w):
        w.update(state="finished")
        w["processes"][0].update(exit_code=0, state="exited")  # target0, its live figures left in
        w["processes"][2].update(exit_code=0, state="exited")  # drafter0

    text = sv.render_table(edit(status, change), now=NOW)
    target0, drafter0 = _row(text, "target0"), _row(text, "drafter0")
    assert target0[3:6] == ["exited", "0", "-"] and target0.count("-") >= 6, target0  # no UP, HB, TOK/S, WORK, GPU, RSS, B/W
    assert "1/1/1/1" not in " ".join(target0) and "0.4s" not in " ".join(target0)
    assert "s1234" in drafter0 and "2.346" in drafter0  # a drafter's last step and loss stay
    live = _row(text, "target1")
    assert "1/1/1/1" in " ".join(live)


def test_an_exited_childs_status_line_has_no_live_fields():
    """liveness.process_status: what the supervisor writes for a child that exited."""
    from types import SimpleNamespace

    from dflash_ipc.runtime.liveness import process_status

    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    ch = SimpleNamespace(role="target", rank=0, device="cpu", popen=done, stats=None, done=None, started=NOW - 10, last_beat=1.0)
    p = process_status(ch, NOW, 50.0)
    assert p.state == "exited" and p.exit_code == 0 and p.heartbeat_age_s is None and p.slots is None and p.rss_bytes is None
