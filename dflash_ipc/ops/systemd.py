"""Running a training run as a systemd service, and the sd_notify protocol.

Two halves:

* **Unit files.** :func:`render_units` renders the template unit ``dflash-ipc@.service``
  (one instance per run; the instance name is the config name) and an example environment
  file for a concrete install: absolute paths to the ``dflash-ipc`` executable, the config
  directory (``<config_dir>/<instance>.toml``), the runs directory (``<runs_dir>/<instance>``)
  and the directory of the optional per-instance environment files. ``dflash-ipc systemd
  render --out DIR [--user]`` (:data:`systemd_group`) is the command line for it. The
  template shipped as ``systemd/dflash-ipc@.service`` in the source tree is
  :data:`UNIT_TEMPLATE`, verbatim, with its ``@NAME@`` placeholders.

* **Notifications.** :func:`sd_notify` sends one datagram to ``$NOTIFY_SOCKET`` (a path, or
  an abstract socket when it starts with ``@``) and is a no-op returning ``False`` when the
  variable is unset, so the supervisor calls the helpers unconditionally:

  - :func:`notify_ready` once every target and drafter has completed its handshake
    (the unit is ``Type=notify``, ``NotifyAccess=main``: only the supervisor process itself
    may send, so it must not be forwarded from a child);
  - :func:`notify_watchdog` from the supervisor's heartbeat loop, at least every
    ``watchdog_interval_s() / 2`` seconds (systemd kills and restarts a supervisor that
    stays silent for ``WatchdogSec``);
  - :func:`notify_status` for the one-line status ``systemctl status`` shows;
  - :func:`notify_extend_timeout` while a slow start (model loading) or stop (checkpoint)
    needs more than ``TimeoutStartSec`` / ``TimeoutStopSec``;
  - :func:`notify_stopping` when the shutdown (checkpoint, drain) begins.

  Children must not inherit the notification variables: spawn them with
  :func:`scrub_notify_env`.

The supervisor should exit with status 2 on configuration or usage errors: the unit sets
``RestartPreventExitStatus=2`` so such a failure is not restarted in a loop.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import click

log = logging.getLogger(__name__)

UNIT_NAME = "dflash-ipc@.service"
ENV_EXAMPLE_NAME = "dflash-ipc.env.example"

#: Exit status that the unit treats as "do not restart" (bad command line or config).
EXIT_CONFIG_ERROR = 2

DEFAULT_TIMEOUT_START_S = 900
DEFAULT_TIMEOUT_STOP_S = 600
DEFAULT_WATCHDOG_S = 120

#: The template unit, byte for byte as shipped in ``systemd/dflash-ipc@.service``.
#: ``@NAME@`` placeholders are filled by :func:`render_units`; a placeholder alone on its
#: line is dropped with its line when its value is empty.
UNIT_TEMPLATE = """\
# dflash-ipc@.service: one DFlash drafter-training run per instance.
#
# The instance name is the name of the run's config:
#   dflash-ipc@NAME  reads  @CONFIG_DIR@/NAME.toml
#                    runs in @RUNS_DIR@/NAME (resumed from its last checkpoint)
#                    with optional environment @ENV_DIR@/NAME.env
#
# Rendered by `dflash-ipc systemd render`; the copy in the source tree keeps the
# placeholders. See docs/SYSTEMD.md.

[Unit]
Description=dflash-ipc training run %i
@UNIT_DEPS@
# Give up after 5 (re)starts within 30 minutes: a crash loop (a missing GPU, a bad
# checkpoint) would otherwise never stop. `systemctl reset-failed` re-arms it.
StartLimitIntervalSec=1800
StartLimitBurst=5

[Service]
# The supervisor itself sends READY=1 once every target and drafter has completed its
# handshake, then WATCHDOG=1 with its heartbeat. Messages from its children are ignored.
Type=notify
NotifyAccess=main
ExecStart=@EXEC@ up --config @CONFIG_ARG@ --run-dir @RUN_DIR_ARG@ --resume $DFLASH_IPC_ARGS
WorkingDirectory=-@WORKING_DIR@
EnvironmentFile=-@ENV_FILE@
Environment=PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
@USER_LINE@
SyslogIdentifier=dflash-ipc@%i
# Loading the models and the handshakes happen before READY=1.
TimeoutStartSec=@TIMEOUT_START@
# A supervisor that stops sending WATCHDOG=1 for this long is killed (SIGABRT) and
# restarted; keep it above run.heartbeat_timeout_s so a hung child is handled first.
WatchdogSec=@WATCHDOG@
Restart=on-failure
RestartSec=30
# Exit status 2: bad command line or config; restarting would not help.
RestartPreventExitStatus=2
# SIGTERM goes to the supervisor only: it checkpoints, drains and stops its children, and
# exits. Whatever is still running when TimeoutStopSec runs out is SIGKILLed.
KillSignal=SIGTERM
KillMode=mixed
TimeoutStopSec=@TIMEOUT_STOP@
# Page-locked (pinned) host memory for the transport rings.
LimitMEMLOCK=infinity
LimitNOFILE=65536

