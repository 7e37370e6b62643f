"""A preloading launcher: one server process imports torch, transformers and the roles' modules
once, then forks each child of ``up`` (the config probe, every target and drafter) from that
state, instead of each child starting a new Python that imports them again (seconds of CPU each).

``run.launcher`` picks it (:func:`use_forkserver`): "exec" starts every child as a new Python
(``subprocess.Popen``), "forkserver" forks it from the server, and "auto" (the default) means
forkserver when every device of the topology is the CPU (tests, the embedded default) and exec as
soon as one is CUDA: the server never initializes CUDA (after each preloaded import it checks that
neither torch nor anything behind its back ran ``cuInit``, asking the driver itself where it is mapped, and
the client refuses a server that fails this, naming the module whose import did it), so a forked child
sets up its own device. On a GPU host transformers' Qwen3.5 modeling imports flash-linear-attention,
whose import asks the GPU its name: :func:`up_preload` leaves such modules to the children where fla is
installed; on a host with an NVIDIA device, transformers' modeling imports torchao (its quantizer) where
that is installed, whose kernels ask the GPU its compute capability, so those modules are left to the
children there too. Forced on one H200, the forked path trains (tests/end_to_end/test_gpu_pipeline.py's forkserver case).

A forked child gets what ``Popen`` would have given it: the same argv (only ``python -m MODULE
...`` command lines: the module runs as ``__main__`` through :mod:`runpy`), environment, working
directory, stdout/stderr, and ``pass_fds`` at the same numbers (sent over the socket with
SCM_RIGHTS, so the run key's pipe never travels as data); every other descriptor of the server is
closed, as ``close_fds`` would. The server is started with the environment its children share, so
what the preloaded modules read at import (OMP_NUM_THREADS, HF_*) is the same; a child's own
variables (a drafter's rendezvous) are only read at run time. Requests are JSON, never pickle.

Life of the server (:class:`ForkServer` owns it; its pid is the children's parent, so it is the
``--supervisor-pid`` a child checks: :func:`dflash_ipc.runtime.launch.main`)::

    ForkServer.start ── Popen(python -m dflash_ipc.runtime.forkserver --socket-fd N --parent P) ──▶ server:
      PDEATHSIG = SIGKILL, parent still P? ─no─▶ exit 1;  SIGTERM/SIGINT/SIGHUP ignored (runtime.stop_signals)
      import the preload list ─▶ READY {pid, cuda_initialized, seconds}   (client: no READY within the
                                 timeout, or CUDA initialized ─▶ RuntimeError, server ended)
    SERVING (select on the socket and one pidfd per live child):
      request {argv, env, cwd, fds} + descriptors ─▶ fork ─▶ {"pid"}  (a bad request: {"error"}, server goes on)
      a child's pidfd readable ─▶ waitpid ─▶ {"exit": pid, "code"}   (code as Popen.returncode: -N = signal N)
      EOF on the socket (ForkServer.close, or the supervisor died) ─▶ exit 0
    forked child: drop the server's descriptors ─▶ a stop signal ends it (runtime.stop_signals.end_at_once) ─▶ fds at their numbers
      ─▶ environ, cwd, title ─▶ run the module as __main__ ─▶ the interpreter exits with its code

A SIGKILLed supervisor takes everything down in a chain: the server dies of its death signal, and
each child of it of its own (``launch.main`` arms it before importing the role), then leaves
through its CLOSING path (or, still importing, removes the dead supervisor's socket files and
exits). A server that ends while children run (killed by hand) leaves their exit statuses unknown:
the client reports :data:`LOST_EXIT_CODE` once they are gone.

Shared mode, a test/debug switch (the product never uses it): ``DFLASH_IPC_SHARED_FORKSERVER=PATH``
makes ``up``'s launcher (:func:`launcher_for`, only where it would fork anyway) connect to a server
listening at PATH (``ForkServer.start_shared``: PATH in a private directory of its own; tests/conftest.py starts one per pytest
worker) instead of starting its own, saving each ``up`` the preload. The socket's directory must be
the user's and 0700 (both sides check, and the server serves only its own uid, SO_PEERCRED). The
preload read the variables :data:`~dflash_ipc.runtime.forkserver_serve.PRELOAD_ENV_PREFIXES` name at import: a client whose children's
environment differs in one of them, that runs in other namespaces or on other CPUs than the server
(``forkserver_serve.process_context``: a child inherits those from the server), or that needs a module
the server did not preload, starts its own server as usual and says why in its log; the server also
refuses a request whose environment differs. Each
connection owns the children it asked for; the same JSON requests and SCM_RIGHTS descriptors::

    server (as above, plus --listen PATH): bind PATH, then the preload, READY on the owner's socketpair
    SERVING: the owner's socket, the listening one, every client connection, one pidfd per live child
      accept ─▶ peer of another uid: closed │ else HELLO {pid, preload, preload_env, ...} = its READY
      request on a connection ─▶ fork, the child is that connection's ─▶ {"pid"}
      {"op": "status"} ─▶ {"status": {clients, children, rejected}}
      a bad request (not JSON, a bad argv/env/fds, an environment the preload disagrees with)
          ─▶ {"error"}, counted in ``rejected``; the server and the connection go on
      a child's pidfd ─▶ waitpid ─▶ {"exit"} to its owning connection only, if still open
      EOF on a client connection (its supervisor ended, or died: SIGKILL too) ─▶ nothing more is
          sent there; its live children get SIGTERM, SIGKILL after ORPHAN_GRACE_S; once the last is
          reaped, the dead supervisor's socket files in their --run-dir go, as its last child removes them
      EOF on the owner's socket (ForkServer.close) ─▶ unlink PATH, exit 0 (any children left: death signal)
      the owner (the pytest worker) dies ─▶ PDEATHSIG SIGKILL, then the chain above

A shared server's child has the server as parent, so ``--supervisor-pid`` is still the server's
pid and every check of :mod:`dflash_ipc.runtime.launch` holds; its supervisor's death reaches it as
the server's SIGTERM (the connection's EOF) instead of its own death signal.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import glob
import importlib.util
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from dflash_ipc.platform.third_party_logs import quiet_import_notes
from dflash_ipc.runtime import stop_signals
from dflash_ipc.runtime.forkserver_serve import (
    MAX_MESSAGE,
    Server,
    check_private_dir,
    context_differences,
    listen_at,
    peer_uid,
    preload_env,
    preload_env_differences,
    process_context,
)
from dflash_ipc.runtime.launch import set_parent_death_signal

if TYPE_CHECKING:
    from dflash_ipc.config import DFlashConfig

#: Modules a server for ``up`` imports before forking: everything a role or the probe imports at start.
UP_PRELOAD = (
    "torch",
    "torch._dynamo",
    "transformers",
    "transformers.modeling_utils",
    "transformers.models.qwen3_5.modeling_qwen3_5",  # the default target family's (another's is imported by its child)
    "zmq",
    "msgpack",
    "dflash_ipc.procs.target",
    "dflash_ipc.procs.drafter",
    "dflash_ipc.runtime.probe",
)
#: Preload entries that import flash-linear-attention where it is installed: fla's import asks torch for
#: the GPU's name (its hardware checks), which initializes CUDA, and a child forked after that cannot use
#: CUDA. Where fla imports, the child imports these itself (:func:`up_preload`).
IMPORTS_FLA = frozenset({"transformers.models.qwen3_5.modeling_qwen3_5"})
#: Preload entries that import torchao where it is installed (transformers' torchao quantizer): on a host
#: with a GPU, torchao's kernel modules ask the device's compute capability at import, initializing CUDA.
IMPORTS_TORCHAO = frozenset({"transformers.modeling_utils", "transformers.models.qwen3_5.modeling_qwen3_5"})
#: How long a server may take to import its preload list (torch on a busy host: tens of seconds).
START_TIMEOUT_S = 600.0
#: The exit code reported for a child whose status was lost with its server.
LOST_EXIT_CODE = 255
#: The test/debug switch: the socket of a shared server ``up`` forks from instead of starting its own.
SHARED_FORKSERVER_ENV = "DFLASH_IPC_SHARED_FORKSERVER"
#: The socket's name inside a :meth:`ForkServer.start_shared` server's private directory.
SHARED_SOCKET_NAME = "forkserver.sock"


def up_preload(gpu_visible: bool | None = None, installed: Callable[[str], bool] | None = None) -> tuple[str, ...]:
    """:data:`UP_PRELOAD` as this host can preload it without initializing CUDA: without :data:`IMPORTS_FLA`
    where fla is ``installed`` (by default: importable here), without :data:`IMPORTS_TORCHAO` where torchao
    is and a GPU is visible (``gpu_visible``, by default :func:`nvidia_device_visible`)."""
    if installed is None:
        installed = package_importable
    if gpu_visible is None:
        gpu_visible = nvidia_device_visible()
    left_to_children: set[str] = set()
    if installed("fla"):
        left_to_children |= IMPORTS_FLA
    if installed("torchao") and gpu_visible:
        left_to_children |= IMPORTS_TORCHAO
    return tuple(name for name in UP_PRELOAD if name not in left_to_children)


def package_importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def nvidia_device_visible() -> bool:
    """Whether this process could see an NVIDIA GPU, read from the device nodes and CUDA_VISIBLE_DEVICES,
    without importing torch or asking the driver (which would itself initialize CUDA)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return False
    return bool(glob.glob("/dev/nvidia[0-9]*"))


