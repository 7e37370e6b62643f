"""Shared test plumbing: GPU skips in one place, and run configs written from dicts.

Markers (registered in pyproject.toml):

* ``gpu``: needs CUDA; ``gpu(2)``: needs at least two CUDA GPUs. Skipped here, with the reason,
  when the machine has fewer; ``-m gpu`` selects both.
* ``faults_full``: the long trials of tests/faults/, skipped unless DFLASH_IPC_FAULTS_FULL=1.
* ``slow``: spawns process groups (``dflash-ipc up``, torch.distributed ranks).
* ``own_forkserver``: runs without the worker's shared fork server (``shared_forkserver``): the test
  asserts the product's own server lifecycle or counts the supervisor's process tree.

pytest-xdist (``-n 2``, the README's command): ``worker_scope`` says which tests go to one worker
together (a module, the shared run's readers); ``check_worker_scopes`` refuses a layout that would
build a module fixture or the shared run on both workers.

Run configs: tests build them as dicts (``tiny_cpu_config(data={...})``) and write them with
``write_toml``; test modules import these with ``from conftest import ...`` (tests/ has no
``__init__.py``, so pytest's default import mode puts it on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import faulthandler
import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import torch

REPO = Path(__file__).resolve().parents[1]
TINY_CPU = REPO / "configs" / "tiny-cpu.toml"


def pytest_configure(config: pytest.Config) -> None:
    # Two pytest-xdist workers on a 2-core machine: torch's default of one intra-op thread per core
    # in each worker oversubscribes the cores (their OpenMP threads spin while they wait for a core).
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    check_worker_scopes(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):  # both workers collect; the scheduler hands out scopes in this order
        items[:] = longest_first(items)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    full_faults = bool(os.environ.get("DFLASH_IPC_FAULTS_FULL"))
    for item in items:
        if item.get_closest_marker("faults_full") is not None and not full_faults:
            item.add_marker(pytest.mark.skip(reason="long fault trial: set DFLASH_IPC_FAULTS_FULL=1 (docs/FAULTS.md)"))
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = int(marker.args[0]) if marker.args else 1
        if have < need:
            what = "CUDA" if need == 1 else f"{need} CUDA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"needs {what} (this machine has {have})"))


# --------------------------------------------------------------------------- pytest-xdist workers

#: The modules that read the session's shared run (one `up` process group): one worker runs them all.
SHARED_RUN_MODULES = frozenset(
    {"tests/end_to_end/test_up.py", "tests/runtime/test_progress.py", "tests/cli/test_tensorboard.py", "tests/drafter/test_holdout.py"}
)
#: Modules of long, independent process-group tests (no fixture shared between tests): each test may
#: go to either worker, so two of them never queue behind each other on one.
SPLIT_MODULES = frozenset(
    {
        "tests/end_to_end/test_multinode.py",
        "tests/faults/test_multinode_faults.py",
        "tests/faults/test_crash_anywhere.py",
        "tests/faults/test_group_signal.py",
        "tests/end_to_end/test_topology_5t3d.py",
        "tests/bench/test_bench_pipeline.py",
        "tests/transport/test_transport_nccl.py",
    }
)


#: The longest worker scopes (measured with --durations on 2 cores), started first: handed out in
#: collection order, a long scope coming late would leave one worker running it alone at the end.
LONGEST_FIRST = (
    "tests/end_to_end/test_multinode.py",
    "tests/end_to_end/test_up.py",  # the shared run's scope (with the other SHARED_RUN_MODULES)
    "tests/faults/test_bad_configs.py",
    "tests/faults/test_soak.py",
    "tests/eval/test_eval_sampling.py",
    "tests/drafter/test_loops.py",
    "tests/transport/test_transport_procs.py",
    "tests/faults/test_crash_anywhere.py",
    "tests/bench/test_drafter_step.py",
    "tests/faults/test_multinode_faults.py",
    "tests/bench/test_bench_pipeline.py",
    "tests/faults/test_hostile_peers.py",
)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """``items`` with the worker scopes of LONGEST_FIRST's modules first, in its order; every scope's
    tests stay together and in their order, the other scopes in collection order."""
    missing = [m for m in LONGEST_FIRST if not (REPO / m).is_file()]
    if missing:
        raise pytest.UsageError(f"tests/conftest.py: LONGEST_FIRST names no test module: {missing}")
    first = {worker_scope(m): i for i, m in enumerate(LONGEST_FIRST)}
    rank: dict[str, int] = {}
    for item in items:
        scope, module = worker_scope(item.nodeid), item.nodeid.split("::", 1)[0]
        rank[scope] = min(rank.get(scope, len(first)), first.get(worker_scope(module), len(first)))
    by_scope: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_scope.setdefault(worker_scope(item.nodeid), []).append(item)
    return [item for scope in sorted(by_scope, key=rank.__getitem__) for item in by_scope[scope]]


def worker_scope(nodeid: str) -> str:
    """What pytest-xdist (``-n 2``) sends to one worker as a unit: a whole module by default (its
    module-scoped fixtures are built once), the shared run's readers together, a test of
    SPLIT_MODULES alone. The order: LONGEST_FIRST, then the collection order."""
    module = nodeid.split("::", 1)[0]
    if module in SHARED_RUN_MODULES:
        return "shared-run"
    return nodeid if module in SPLIT_MODULES else module


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class FixtureScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_scope(nodeid)

    config.option.loadscopereorder = False  # by test count, the few long process-group tests would come last
    return FixtureScopeScheduling(config, log)


#: Session fixtures worth building once per run (a process group); a cheap one (tiny_llama) may be built per worker.
ONE_WORKER_SESSION_FIXTURES = frozenset({"shared_run"})


def check_worker_scopes(items: list[pytest.Item]) -> None:
    """Every test that shares a module-scoped fixture (or one of ONE_WORKER_SESSION_FIXTURES) with another must
    fall in the same worker scope, or pytest-xdist would build that fixture (a process group,
    perhaps) on both workers: say which module to add to SHARED_RUN_MODULES or remove from
    SPLIT_MODULES."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        for name, fixture_defs in info.name2fixturedefs.items() if info else ():
            fixture = fixture_defs[-1]  # builtin fixtures (tmp_path_factory) have baseid ""
            one_worker = fixture.scope in ("module", "package") or name in ONE_WORKER_SESSION_FIXTURES
            if one_worker and fixture.baseid.startswith("tests"):
                parent[find(item.nodeid)] = find(f"{fixture.baseid}:{name}")
    scopes: dict[str, set[str]] = {}
    for item in items:
        if item.nodeid in parent:
            scopes.setdefault(find(item.nodeid), set()).add(worker_scope(item.nodeid))
    split = {root: sorted(found) for root, found in scopes.items() if len(found) > 1}
    if split:
        raise pytest.UsageError(f"tests sharing a fixture fall in different pytest-xdist scopes (tests/conftest.py: worker_scope): {split}")


