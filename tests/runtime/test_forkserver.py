"""The preloading launcher (runtime.forkserver) on real processes: a forked child gets what
``subprocess.Popen`` would have given it (argv, env, log, the key's pipe at its number, nothing
else open, torch's thread count), its exit code or signal comes back, a SIGKILLed supervisor takes
the server and its children down, the server never initializes CUDA, and ``run.launcher`` is
validated. Whole runs of ``up`` fork their children this way by default on the CPU (test_up.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dflash_ipc.config import ConfigError, RunConfig, load_config
from dflash_ipc.runtime.forkserver import (
    CUDA_ERROR_NOT_INITIALIZED,
    IMPORTS_FLA,
    IMPORTS_TORCHAO,
    LOST_EXIT_CODE,
    UP_PRELOAD,
    ForkServer,
    nvidia_device_visible,
    up_preload,
    use_forkserver,
)
from dflash_ipc.runtime.launch import child_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.own_forkserver  # the product's own server lifecycle

CHILD = """
import json, os, sys

def is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False

fds = [fd for fd in sorted(map(int, os.listdir("/proc/self/fd"))) if is_open(fd)]  # listdir's own is closed by now
key_fd, code = int(sys.argv[1]), int(sys.argv[2])
preloaded = "torch" in sys.modules
import torch
import psutil
print(json.dumps({
    "argv": sys.argv[1:], "name": __name__, "var": os.environ.get("FS_TEST_VAR"), "cwd": os.getcwd(),
    "key": os.read(key_fd, 100).decode() if key_fd >= 0 else "", "ppid": os.getppid(), "fds": fds,
    "preloaded": preloaded, "threads": torch.get_num_threads(),
    "cmdline": " ".join(psutil.Process().cmdline()),
}), flush=True)  # before the stderr line whether or not the environment has PYTHONUNBUFFERED
print("a line on stderr", file=sys.stderr)
raise SystemExit(code)
"""

SLEEPER = """
import os, signal, sys, time
from dflash_ipc.runtime.launch import set_parent_death_signal
set_parent_death_signal(signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
print(os.getpid(), flush=True)
time.sleep(600)
"""

SUPERVISOR = """
import os, subprocess, sys, time
from dflash_ipc.runtime.forkserver import ForkServer
server = ForkServer.start([], dict(os.environ))
child = server.popen([sys.executable, "-m", "fs_sleeper", str(server.pid)], stdout=open(sys.argv[1], "ab"))
print(server.pid, child.pid, flush=True)
time.sleep(600)
"""


def _modules(tmp_path: Path, **sources: str) -> dict[str, str]:
    """The modules as files in tmp_path; the environment for a server that can import them."""
    for name, text in sources.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(text))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}


def _gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_child_gets_what_popen_would_give_it(tmp_path):
    env = _modules(tmp_path, fs_child=CHILD)
    server = ForkServer.start(["torch"], env)
    try:
        assert server.ready["cuda_initialized"] is False and server.ready["skipped"] == []
        r, w = os.pipe()
        os.write(w, b"the-run-key")
        os.close(w)
        log = tmp_path / "child.log"
        with open(log, "ab") as out:
            child = server.popen(
                [sys.executable, "-m", "fs_child", str(r), "3"],
                env={**env, "FS_TEST_VAR": "only-in-the-child"},
                stdout=out,
                stderr=subprocess.STDOUT,
                pass_fds=(r,),
            )
        os.close(r)
        assert child.wait(timeout=120) == 3 and child.poll() == 3 and child.returncode == 3
        lines = log.read_text().splitlines()
        seen = json.loads(lines[0])
        assert lines[1:] == ["a line on stderr"], lines
        assert seen["argv"] == [str(r), "3"] and seen["name"] == "__main__" and seen["cwd"] == os.getcwd()
        assert seen["var"] == "only-in-the-child" and "FS_TEST_VAR" not in os.environ
        assert seen["key"] == "the-run-key" and seen["ppid"] == server.pid
        # close_fds semantics: stdin, the log twice, the key's pipe at its own number, nothing of the server's
        assert seen["fds"] == [0, 1, 2, r], seen["fds"]
        assert seen["preloaded"] is True
        # its command line in `ps` is the one Popen would show (a role then sets its own title)
        assert seen["cmdline"].rstrip() == f"{sys.executable} -m fs_child {r} 3", seen["cmdline"]
        # torch's intra-op pool forked unused: as many threads as in a new Python
        fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"], capture_output=True, text=True)
        assert seen["threads"] == int(fresh.stdout), (seen["threads"], fresh.stdout, fresh.stderr)
    finally:
        server.close()
    assert server._proc.returncode == 0  # EOF ends it cleanly


def test_signals_timeouts_and_a_lost_server(tmp_path):
    env = _modules(tmp_path, fs_sleeper=SLEEPER)
    server = ForkServer.start([], env)
    try:
        with open(tmp_path / "a.log", "ab") as out:
            a = server.popen([sys.executable, "-m", "fs_sleeper", str(server.pid)], stdout=out)
            b = server.popen([sys.executable, "-m", "fs_sleeper", str(server.pid)], stdout=out)
        with pytest.raises(subprocess.TimeoutExpired):
            a.wait(timeout=0.2)
        assert a.poll() is None
        a.kill()
        assert a.wait(timeout=30) == -signal.SIGKILL
        b.terminate()
        assert b.wait(timeout=30) == -signal.SIGTERM
        with pytest.raises(ValueError, match="python -m MODULE"):
            server.popen([sys.executable, "-c", "pass"])
        c = server.popen([sys.executable, "-m", "fs_sleeper", str(server.pid)], stdout=subprocess.DEVNULL)
        os.kill(server.pid, signal.SIGKILL)  # by hand: c dies of its death signal, its status is lost with the server
        assert c.wait(timeout=30) == LOST_EXIT_CODE
        with pytest.raises(OSError, match="has ended"):
            server.popen([sys.executable, "-m", "fs_sleeper", "0"])
    finally:
        server.close()


def test_a_sigkilled_supervisor_takes_the_server_and_every_child_down(tmp_path):
    env = _modules(tmp_path, fs_sleeper=SLEEPER, fs_supervisor=SUPERVISOR)
    sup = subprocess.Popen([sys.executable, "-m", "fs_supervisor", str(tmp_path / "c.log")], env=env, stdout=subprocess.PIPE, text=True)
    try:
        server_pid, child_pid = map(int, sup.stdout.readline().split())
        deadline = time.monotonic() + 60
        while not (tmp_path / "c.log").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)  # the child armed its death signal and checked its parent
        assert (tmp_path / "c.log").read_text().strip() == str(child_pid)
        assert psutil.Process(child_pid).ppid() == server_pid and psutil.Process(server_pid).ppid() == sup.pid
        sup.kill()
        sup.wait()
        assert _gone(server_pid, 30), "the fork server outlived its supervisor"
        assert _gone(child_pid, 30), "a forked child outlived its supervisor"
    finally:
        sup.kill()
        sup.wait()
        sup.stdout.close()


def test_the_server_of_up_preloads_its_list_and_never_initializes_cuda(tmp_path, shared_forkserver):
    # The worker's shared server is one (tests/conftest.py starts it as `up` starts its own; its HELLO is
    # its READY, and a client is refused a module it did not preload): asked, not started again.
    if shared_forkserver:
        server = ForkServer.connect(shared_forkserver, child_env(), up_preload())
    else:
        server = ForkServer.start(up_preload(), dict(os.environ))
    try:
        assert server.ready["cuda_initialized"] is False and server.ready["skipped"] == [], server.ready
    finally:
        server.close()
    # a preload that did initialize CUDA (simulated: this host has none) is refused, naming the module and the setting
    env = _modules(tmp_path, fs_cuda="import torch\ntorch.cuda.is_initialized = lambda: True\n")
    refused = r'initialized CUDA while preloading fs_cuda; set run.launcher = "exec"'
    with pytest.raises(RuntimeError, match=refused):
        ForkServer.start(["json", "fs_cuda"], env)


def test_a_preload_that_loads_a_driver_it_cannot_question_is_refused_naming_the_module(tmp_path):
    """A shared object mapped under the driver's name (as /proc/self/maps shows the real one) that cannot
    say whether cuInit ran (it has no cuDeviceGetCount): the server refuses rather than guess."""
    import _json

    shutil.copy(_json.__file__, tmp_path / "libcuda.so.1")
    env = _modules(tmp_path, fs_driver=f"import ctypes\nctypes.CDLL({str(tmp_path / 'libcuda.so.1')!r})\n")
    with pytest.raises(RuntimeError, match=r"while preloading fs_driver; set run.launcher"):
        ForkServer.start(["json", "fs_driver", "msgpack"], env)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stand-in driver")
@pytest.mark.parametrize("answer", [CUDA_ERROR_NOT_INITIALIZED, 0], ids=["driver-loaded", "cuinit-ran"])
def test_a_loaded_driver_refuses_the_server_only_once_cuinit_ran(tmp_path, answer):
    """Some torch builds map the driver at import: harmless until cuInit. A compiled stand-in under the
    driver's name answers cuDeviceGetCount as the real one does before cuInit (3) or after it (0)."""
    (tmp_path / "driver.c").write_text(f"int cuDeviceGetCount(int *count) {{ *count = 1; return {answer}; }}\n")
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(tmp_path / "libcuda.so.1"), str(tmp_path / "driver.c")], check=True)
    env = _modules(tmp_path, fs_driver=f"import ctypes\nctypes.CDLL({str(tmp_path / 'libcuda.so.1')!r})\n")
    if answer == CUDA_ERROR_NOT_INITIALIZED:
        server = ForkServer.start(["json", "fs_driver"], env)
        try:
            assert server.ready["cuda_initialized"] is False and "fs_driver" in server.ready["preload"]
        finally:
            server.close()
    else:
        with pytest.raises(RuntimeError, match=r"initialized CUDA while preloading fs_driver; set run.launcher"):
            ForkServer.start(["json", "fs_driver"], env)


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stand-in drivers")
@pytest.mark.parametrize("initialized_loads", ["first", "second"])
def test_every_mapped_driver_is_asked_not_only_the_first(tmp_path, initialized_loads):
    """A GPU host's driver, mapped (by a torch build at import) and not initialized, must not hide
    another library under the driver's name on which cuInit ran, whichever /proc/self/maps lists
    first (it lists by address, not by load order): either initialized refuses."""
    drivers = [("host", CUDA_ERROR_NOT_INITIALIZED), ("other", 0)]
    paths = []
    for name, answer in drivers if initialized_loads == "second" else drivers[::-1]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "driver.c").write_text(f"int cuDeviceGetCount(int *count) {{ *count = 1; return {answer}; }}\n")
        paths.append(str(tmp_path / name / "libcuda.so.1"))
        subprocess.run(["cc", "-shared", "-fPIC", "-o", paths[-1], str(tmp_path / name / "driver.c")], check=True)
    loads = "".join(f"ctypes.CDLL({p!r})\n" for p in paths)
    env = _modules(tmp_path, fs_drivers=f"import ctypes\n{loads}")
    with pytest.raises(RuntimeError, match=r"initialized CUDA while preloading fs_drivers; set run.launcher"):
        ForkServer.start(["json", "fs_drivers"], env)