def use_forkserver(launcher: str, on_cuda: bool) -> bool:
    """``run.launcher`` resolved: "auto" forks from a server only when no device is CUDA."""
    return launcher == "forkserver" or (launcher == "auto" and not on_cuda)


def launcher_for(cfg: DFlashConfig, env: dict[str, str], echo: Callable[[str], None] = print) -> ForkServer | None:
    """A server for ``up``'s children when ``run.launcher`` resolves to one, else None (exec): the
    shared one :data:`SHARED_FORKSERVER_ENV` names if it suits ``env``, else one started here."""
    if not use_forkserver(cfg.run.launcher, cfg.topology.on_cuda):
        return None
    shared = os.environ.get(SHARED_FORKSERVER_ENV, "")
    if shared:
        t0 = time.perf_counter()
        try:
            server = ForkServer.connect(shared, env, up_preload())
            shared_by = f"the shared one at {shared} (pid {server.pid}, preloaded in {server.ready['seconds']:.1f} s)"
            echo(f"[up] fork server (run.launcher) ready after {time.perf_counter() - t0:.1f} s: {shared_by}; {SHARED_FORKSERVER_ENV}")
            return server
        except (OSError, RuntimeError, ValueError) as e:
            echo(f"[up] shared fork server {shared} not used ({e}): starting this run's own")
    server = ForkServer.start(up_preload(), env)
    echo(f"[up] fork server (run.launcher) ready after {server.ready['seconds']:.1f} s: torch, transformers and the roles preloaded")
    return server