# --------------------------------------------------------------------------- one fork server per worker

_SHARED_FORKSERVER = pytest.StashKey[dict]()


@pytest.fixture(scope="session", autouse=True)
def shared_forkserver(pytestconfig: pytest.Config) -> Iterator[str | None]:
    """One preloading fork server per worker that every `up` of the session forks its children from
    (DFLASH_IPC_SHARED_FORKSERVER, runtime/forkserver.py's test/debug switch), instead of each `up`
    importing torch in a server of its own (~5 CPU-s). Setting the variable beforehand (empty: off) wins."""
    from dflash_ipc.runtime.forkserver import SHARED_FORKSERVER_ENV, ForkServer, up_preload
    from dflash_ipc.runtime.launch import child_env

    if SHARED_FORKSERVER_ENV in os.environ:
        yield os.environ[SHARED_FORKSERVER_ENV] or None
        return
    # Inductor sets TORCHINDUCTOR_CACHE_DIR in os.environ the first time it looks for its cache (importing
    # some test modules does, an in-process torch.compile does): set after the server started, every later
    # `up` of this worker would refuse the server (its preload read another value) and preload its own.
    with contextlib.suppress(ImportError):
        from torch._inductor.runtime.cache_dir_utils import cache_dir

        cache_dir()
    try:
        server = ForkServer.start_shared(up_preload(), child_env())
    except RuntimeError as e:  # e.g. a GPU host where a preloaded module initializes CUDA: each up starts its own launcher
        print(f"\n[conftest] no shared fork server: {e}", file=sys.stderr)
        yield None
        return
    path = server.listen_path
    state = pytestconfig.stash.setdefault(_SHARED_FORKSERVER, {})
    state["path"] = path
    if not state.get("own"):
        os.environ[SHARED_FORKSERVER_ENV] = path
    try:
        yield path
    finally:
        state["path"] = None
        os.environ.pop(SHARED_FORKSERVER_ENV, None)
        server.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """An ``own_forkserver`` test runs (its fixtures too) without the shared fork server's variable."""
    if item.get_closest_marker("own_forkserver") is None:
        return (yield)
    from dflash_ipc.runtime.forkserver import SHARED_FORKSERVER_ENV

    state = item.config.stash.setdefault(_SHARED_FORKSERVER, {})
    saved = os.environ.pop(SHARED_FORKSERVER_ENV, None)
    state["own"] = True
    try:
        return (yield)
    finally:
        state["own"] = False
        value = state.get("path", saved)  # the fixture's (None once torn down), else what was set by hand
        if value:
            os.environ[SHARED_FORKSERVER_ENV] = value