def test_up_preload_leaves_what_imports_fla_to_the_children_where_fla_is_installed():
    bare = up_preload(gpu_visible=False, installed=lambda name: False)
    assert bare == UP_PRELOAD and IMPORTS_FLA <= set(UP_PRELOAD)
    kept = up_preload(gpu_visible=False, installed=lambda name: name == "fla")
    assert set(kept) == set(UP_PRELOAD) - IMPORTS_FLA and "dflash_ipc.procs.target" in kept


def test_up_preload_leaves_what_imports_torchao_to_the_children_only_where_a_gpu_is_visible(tmp_path, monkeypatch):
    """transformers' modeling imports torchao where it is installed; torchao's kernels ask a visible GPU its
    capability at import, which initializes CUDA in the server (seen on an H200 with the fp8 extra)."""
    torchao_only = lambda name: name == "torchao"  # noqa: E731
    assert up_preload(gpu_visible=False, installed=torchao_only) == UP_PRELOAD  # a CPU host: no device to ask
    kept = up_preload(gpu_visible=True, installed=torchao_only)
    assert "transformers.modeling_utils" in IMPORTS_TORCHAO and "transformers.modeling_utils" not in kept
    assert set(kept) == set(UP_PRELOAD) - IMPORTS_TORCHAO and {"torch", "transformers", "dflash_ipc.procs.drafter"} <= set(kept)
    # by default: what this interpreter can import (a package on sys.path counts) and the device nodes
    (tmp_path / "torchao").mkdir()
    (tmp_path / "torchao" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert "transformers.modeling_utils" not in up_preload(gpu_visible=True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert nvidia_device_visible() is False and "transformers.modeling_utils" in up_preload()


def test_run_launcher_is_validated_and_auto_forks_only_without_cuda(tmp_path):
    with pytest.raises(ValueError, match=r"must be one of 'auto', 'exec', 'forkserver' \(got 'fork'\)"):
        RunConfig(launcher="fork")
    path = tmp_path / "c.toml"
    path.write_text((REPO / "configs" / "tiny-cpu.toml").read_text())
    with pytest.raises(ConfigError, match=r"run\.launcher.*'auto', 'exec', 'forkserver'"):
        load_config(path, overrides={"run.launcher": "zygote"})
    assert load_config(path).run.launcher == "auto"
    assert use_forkserver("auto", on_cuda=False) and not use_forkserver("auto", on_cuda=True)
    assert use_forkserver("forkserver", on_cuda=True) and not use_forkserver("exec", on_cuda=False)