def popen_with(launcher: ForkServer | None, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen | ForkedProcess:
    """``launcher.popen`` or, without a launcher, ``subprocess.Popen`` (the "exec" launcher)."""
    return launcher.popen(argv, **kwargs) if launcher is not None else subprocess.Popen(argv, **kwargs)


class ForkedProcess:
    """The ``subprocess.Popen`` subset the supervisor uses, for a child forked by the server."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]):
        self._server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._server.pump(0.5 if left is None else min(0.5, left))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a pid the server reported reaped is never signalled (it may be reused)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The client side: start the server, fork children from it (:meth:`popen`), close it."""

    def __init__(self, proc: subprocess.Popen | None, sock: socket.socket, ready: dict):
        self._proc = proc  # None: a connection to a shared server (connect), which outlives this client
        self._sock = sock
        self.ready = ready  # the READY message: pid, cuda_initialized, seconds, skipped
        self._children: dict[int, ForkedProcess] = {}
        self._lock = threading.Lock()
        self._ended = False
        self.listen_dir: str | None = None  # start_shared: the private directory of its socket, removed by close

    @property
    def pid(self) -> int:
        """The server's pid: every forked child's parent."""
        return self._proc.pid if self._proc is not None else int(self.ready["pid"])

    @classmethod
    def start(
        cls, preload: Sequence[str], env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S, listen: str | None = None
    ) -> ForkServer:
        """Start a server for this process; with ``listen``, a shared one that also serves the clients
        that :meth:`connect` to that socket path (its directory: this user's, 0700)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "dflash_ipc.runtime.forkserver", "--socket-fd", str(theirs.fileno()), "--parent", str(os.getpid())]
        argv += ["--listen", str(listen)] if listen else []
        try:
            proc = subprocess.Popen([*argv, *preload], env=env, stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ready: dict = {}
        try:
            ours.settimeout(timeout_s)
            ready = json.loads(ours.recv(MAX_MESSAGE) or b"{}")
            ours.settimeout(None)
        except (TimeoutError, ValueError):
            pass
        server = cls(proc, ours, ready)
        if not ready.get("ready") or ready.get("cuda_initialized"):
            server.close()
            why = f"ended or was not ready within {timeout_s:g} s"
            if ready.get("error"):
                why = f"refused to start: {ready['error']}"
            if ready.get("cuda_initialized"):
                why = f"initialized CUDA while preloading {ready.get('cuda_by') or 'its modules'}"
            raise RuntimeError(f'the fork server (python -m dflash_ipc.runtime.forkserver) {why}; set run.launcher = "exec"')
        return server

    @classmethod
    def start_shared(cls, preload: Sequence[str], env: dict[str, str] | None = None, prefix: str = "dflash-fs-") -> ForkServer:
        """:meth:`start` listening in a new private directory (0700, a short path), which :meth:`close`
        removes; clients :meth:`connect` to its :attr:`listen_path`."""
        directory = tempfile.mkdtemp(prefix=prefix)
        try:
            server = cls.start(preload, env, listen=os.path.join(directory, SHARED_SOCKET_NAME))
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        server.listen_dir = directory
        return server

    @property
    def listen_path(self) -> str:
        """The socket a :meth:`start_shared` server listens at."""
        if self.listen_dir is None:
            raise ValueError("not a server started by ForkServer.start_shared")
        return os.path.join(self.listen_dir, SHARED_SOCKET_NAME)

    @classmethod
    def connect(cls, path: str, env: dict[str, str], preload: Sequence[str] = (), timeout_s: float = 60.0) -> ForkServer:
        """A client of the shared server listening at ``path``: RuntimeError when it does not suit
        children of ``env`` (a preload-read variable differs, a module of ``preload`` was not preloaded),
        OSError when it cannot be reached or its directory is not private."""
        check_private_dir(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(timeout_s)
            sock.connect(path)
            if peer_uid(sock) != os.getuid():
                raise OSError(f"the server at {path} runs as another user")
            hello = json.loads(sock.recv(MAX_MESSAGE) or b"{}")
            sock.settimeout(None)
            if not hello.get("ready") or hello.get("cuda_initialized"):
                raise OSError(f"the server at {path} is not a ready fork server")
            missing = sorted(set(preload) - set(hello.get("preload", ())))
            if missing:
                raise RuntimeError(f"it did not preload {', '.join(missing)}")
            differ = preload_env_differences(hello.get("preload_env", {}), env)
            if differ:
                raise RuntimeError(f"its preload read another {', '.join(differ)}")
            differ = context_differences(hello.get("context", {}))
            if differ:
                raise RuntimeError(f"its children would get another {', '.join(differ)} than this process's")
        except BaseException:
            sock.close()
            raise
        return cls(None, sock, hello)

    def server_status(self) -> dict:
        """A shared server's counts: clients connected, live children, requests rejected."""
        return self._request({"op": "status"}, [], "status")["status"]

    def popen(
        self,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        stdout: Any = None,
        stderr: Any = None,
        pass_fds: Sequence[int] = (),
    ) -> ForkedProcess:
        """Fork ``argv`` (``python -m MODULE ...``) as ``subprocess.Popen`` would start it; ``stdout`` and
        ``stderr``: None (this process's), a file, a descriptor or ``subprocess.DEVNULL``; ``stderr`` may be
        ``subprocess.STDOUT``."""
        argv = [str(a) for a in argv]
        if len(argv) < 3 or argv[1] != "-m":
            raise ValueError(f"the fork server runs `python -m MODULE ...` command lines only (got {argv[:3]})")
        request = {"argv": argv, "env": dict(os.environ if env is None else env), "cwd": os.getcwd(), "fds": [1, 2, *pass_fds]}
        with contextlib.ExitStack() as opened:
            out = _fd_of(stdout, 1, opened)
            err = out if stderr == subprocess.STDOUT else _fd_of(stderr, 2, opened)
            return self._request(request, [out, err, *pass_fds], argv[2])

    def _request(self, request: dict, fds: list[int], what: str) -> Any:
        """Send ``request`` and return its answer (a ForkedProcess for a fork), applying any exit
        reports sent before it."""
        with self._lock:
            if self._ended:
                raise OSError("the fork server has ended")
            socket.send_fds(self._sock, [json.dumps(request).encode()], fds)
            while True:
                msg = self._receive(None)
                if msg is None:
                    raise OSError(f"the fork server ended while starting {what}")
                if "pid" in msg:
                    child = self._children[msg["pid"]] = ForkedProcess(self, msg["pid"], request["argv"])
                    return child
                if "error" in msg:
                    raise OSError(f"the fork server could not start {what}: {msg['error']}")
                if "status" in msg:
                    return msg
                self._on_exit(msg)

    def pump(self, timeout: float) -> None:
        """Apply the exit reports that arrive within ``timeout`` s (0: those already here)."""
        with self._lock:
            if self._ended:
                self._reap_lost()
                return
            while (msg := self._receive(timeout)) is not None:
                self._on_exit(msg)
                timeout = 0.0
            if self._ended:
                self._reap_lost()

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (EOF on its socket) and wait for it; idempotent. A shared server's client
        only hangs up (the server then ends what it still runs of this client's)."""
        with self._lock:
            self._ended = True
            if self._sock.fileno() >= 0:
                with contextlib.suppress(OSError):
                    self._sock.shutdown(socket.SHUT_RDWR)
                self._sock.close()
        if self._proc is None:
            return
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self.listen_dir is not None:
            shutil.rmtree(self.listen_dir, ignore_errors=True)

    def _receive(self, timeout: float | None) -> dict | None:
        """One message; None on timeout, or on EOF (then the server has ended)."""
        if self._ended:
            return None
        ready, _, _ = select.select([self._sock], [], [], timeout)
        if not ready:
            return None
        data = self._sock.recv(MAX_MESSAGE)
        if not data:
            self._ended = True
            return None
        return json.loads(data)

    def _on_exit(self, msg: dict) -> None:
        child = self._children.pop(msg.get("exit", -1), None)
        if child is not None:
            child.returncode = int(msg["code"])

    def _reap_lost(self) -> None:
        for pid, child in list(self._children.items()):
            if not _alive(pid):
                child.returncode = LOST_EXIT_CODE
                del self._children[pid]


def _fd_of(stream: Any, default: int, opened: contextlib.ExitStack) -> int:
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return opened.enter_context(open(os.devnull, "wb")).fileno()
    return stream if isinstance(stream, int) else stream.fileno()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# --------------------------------------------------------------------------- the server's side


def main(argv: Sequence[str]) -> int:
    """``python -m dflash_ipc.runtime.forkserver --socket-fd N --parent P [--listen PATH] MODULE...``."""
    sock_fd, parent = int(argv[1]), int(argv[3])
    listen = argv[5] if len(argv) > 5 and argv[4] == "--listen" else None
    preload = list(argv[6:] if listen else argv[4:])
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    # a group's stop (Ctrl-C, timeout, kill -- -PGID) is the supervisor's: the server reports its children's exits to the end
    stop_signals.ignore()
    sock = socket.socket(fileno=sock_fd)
    try:
        listener = listen_at(listen) if listen else None
    except (OSError, ValueError) as e:
        sock.send(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}).encode())
        return 1
    server_pid = os.getpid()
    try:
        return _preload_and_serve(sock, listener, parent, preload)
    finally:
        if listen and os.getpid() == server_pid:  # the server leaving, not a forked child
            with contextlib.suppress(OSError):
                os.unlink(listen)


