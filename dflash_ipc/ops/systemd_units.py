"""Running a training run as a systemd service: the unit files, rendered and verified.

:func:`render_units` renders the template unit ``dflash-ipc@.service`` (one instance per run;
the instance name is the config name) and an example environment file for a concrete install:
absolute paths to the ``dflash-ipc`` executable, the config directory
(``<config_dir>/<instance>.toml``), the runs directory (``<runs_dir>/<instance>``) and the
directory of the optional per-instance environment files. ``dflash-ipc systemd render --out DIR
[--user]`` (:mod:`dflash_ipc.cli.systemd`) is the command line for it. The template shipped
as ``systemd/dflash-ipc@.service`` in the source tree is :data:`UNIT_TEMPLATE`, verbatim, with
its ``@NAME@`` placeholders. :func:`verify_unit` checks a rendered unit with
``systemd-analyze verify``. The notifications the running service sends are
:mod:`dflash_ipc.ops.sdnotify`.

The supervisor should exit with status 2 on configuration or usage errors: the unit sets
``RestartPreventExitStatus=2`` so such a failure is not restarted in a loop.
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

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
# `up --resume` refuses a run directory that does not exist (a mistyped one must not start a new
# run): the first start makes it, empty (then --resume starts from scratch).
ExecStartPre=@MKDIR@ -p -m 0700 @RUN_DIR_ARG@
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
# exits. SIGTERM to every process of the unit (`systemctl kill`, KillMode=control-group) is
# the same stop: each process of the run takes it for one. Whatever is still running when
# TimeoutStopSec runs out is SIGKILLed.
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
    for what, val in (
        ("exec_path", " ".join(cmd)),
        ("config_dir", str(cfg)),
        ("runs_dir", str(runs)),
        ("env_dir", str(envd)),
        ("working_dir", str(work)),
    ):
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
        "MKDIR": _exec_word(_esc(shutil.which("mkdir") or "/bin/mkdir")),
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
        "UNIT_DEPS": ""
        if user_mode
        else (
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


def render_units(out_dir: str | os.PathLike[str], **unit_options) -> list[Path]:
    """Render ``dflash-ipc@.service`` and ``dflash-ipc.env.example`` into ``out_dir``;
    ``unit_options``: the keywords of :func:`render_unit_text`.

    Paths become absolute. Defaults (``None``): see :func:`default_paths` (system:
    ``/etc/dflash-ipc``, ``/var/lib/dflash-ipc/runs``; user: ``~/.config/dflash-ipc``,
    ``~/.local/share/dflash-ipc/runs``); ``env_dir`` defaults to ``config_dir``;
    ``working_dir`` to the parent of ``runs_dir``; ``exec_path`` to :func:`default_exec`
    (a path, or a command as a list of words). ``watchdog_s=0`` disables the watchdog.
    Returns the written paths, the unit first.
    """
    text = render_unit_text(**unit_options)
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
    for flag, nxt in itertools.pairwise(words):
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
        lines.append('loginctl enable-linger "$USER"   # keep it running without a login session')
    lines.append(f"journalctl {'--user ' if user_mode else ''}-u dflash-ipc@{instance} -f")
    return "\n".join(lines)


def render_command_impl(out: str | os.PathLike[str], *, echo: Callable[[str], None] = print, **unit_options) -> list[Path]:
    """``dflash-ipc systemd render``: render the files (``unit_options``: see :func:`render_unit_text`)
    and print how to install them."""
    paths = render_units(out, **unit_options)
    for p in paths:
        echo(f"wrote {p}")
    echo(install_instructions(paths[0], user_mode=unit_options.get("user_mode", False)))
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
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=timeout_s)
        output = proc.stdout + proc.stderr
        ours = [line for line in output.splitlines() if str(d) in line or "dflash-ipc@" in line or "dflash\\x2dipc" in line]
        problems = "\n".join(ours)
        if proc.returncode != 0 and not problems:
            problems = output.strip()
        return proc.returncode, problems