[Install]
WantedBy=@WANTED_BY@
"""

#: The example environment file, byte for byte as shipped in
#: ``systemd/dflash-ipc.env.example``.
ENV_EXAMPLE = """\
# Environment for one dflash-ipc@NAME instance: install as ENV_DIR/NAME.env
# (/etc/dflash-ipc/NAME.env for a system unit, ~/.config/dflash-ipc/NAME.env for a user
# unit; the rendered unit names the exact directory in its EnvironmentFile= line).
# The file is optional. One KEY=VALUE per line; no shell expansion, no `export`.
# Changes apply at the next (re)start of the instance.

# Extra arguments appended to `dflash-ipc up --config ... --run-dir ... --resume`,
# split at whitespace.
#DFLASH_IPC_ARGS=

# Restrict the GPUs the run sees (the config's cuda:N count within this list).
#CUDA_VISIBLE_DEVICES=0,1,2,3

# Hugging Face cache and offline mode for target checkpoints and tokenizers.
#HF_HOME=/var/cache/huggingface
#HF_HUB_OFFLINE=1

# NCCL diagnostics between the drafter processes.
#NCCL_DEBUG=WARN

# CPU threads per process (each target and drafter is one process).
#OMP_NUM_THREADS=4
"""


# --------------------------------------------------------------------------- sd_notify

_warned: set[str] = set()


def _warn_once(key: str, msg: str, *args: object) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning(msg, *args)


def _notify_address(value: str) -> bytes | None:
    if value.startswith("@"):
        return b"\0" + os.fsencode(value[1:])
    if value.startswith("/"):
        return os.fsencode(value)
    return None


def sd_notify(message: str) -> bool:
    """Send ``message`` (``KEY=VALUE`` lines) to the service manager.

    Returns ``True`` when the datagram was sent; ``False`` when ``$NOTIFY_SOCKET`` is unset
    (not running under systemd: a no-op) or the send failed (logged once, never raised:
    a notification must not take training down).
    """
    target = os.environ.get("NOTIFY_SOCKET")
    if not target:
        return False
    if not message:
        raise ValueError("sd_notify: empty message")
    addr = _notify_address(target)
    if addr is None:
        _warn_once("addr:" + target, "sd_notify: unsupported NOTIFY_SOCKET %r (need a path or @abstract)", target)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode("utf-8"), addr)
        return True
    except OSError as e:
        _warn_once("send:" + target, "sd_notify: cannot send to %s: %s", target, e)
        return False


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def notify_ready(status: str | None = None) -> bool:
    """``READY=1``: startup finished (all handshakes done); the unit becomes active."""
    return sd_notify("READY=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def notify_watchdog() -> bool:
    """``WATCHDOG=1``: keep-alive, sent from the supervisor's heartbeat."""
    return sd_notify("WATCHDOG=1")


def notify_stopping(status: str | None = None) -> bool:
    """``STOPPING=1``: shutdown (checkpoint, drain) has begun."""
    return sd_notify("STOPPING=1" + (f"\nSTATUS={_one_line(status)}" if status else ""))


def notify_status(text: str) -> bool:
    """``STATUS=...``: the free-form line ``systemctl status`` shows (newlines are folded)."""
    return sd_notify(f"STATUS={_one_line(text)}")


def notify_extend_timeout(seconds: float) -> bool:
    """``EXTEND_TIMEOUT_USEC``: ask for ``seconds`` more before the start/stop timeout fires."""
    return sd_notify(f"EXTEND_TIMEOUT_USEC={max(1, int(seconds * 1_000_000))}")


def watchdog_interval_s() -> float | None:
    """The watchdog timeout (``WatchdogSec``) in seconds, or ``None`` when not enabled for
    this process (``WATCHDOG_USEC`` unset or invalid, or ``WATCHDOG_PID`` is another process).

    Send :func:`notify_watchdog` at least every half of this.
    """
    usec = os.environ.get("WATCHDOG_USEC", "")
    try:
        value = int(usec)
    except ValueError:
        return None
    if value <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID", "")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return value / 1_000_000