def _preload_and_serve(sock: socket.socket, listener: socket.socket | None, parent: int, preload: list[str]) -> int:
    t0 = time.perf_counter()
    read_env = preload_env(dict(os.environ))  # before the imports, some of which set variables of their own
    quiet_import_notes()  # the children inherit the filters
    skipped = []
    cuda_by = ""  # the first module whose import touched CUDA: the refusal names it
    for name in preload:
        try:
            __import__(name)
        except ImportError as e:  # an optional module: its child imports it (or fails) itself
            skipped.append(f"{name}: {e}")
        if not cuda_by and _cuda_touched():
            cuda_by = name
    # Claim the title's memory here, before a child rewrites environ: setproctitle finds the argv area
    # through environ's strings, and a child's new environment would leave it no title to set.
    with contextlib.suppress(ImportError):
        import setproctitle

        whose = f"shared by the clients of {listener.getsockname()}, owner {parent}" if listener else f"supervisor {parent}"
        setproctitle.setproctitle(f"dflash-ipc:forkserver ({whose})")
    # What was preloaded lives as long as any child: out of the cyclic collector's sight, a child's
    # collections (and the last one at its exit, a second of CPU with torch loaded) skip it, and its pages stay shared.
    gc.freeze()
    cuda = bool(cuda_by) or _cuda_touched()
    ready = {"ready": True, "pid": os.getpid(), "cuda_initialized": cuda, "cuda_by": cuda_by}
    ready |= {"seconds": round(time.perf_counter() - t0, 3), "skipped": skipped}
    ready |= {"preload": [n for n in preload if n in sys.modules], "preload_env": read_env, "context": process_context()}
    try:
        sock.send(json.dumps(ready).encode())
        request = None if cuda else Server(sock, listener, ready).serve()
    except (BrokenPipeError, ConnectionResetError):  # the owner is gone: so are its children's reports
        return 0
    return (1 if cuda else 0) if request is None else _run_child(*request)