# --------------------------------------------------------------------------- TOML from dicts


def toml_text(data: dict[str, Any]) -> str:
    """TOML for a config dict (tomli-w; inf and nan written as TOML inf / nan, so bad values reach the loader as written)."""
    return tomli_w.dumps(data)


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(toml_text(data))
    return path


@functools.cache
def _tiny_cpu() -> dict[str, Any]:
    return tomllib.loads(TINY_CPU.read_text())


def _merge_sections(raw: dict[str, Any], sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    for section, table in sections.items():
        raw.setdefault(section, {}).update(table)
    return raw


def tiny_cpu_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """configs/tiny-cpu.toml as a fresh dict, each ``section={key: value}`` merged into it."""
    return _merge_sections(copy.deepcopy(_tiny_cpu()), sections)


def up_argv(config: Path, run_dir: Path, max_steps: int) -> list[str]:
    return [sys.executable, "-m", "dflash_ipc.cli", "up", "--config", str(config), "--max-steps", str(max_steps), "--run-dir", str(run_dir)]


def run_up(config: Path, run_dir: Path, max_steps: int, cwd: Path) -> subprocess.CompletedProcess:
    """`dflash-ipc up` to completion in a subprocess (not a TTY), its output captured as text."""
    argv = up_argv(config, run_dir, max_steps)
    return subprocess.run(argv, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600, cwd=cwd)


def free_port() -> int:
    """A loopback port free at the moment of asking (the rendezvous of a test's process group)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What every rank of spawn_ranks imports (torch.distributed, the drafter's core and trainer), imported once.
RANK_PRELOAD = ["torch", "torch.distributed", "transformers", "dflash_ipc.drafter.core", "dflash_ipc.drafter.training.trainer"]


def spawn_ranks(fn: Any, args: tuple, nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` with its ranks forked from multiprocessing's
    fork server, which imported RANK_PRELOAD once, instead of each rank a new Python importing torch
    (seconds of CPU per rank). The server is the test process's (one per pytest-xdist worker; eval's
    worker pool shares it, with whichever preload list came first); each rank still runs ``fn`` in a
    process of its own, unpickled by name, and a rank's exception fails the test as with spawn."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


@contextlib.contextmanager
def process_group_rank(rank: int, port: int, backend: str = "gloo", timeout_s: float = 120.0) -> Iterator[Any]:
    """One rank of a two-rank test process group, started by :func:`spawn_ranks`.

    faulthandler is on, because spawn reports a rank that a C++ abort ends only by its signal
    (the one CI failure of this kind, a SIGABRT "terminate called without an active exception",
    left no stack). A rank that finished its body meets the other at a barrier before the group
    is destroyed: no rank tears its connections down while the peer's last collective is still
    in flight. A rank that raised skips the barrier (the peer may never come)."""
    from dflash_ipc.drafter.training.distributed import init_distributed

    faulthandler.enable()
    if backend == "gloo":
        torch.set_num_threads(1)  # two ranks on a 2-core machine
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    world = init_distributed(backend, timeout_s)
    finished = False
    try:
        yield world
        finished = True
    finally:
        if finished:
            world.barrier()
        torch.distributed.destroy_process_group()


# test_up's runs: configs/tiny-cpu.toml made smaller (300 samples of <= 128 tokens in 512-token batches:
# 69 batches over 2 target shards, ~35 steps to exhaust the data), every step of a run not a checkpoint.
SMALL_RUN = {
    "data": {"builtin_samples": 300, "max_seq_len": 128, "bucket_edges": [64, 128], "token_budget": 512},
    "run": {"teardown_grace_s": 3.0},
    "training": {"checkpoint_every": 0, "max_steps": 0},
}
SHARED_RUN_STEPS = 12
# The shared run's drafters follow their wait (drafter.anchor_budget): 32 anchors per batch at first,
# one chunk of 16 per 2-step window after the 4 + 2 settle steps, at most 64.
FOLLOW_WAIT = {"anchor_budget": "follow-wait", "anchor_chunk": 16, "max_anchors_per_batch": 32, "max_anchors_auto": 64, "anchor_window": 2}


def holdout_file(directory: Path, after: int) -> Path:
    """Chat records the training data (the first ``after`` built-in conversations) does not hold."""
    from dflash_ipc.data.builtin_corpus import builtin_conversations

    path = directory / "gen.holdout.jsonl"
    recs = builtin_conversations(after + 60, 256)[after:]
    path.write_text("".join(json.dumps({"id": f"h{i}", **r}) + "\n" for i, r in enumerate(recs)))
    return path


def small_run_config(**sections: dict[str, Any]) -> dict[str, Any]:
    """SMALL_RUN over configs/tiny-cpu.toml, each ``section={key: value}`` merged into it."""
    return _merge_sections(tiny_cpu_config(**SMALL_RUN), sections)


def tensorboard_config(path: Path, tensorboard: bool = True) -> Path:
    """configs/tiny-cpu.toml as it is, with run.tensorboard set."""
    return write_toml(path, tiny_cpu_config(run={"tensorboard": tensorboard}))


@dataclasses.dataclass(frozen=True)
class SharedRun:
    """A finished `dflash-ipc up` that several test modules read."""

    config: Path
    run_dir: Path
    pid: int  # the supervisor's
    returncode: int
    output: str  # stdout + stderr, not a TTY


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory) -> SharedRun:
    """One `dflash-ipc up --max-steps SHARED_RUN_STEPS` of the SMALL_RUN config that four modules
    read, instead of one process group each (a run costs ~45 CPU-s on 2 cores): test_up's full run
    (trains, checkpoints, exports, status, a lean supervisor, follow-wait anchors), test_progress
    (plain progress lines without a TTY), test_tensorboard (event files beside metrics.jsonl) and
    test_holdout (held-out passes every 3 steps with two drafters: scored, never trained on).
    No property read depends on another's setting. TensorBoard is on when its optional package
    imports; the debug switch makes the supervisor say at exit which heavy modules it imported."""
    work = tmp_path_factory.mktemp("shared-run")
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    holdout = {"holdout_paths": [str(holdout_file(work, SMALL_RUN["data"]["builtin_samples"]))]}
    passes = {"holdout_every": 3, "holdout_batches": 2}
    # the drafters warm up (configs/tiny-cpu.toml turns it off on CPU): one run proves the shell's branch
    raw = small_run_config(drafter=FOLLOW_WAIT | {"warm_up": True}, run={"tensorboard": tensorboard}, data=holdout, training=passes)
    config = write_toml(work / "full.toml", raw)
    run_dir = work / "full"
    out_path = work / "full.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            up_argv(config, run_dir, SHARED_RUN_STEPS),
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=work,
            env={**os.environ, "DFLASH_IPC_DEBUG_IMPORTS": "1"},
        )
        try:
            code = proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    return SharedRun(config, run_dir, proc.pid, code, out_path.read_text(errors="replace"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """A random 4-layer Llama checkpoint over the built-in tokenizer's 1,024 ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("llama")
    conf = LlamaConfig(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.3,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(conf).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory) -> Callable[[str], Path]:
    """``family_checkpoint(name)``: the directory of family ``name``'s tiny checkpoint (tests/families/family_zoo.py),
    built once per pytest worker, on first use."""
    import transformers
    from families.family_zoo import build_checkpoint

    root = tmp_path_factory.mktemp("families")

    def checkpoint(name: str) -> Path:
        try:
            return build_checkpoint(name, root)
        except AttributeError as e:  # a family newer than this transformers (the GPU image pins an older one)
            pytest.skip(f"transformers {transformers.__version__} cannot build {name}: {e}")

    return checkpoint


def supervised_runs(tok, ids, mask) -> list[str]:
    """Decoded maximal runs of consecutive supervised tokens of a sample (``ids``, ``mask``: tensors)."""
    runs, cur = [], []
    for t, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]