NOTIFY_ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


def scrub_notify_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``env`` (default ``os.environ``) without the notification variables, for
    child processes: only the supervisor talks to systemd."""
    src = os.environ if env is None else env
    return {k: v for k, v in src.items() if k not in NOTIFY_ENV_VARS}


# --------------------------------------------------------------------------- unit files


def default_paths(user_mode: bool) -> dict[str, Path]:
    """Default install locations: ``config_dir``, ``runs_dir``, ``env_dir``,
    ``working_dir`` and ``unit_dir`` (where the unit file is installed)."""
    if user_mode:
        home = Path.home()
        config_home = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        data_home = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
        config_dir = config_home / "dflash-ipc"
        state = data_home / "dflash-ipc"
        unit_dir = config_home / "systemd" / "user"
    else:
        config_dir = Path("/etc/dflash-ipc")
        state = Path("/var/lib/dflash-ipc")
        unit_dir = Path("/etc/systemd/system")
    return {
        "config_dir": config_dir,
        "runs_dir": state / "runs",
        "env_dir": config_dir,
        "working_dir": state,
        "unit_dir": unit_dir,
    }


def default_exec() -> list[str]:
    """The command that runs the CLI: the ``dflash-ipc`` console script installed next to
    ``sys.executable``, else ``sys.executable -m dflash_ipc.cli``."""
    py = Path(sys.executable)
    script = py.parent / "dflash-ipc"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [str(py), "-m", "dflash_ipc.cli"]


def _abs(p: str | os.PathLike[str]) -> Path:
    # absolute() and not resolve(): a venv's bin/python symlink must stay as it is.
    return Path(os.path.expanduser(os.fspath(p))).absolute()


def _check_chars(value: str, what: str) -> None:
    bad = [c for c in value if c in "\n\r\0"]
    if bad:
        raise ValueError(f"{what}: {value!r} contains a newline or NUL, which a unit file cannot hold")


def _esc(value: str) -> str:
    """Escape systemd specifiers ('%') in a literal value."""
    return value.replace("%", "%%")


def _exec_word(value: str) -> str:
    """One ExecStart= word: specifiers and '$' escaped, quoted when needed.

    ``%i`` already present in ``value`` is kept as a specifier by the callers, who escape
    the literal part first; so this escapes only '$', quotes and backslashes."""
    value = value.replace("$", "$$")
    if value and not any(c in value for c in " \t\"'\\;"):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit_text(
    *,
    exec_path: str | os.PathLike[str] | Sequence[str] | None = None,
    config_dir: str | os.PathLike[str] | None = None,
    runs_dir: str | os.PathLike[str] | None = None,
    env_dir: str | os.PathLike[str] | None = None,
    working_dir: str | os.PathLike[str] | None = None,
    user_mode: bool = False,
    service_user: str | None = None,
    timeout_start_s: int = DEFAULT_TIMEOUT_START_S,
    timeout_stop_s: int = DEFAULT_TIMEOUT_STOP_S,
    watchdog_s: int = DEFAULT_WATCHDOG_S,
) -> str:
    """The text of the rendered ``dflash-ipc@.service`` (see :func:`render_units`)."""
    defaults = default_paths(user_mode)
    if exec_path is None:
        cmd = default_exec()
    elif isinstance(exec_path, (str, os.PathLike)):
        cmd = [str(_abs(exec_path))]
    else:
        cmd = [str(x) for x in exec_path]
        if not cmd:
            raise ValueError("exec_path: empty command")
        cmd[0] = str(_abs(cmd[0]))
    cfg = _abs(config_dir) if config_dir is not None else defaults["config_dir"]
    runs = _abs(runs_dir) if runs_dir is not None else defaults["runs_dir"]
    envd = _abs(env_dir) if env_dir is not None else (cfg if config_dir is not None else defaults["env_dir"])
    work = _abs(working_dir) if working_dir is not None else runs.parent
    for what, val in (("exec_path", " ".join(cmd)), ("config_dir", str(cfg)), ("runs_dir", str(runs)),
                      ("env_dir", str(envd)), ("working_dir", str(work))):
        _check_chars(val, what)
    if int(timeout_start_s) < 1:
        raise ValueError(f"timeout_start_s must be >= 1 (got {timeout_start_s})")
    if int(timeout_stop_s) < 1:
        raise ValueError(f"timeout_stop_s must be >= 1 (got {timeout_stop_s})")
    if int(watchdog_s) < 0:
        raise ValueError(f"watchdog_s must be >= 0, 0 disables it (got {watchdog_s})")
    if service_user is not None:
        if user_mode:
            raise ValueError("service_user: a user unit always runs as its user; drop it or render a system unit")
        if not service_user or any(c.isspace() or c in "%$\"'\\" for c in service_user):
            raise ValueError(f"service_user: {service_user!r} is not a valid user name")

    values = {
        "EXEC": " ".join(_exec_word(_esc(w)) for w in cmd),
        "CONFIG_ARG": _exec_word(_esc(str(cfg)) + "/%i.toml"),
        "RUN_DIR_ARG": _exec_word(_esc(str(runs)) + "/%i"),
        "WORKING_DIR": _esc(str(work)),
        "ENV_FILE": _esc(str(envd)) + "/%i.env",
        # Only in comments: no escaping.
        "ENV_DIR": str(envd),
        "CONFIG_DIR": str(cfg),
        "RUNS_DIR": str(runs),
        "TIMEOUT_START": f"{int(timeout_start_s)}s",
        "TIMEOUT_STOP": f"{int(timeout_stop_s)}s",
        "WATCHDOG": f"{int(watchdog_s)}s" if int(watchdog_s) else "0",
        "WANTED_BY": "default.target" if user_mode else "multi-user.target",
        # A user manager has no network-online.target / remote-fs.target.
        "UNIT_DEPS": "" if user_mode else (
            "# Datasets or checkpoints may live on network filesystems.\n"
            "Wants=network-online.target\n"
            "After=network-online.target remote-fs.target"
        ),
        "USER_LINE": f"User={service_user}" if service_user else "",
    }
    return fill_template(UNIT_TEMPLATE, values)


def fill_template(template: str, values: Mapping[str, str]) -> str:
    """Replace ``@NAME@`` placeholders; a placeholder alone on a line with an empty value
    removes the line. Raises ``ValueError`` for a placeholder without a value."""
    out = []
    for line in template.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("@") and stripped.endswith("@") and stripped[1:-1] in values and not values[stripped[1:-1]]:
            continue
        for name, val in values.items():
            line = line.replace(f"@{name}@", val)
        out.append(line)
    text = "".join(out)
    left = sorted(set(re.findall(r"@([A-Z_]+)@", text)))
    if left:
        raise ValueError(f"template placeholders without a value: {', '.join(left)}")
    return text


def render_units(
    out_dir: str | os.PathLike[str],
    *,
    exec_path: str | os.PathLike[str] | Sequence[str] | None = None,
    config_dir: str | os.PathLike[str] | None = None,
    runs_dir: str | os.PathLike[str] | None = None,
    env_dir: str | os.PathLike[str] | None = None,
    user_mode: bool = False,
    timeout_stop_s: int = DEFAULT_TIMEOUT_STOP_S,
    watchdog_s: int = DEFAULT_WATCHDOG_S,
    timeout_start_s: int = DEFAULT_TIMEOUT_START_S,
    working_dir: str | os.PathLike[str] | None = None,
    service_user: str | None = None,
) -> list[Path]:
    """Render ``dflash-ipc@.service`` and ``dflash-ipc.env.example`` into ``out_dir``.

    Paths become absolute. Defaults (``None``): see :func:`default_paths` (system:
    ``/etc/dflash-ipc``, ``/var/lib/dflash-ipc/runs``; user: ``~/.config/dflash-ipc``,
    ``~/.local/share/dflash-ipc/runs``); ``env_dir`` defaults to ``config_dir``;
    ``working_dir`` to the parent of ``runs_dir``; ``exec_path`` to :func:`default_exec`
    (a path, or a command as a list of words). ``watchdog_s=0`` disables the watchdog.
    Returns the written paths, the unit first.
    """
    text = render_unit_text(
        exec_path=exec_path,
        config_dir=config_dir,
        runs_dir=runs_dir,
        env_dir=env_dir,
        working_dir=working_dir,
        user_mode=user_mode,
        service_user=service_user,
        timeout_start_s=timeout_start_s,
        timeout_stop_s=timeout_stop_s,
        watchdog_s=watchdog_s,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    unit = out / UNIT_NAME
    env = out / ENV_EXAMPLE_NAME
    unit.write_text(text)
    env.write_text(ENV_EXAMPLE)
    return [unit, env]


def _unit_values(unit_text: str) -> dict[str, str]:
    vals: dict[str, str] = {}
    for line in unit_text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            k, _, v = line.partition("=")
            vals[k.strip()] = v.strip()
    return vals


def install_instructions(unit_path: Path, *, user_mode: bool, instance: str = "myrun") -> str:
    """Shell lines that install and start a rendered unit (what ``render`` prints)."""
    vals = _unit_values(unit_path.read_text())
    env_file = vals.get("EnvironmentFile", "").lstrip("-").replace("%i", instance).replace("%%", "%")
    work = vals.get("WorkingDirectory", "").lstrip("-").replace("%%", "%")
    words = shlex.split(vals.get("ExecStart", "").replace("$$", "\0"))
    cfg = run_dir = ""
    for flag, nxt in zip(words, words[1:]):
        if flag == "--config":
            cfg = nxt.replace("%i", instance).replace("%%", "%").replace("\0", "$")
        elif flag == "--run-dir":
            run_dir = nxt.replace("%i", instance).replace("%%", "%").replace("\0", "$")
    q = shlex.quote
    if user_mode:
        unit_dir = default_paths(True)["unit_dir"]
        sc, sudo = "systemctl --user", ""
    else:
        unit_dir = default_paths(False)["unit_dir"]
        sc, sudo = "sudo systemctl", "sudo "
    lines = [
        f"# install the unit (instance name = config name, e.g. {instance}):",
        f"{sudo}mkdir -p {q(str(unit_dir))} {q(str(Path(cfg).parent))} {q(str(Path(run_dir).parent))} {q(work)}",
        f"{sudo}install -m 0644 {q(str(unit_path))} {q(str(unit_dir / UNIT_NAME))}",
        f"{sudo}cp configs/{instance}.toml {q(cfg)}",
        f"# optional: {sudo}cp {q(str(unit_path.parent / ENV_EXAMPLE_NAME))} {q(env_file)}  (then edit)",
        f"{sc} daemon-reload",
        f"{sc} enable --now dflash-ipc@{instance}",
    ]
    if user_mode:
        lines.append("loginctl enable-linger \"$USER\"   # keep it running without a login session")
    lines.append(f"journalctl {'--user ' if user_mode else ''}-u dflash-ipc@{instance} -f")
    return "\n".join(lines)


def render_command_impl(
    out: str | os.PathLike[str],
    *,
    user_mode: bool = False,
    config_dir: str | os.PathLike[str] | None = None,
    runs_dir: str | os.PathLike[str] | None = None,
    env_dir: str | os.PathLike[str] | None = None,
    exec_path: str | os.PathLike[str] | Sequence[str] | None = None,
    working_dir: str | os.PathLike[str] | None = None,
    service_user: str | None = None,
    timeout_start_s: int = DEFAULT_TIMEOUT_START_S,
    timeout_stop_s: int = DEFAULT_TIMEOUT_STOP_S,
    watchdog_s: int = DEFAULT_WATCHDOG_S,
    echo: Callable[[str], None] = print,
) -> list[Path]:
    """``dflash-ipc systemd render``: render the files and print how to install them."""
    paths = render_units(
        out,
        exec_path=exec_path,
        config_dir=config_dir,
        runs_dir=runs_dir,
        env_dir=env_dir,
        user_mode=user_mode,
        timeout_stop_s=timeout_stop_s,
        watchdog_s=watchdog_s,
        timeout_start_s=timeout_start_s,
        working_dir=working_dir,
        service_user=service_user,
    )
    for p in paths:
        echo(f"wrote {p}")
    echo(install_instructions(paths[0], user_mode=user_mode))
    return paths


def verify_unit(
    unit_path: str | os.PathLike[str],
    instance: str = "example",
    *,
    user_mode: bool = False,
    systemd_analyze: str | None = None,
    timeout_s: float = 60.0,
) -> tuple[int, str]:
    """Run ``systemd-analyze verify`` on instance ``instance`` of a rendered template.

    Returns ``(exit status, problems)``: ``problems`` holds the lines of its output that
    concern this unit (unknown keys, bad values, a missing or non-executable ExecStart
    binary); empty when the unit is clean. Raises ``FileNotFoundError`` when
    ``systemd-analyze`` is not installed.
    """
    tool = systemd_analyze or shutil.which("systemd-analyze")
    if not tool:
        raise FileNotFoundError("systemd-analyze not found")
    unit_path = Path(unit_path)
    inst_name = f"dflash-ipc@{instance}.service"
    with tempfile.TemporaryDirectory(prefix="dflash-verify-") as tmp:
        d = Path(tmp) / "units"
        d.mkdir()
        text = unit_path.read_text()
        (d / UNIT_NAME).write_text(text)
        (d / inst_name).write_text(text)
        env = dict(os.environ, SYSTEMD_LOG_LEVEL="notice", SYSTEMD_PAGER="", SYSTEMD_COLORS="0")
        cmd = [tool]
        if user_mode:
            rt = Path(tmp) / "runtime"
            rt.mkdir(mode=0o700)
            env["XDG_RUNTIME_DIR"] = str(rt)
            cmd.append("--user")
        cmd += ["verify", "--man=no", str(d / inst_name)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        output = proc.stdout + proc.stderr
        ours = [
            line for line in output.splitlines()
            if str(d) in line or "dflash-ipc@" in line or "dflash\\x2dipc" in line
        ]
        problems = "\n".join(ours)
        if proc.returncode != 0 and not problems:
            problems = output.strip()
        return proc.returncode, problems


# --------------------------------------------------------------------------- CLI


@click.group("systemd")
def systemd_group() -> None:
    """Run training as a systemd service: dflash-ipc@NAME for configs/NAME.toml."""


def _path_opt(name: str, help_text: str):  # noqa: ANN202
    return click.option(name, type=click.Path(path_type=Path), default=None, help=help_text)


@systemd_group.command("render")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write dflash-ipc@.service and dflash-ipc.env.example into.")
@click.option("--user", "user_mode", is_flag=True, help="Render a user unit (systemctl --user) instead of a system unit.")
@_path_opt("--config-dir", "Directory of NAME.toml configs [/etc/dflash-ipc; --user: ~/.config/dflash-ipc].")
@_path_opt("--runs-dir", "Parent of the run directories [/var/lib/dflash-ipc/runs; --user: ~/.local/share/dflash-ipc/runs].")
@_path_opt("--env-dir", "Directory of the optional NAME.env files [the config dir].")
@_path_opt("--working-dir", "Working directory of the service [parent of the runs dir].")
@click.option("--exec", "exec_cmd", default=None,
              help="Command that runs dflash-ipc [the dflash-ipc script next to this Python].")
@click.option("--service-user", default=None, help="System units only: run as this user (User=).")
@click.option("--timeout-start", type=click.IntRange(min=1), default=DEFAULT_TIMEOUT_START_S, show_default=True,
              help="Seconds allowed from start to READY (model loading, handshakes).")
@click.option("--timeout-stop", type=click.IntRange(min=1), default=DEFAULT_TIMEOUT_STOP_S, show_default=True,
              help="Seconds allowed for the shutdown checkpoint before SIGKILL.")
@click.option("--watchdog", type=click.IntRange(min=0), default=DEFAULT_WATCHDOG_S, show_default=True,
              help="WatchdogSec in seconds; 0 disables it.")
def render_cmd(out: Path, user_mode: bool, config_dir: Path | None, runs_dir: Path | None, env_dir: Path | None,
               working_dir: Path | None, exec_cmd: str | None, service_user: str | None, timeout_start: int,
               timeout_stop: int, watchdog: int) -> None:
    """Render the dflash-ipc@.service template unit for this install."""
    try:
        render_command_impl(
            out,
            user_mode=user_mode,
            config_dir=config_dir,
            runs_dir=runs_dir,
            env_dir=env_dir,
            working_dir=working_dir,
            exec_path=shlex.split(exec_cmd) if exec_cmd else None,
            service_user=service_user,
            timeout_start_s=timeout_start,
            timeout_stop_s=timeout_stop,
            watchdog_s=watchdog,
            echo=click.echo,
        )
    except ValueError as e:
        raise click.UsageError(str(e)) from None


@systemd_group.command("verify")
@click.argument("unit", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--user", "user_mode", is_flag=True, help="Verify as a user unit.")
@click.option("--instance", default="example", show_default=True, help="Instance name to verify with.")
def verify_cmd(unit: Path, user_mode: bool, instance: str) -> None:
    """Check a rendered unit with systemd-analyze verify."""
    try:
        rc, problems = verify_unit(unit, instance, user_mode=user_mode)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    if problems:
        click.echo(problems, err=True)
    if rc != 0 or problems:
        raise SystemExit(1)
    click.echo(f"{unit}: ok")