def _cuda_touched() -> bool:
    """CUDA initialized here: by torch, or behind its back (``cudaGetDeviceCount``, as
    ``torch.cuda.is_available()`` without NVML calls it, initializes the driver while
    ``torch.cuda.is_initialized()`` stays False), and a child forked after that cannot use CUDA. The
    driver merely mapped (some torch builds link it at import) is harmless: only ``cuInit`` is."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    with open("/proc/self/maps") as maps:
        # each library mapped under the driver's name is asked: a host's real driver, mapped by a
        # torch build at import, must not hide one that a preloaded module loaded from elsewhere
        drivers = dict.fromkeys(line.split()[-1] for line in maps if "libcuda.so" in line)
    return any(_driver_at_path_initialized(path) for path in drivers)


def _driver_at_path_initialized(path: str) -> bool:
    try:
        return driver_initialized(ctypes.CDLL(path))
    except OSError:  # mapped but not loadable by path (deleted, a namespace): cannot tell, so refuse
        return True


#: CUresult of a driver call made before cuInit
CUDA_ERROR_NOT_INITIALIZED = 3


def driver_initialized(driver: Any) -> bool:
    """Whether ``cuInit`` ran in this process, asked of the loaded driver without initializing it: any
    driver call before ``cuInit`` answers CUDA_ERROR_NOT_INITIALIZED. A library without the call (not the
    real driver) counts as initialized: the server then refuses rather than fork a child that may fail."""
    get_count = getattr(driver, "cuDeviceGetCount", None)
    if get_count is None:
        return True
    count = ctypes.c_int(0)
    return get_count(ctypes.byref(count)) != CUDA_ERROR_NOT_INITIALIZED


def _run_child(request: dict, fds: list[int]) -> int:
    """In the forked child: become what ``Popen(request["argv"], ...)`` would have started."""
    # until its own handlers are in (launch.main, the probe's main, run_child), a stop signal ends the child at
    # once and silently, as SIGTERM ends an exec'd one: never a KeyboardInterrupt's traceback from a module import
    stop_signals.end_at_once()
    _place_fds(dict(zip(request["fds"], fds, strict=True)))
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if sys.path and sys.path[0] == os.getcwd():  # `python -m` puts its directory first: the child's, not the server's
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))
    sys.argv = [argv[0], *argv[3:]]
    # a preloaded module runs as __main__ beside its imported copy, as under `python -m` (no runpy warning)
    sys.modules.pop(argv[2], None)
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    return 0


def _place_fds(wanted: dict[int, int]) -> None:
    """Each received descriptor at the number the caller gave it (target -> received); every
    other descriptor above stderr closed, as ``Popen(close_fds=True, pass_fds=...)`` leaves a child."""
    base = max([*wanted, *wanted.values(), 2]) + 1
    moved = {target: fcntl.fcntl(fd, fcntl.F_DUPFD, base) for target, fd in wanted.items()}
    keep = set(moved.values())
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
    for target, fd in moved.items():
        os.dup2(fd, target)
        os.close(fd)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
