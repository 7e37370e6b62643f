"""systemd unit rendering (checked with systemd-analyze verify) and the sd_notify protocol."""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner

from dflash_ipc.cli.systemd import systemd_group
from dflash_ipc.ops import sdnotify
from dflash_ipc.ops import systemd_units as sd

REPO = Path(__file__).resolve().parents[2]
HAVE_ANALYZE = shutil.which("systemd-analyze") is not None
needs_analyze = pytest.mark.skipif(not HAVE_ANALYZE, reason="systemd-analyze not installed")


def _values(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def _fake_exec(tmp_path: Path) -> Path:
    exe = tmp_path / "bin" / "dflash-ipc"
    exe.parent.mkdir()
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    return exe


# --------------------------------------------------------------------------- shipped files


def test_shipped_files_match_module():
    assert (REPO / "systemd" / "dflash-ipc@.service").read_text() == sd.UNIT_TEMPLATE
    assert (REPO / "systemd" / "dflash-ipc.env.example").read_text() == sd.ENV_EXAMPLE


def test_env_example_is_only_comments_or_assignments():
    for line in sd.ENV_EXAMPLE.splitlines():
        assert not line or line.startswith("#") or "=" in line, line


# --------------------------------------------------------------------------- rendering


def test_render_system_unit(tmp_path):
    exe = _fake_exec(tmp_path)
    paths = sd.render_units(
        tmp_path / "out",
        exec_path=exe,
        config_dir=tmp_path / "cfg",
        runs_dir=tmp_path / "runs",
        env_dir=tmp_path / "env",
        user_mode=False,
    )
    assert [p.name for p in paths] == ["dflash-ipc@.service", "dflash-ipc.env.example"]
    text = paths[0].read_text()
    assert "@" not in text.replace("dflash-ipc@", "").replace("%i", ""), "unfilled placeholder"
    v = _values(text)
    assert v["Type"] == ["notify"] and v["NotifyAccess"] == ["main"]
    assert v["ExecStart"] == [f"{exe} up --config {tmp_path}/cfg/%i.toml --run-dir {tmp_path}/runs/%i --resume $DFLASH_IPC_ARGS"]
    # the first start makes the run dir `up --resume` needs (it refuses one that does not exist)
    assert v["ExecStartPre"] == [f"{shutil.which('mkdir')} -p -m 0700 {tmp_path}/runs/%i"]
    assert v["WatchdogSec"] == ["120s"] and v["TimeoutStopSec"] == ["600s"]
    assert v["Restart"] == ["on-failure"] and "RestartSec" in v
    assert v["KillSignal"] == ["SIGTERM"] and v["KillMode"] == ["mixed"]
    assert v["LimitMEMLOCK"] == ["infinity"]
    assert v["EnvironmentFile"] == [f"-{tmp_path}/env/%i.env"]
    assert v["WorkingDirectory"] == [f"-{tmp_path}"]
    assert "StartLimitIntervalSec" in v and "StartLimitBurst" in v
    assert v["WantedBy"] == ["multi-user.target"]
    assert "network-online.target" in v["Wants"][0]
    assert "User" not in v


def test_render_user_unit_and_options(tmp_path):
    exe = _fake_exec(tmp_path)
    (unit, _env) = sd.render_units(
        tmp_path / "out",
        exec_path=exe,
        config_dir="cfg",
        runs_dir=tmp_path / "runs",
        env_dir=None,
        user_mode=True,
        timeout_stop_s=1200,
        watchdog_s=0,
    )
    v = _values(unit.read_text())
    assert v["WantedBy"] == ["default.target"]
    assert "Wants" not in v and "After" not in v  # no network-online.target in a user manager
    assert v["TimeoutStopSec"] == ["1200s"] and v["WatchdogSec"] == ["0"]
    cfg = Path("cfg").absolute()  # relative paths become absolute
    assert f"--config {cfg}/%i.toml" in v["ExecStart"][0]
    assert v["EnvironmentFile"] == [f"-{cfg}/%i.env"]  # env_dir defaults to config_dir


def test_default_exec_is_installed_script_or_module():
    cmd = sd.default_exec()
    script = Path(sys.executable).parent / "dflash-ipc"
    if script.exists():
        assert cmd == [str(script)]
    else:
        assert cmd == [sys.executable, "-m", "dflash_ipc.cli"]
    assert os.path.isabs(cmd[0])


def test_render_rejects_bad_values(tmp_path):
    with pytest.raises(ValueError, match="timeout_stop_s"):
        sd.render_units(tmp_path, timeout_stop_s=0)
    with pytest.raises(ValueError, match="newline"):
        sd.render_units(tmp_path, runs_dir="/a\nb")
    with pytest.raises(ValueError, match="service_user"):
        sd.render_units(tmp_path, user_mode=True, service_user="bob")
    with pytest.raises(ValueError, match="WHAT"):
        sd.fill_template("x=@WHAT@\n", {})


def test_fill_template_drops_empty_placeholder_lines():
    assert sd.fill_template("a\n@X@\nb=@Y@\n", {"X": "", "Y": "1"}) == "a\nb=1\n"


def test_render_command_prints_install_steps(tmp_path):
    out: list[str] = []
    paths = sd.render_command_impl(tmp_path / "o", user_mode=True, runs_dir=tmp_path / "runs", echo=out.append)
    text = "\n".join(out)
    assert str(paths[0]) in text
    assert "systemctl --user enable --now dflash-ipc@myrun" in text
    assert "loginctl enable-linger" in text
    assert "mkdir -p" in text and str(tmp_path / "runs") in text


def test_click_render_command(tmp_path):
    exe = _fake_exec(tmp_path)
    res = CliRunner().invoke(
        systemd_group,
        [
            "render",
            "--out",
            str(tmp_path / "o"),
            "--runs-dir",
            str(tmp_path / "r"),
            "--exec",
            str(exe),
            "--timeout-stop",
            "900",
            "--service-user",
            "train",
        ],
    )
    assert res.exit_code == 0, res.output
    v = _values((tmp_path / "o" / sd.UNIT_NAME).read_text())
    assert v["TimeoutStopSec"] == ["900s"] and v["User"] == ["train"]
    res = CliRunner().invoke(systemd_group, ["render", "--out", str(tmp_path / "p"), "--user", "--service-user", "x"])
    assert res.exit_code == 2 and "service_user" in res.output


# --------------------------------------------------------------------------- systemd-analyze verify


@needs_analyze
@pytest.mark.parametrize("user_mode", [False, True], ids=["system", "user"])
def test_rendered_units_pass_systemd_analyze_verify(tmp_path, user_mode):
    exe = _fake_exec(tmp_path)
    (unit, _) = sd.render_units(
        tmp_path / "out",
        exec_path=exe,
        config_dir=tmp_path / "cfg",
        runs_dir=tmp_path / "runs",
        env_dir=tmp_path / "env",
        user_mode=user_mode,
    )
    rc, problems = sd.verify_unit(unit, "tiny-cpu", user_mode=user_mode)
    assert rc == 0 and problems == "", problems


@needs_analyze
def test_default_render_passes_verify(tmp_path):
    """Default paths and the real installed executable (script or sys.executable)."""
    (unit, _) = sd.render_units(tmp_path)
    rc, problems = sd.verify_unit(unit, "tiny-cpu")
    assert rc == 0 and problems == "", problems


@needs_analyze
def test_awkward_paths_pass_verify(tmp_path):
    """Spaces, '%' and '$' in paths are quoted/escaped; the module form of ExecStart."""
    (unit, _) = sd.render_units(
        tmp_path,
        exec_path=[sys.executable, "-m", "dflash_ipc.cli"],
        runs_dir=tmp_path / "my runs %x $y",
        config_dir=tmp_path / "c fg",
    )
    text = unit.read_text()
    assert '"' + str(tmp_path / "my runs %%x $$y") + '/%i"' in text
    rc, problems = sd.verify_unit(unit, "tiny-cpu")
    assert rc == 0 and problems == "", problems


@needs_analyze
def test_verify_catches_problems(tmp_path):
    """The checker itself: an unknown key and a missing binary are reported."""
    exe = _fake_exec(tmp_path)
    (unit, _) = sd.render_units(tmp_path / "out", exec_path=exe)
    unit.write_text(unit.read_text().replace("LimitMEMLOCK=", "LimitMEMLOK="))
    rc, problems = sd.verify_unit(unit, "tiny-cpu")
    assert "LimitMEMLOK" in problems
    exe.unlink()
    rc, problems = sd.verify_unit(unit, "tiny-cpu")
    assert rc != 0 and "not executable" in problems


@needs_analyze
def test_click_verify_command(tmp_path):
    exe = _fake_exec(tmp_path)
    (unit, _) = sd.render_units(tmp_path / "out", exec_path=exe, user_mode=True)
    res = CliRunner().invoke(systemd_group, ["verify", "--user", str(unit)])
    assert res.exit_code == 0, res.output


# --------------------------------------------------------------------------- sd_notify


@pytest.fixture
def receiver():
    """A bound AF_UNIX datagram socket; yields a function(form) -> (NOTIFY_SOCKET value, sock)."""
    socks: list[socket.socket] = []
    tmpdir = tempfile.mkdtemp(prefix="dfn-", dir="/tmp")  # short: sun_path is 108 bytes

    def make(form: str):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.settimeout(5)
        socks.append(s)
        if form == "path":
            path = os.path.join(tmpdir, "notify.sock")
            s.bind(path)
            return path, s
        name = f"dflash-ipc-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        s.bind("\0" + name)
        return "@" + name, s

    yield make
    for s in socks:
        s.close()
    shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.parametrize("form", ["path", "abstract"])
def test_sd_notify_delivers_ready(receiver, monkeypatch, form):
    addr, sock = receiver(form)
    monkeypatch.setenv("NOTIFY_SOCKET", addr)
    assert sdnotify.notify_ready() is True
    assert sock.recv(4096) == b"READY=1"
    assert sdnotify.notify_ready("all 4 processes up") is True
    assert sock.recv(4096) == b"READY=1\nSTATUS=all 4 processes up"
    assert sdnotify.notify_watchdog() is True
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert sdnotify.notify_status("step 10\nloss 2.0") is True
    assert sock.recv(4096) == b"STATUS=step 10 loss 2.0"  # one line
    assert sdnotify.notify_stopping() is True
    assert sock.recv(4096) == b"STOPPING=1"
    assert sdnotify.notify_extend_timeout(2.5) is True
    assert sock.recv(4096) == b"EXTEND_TIMEOUT_USEC=2500000"


def test_sd_notify_noop_when_unset(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.sd_notify("READY=1") is False
    assert sdnotify.notify_ready() is False
    assert sdnotify.notify_watchdog() is False


def test_sd_notify_failures_do_not_raise(monkeypatch, tmp_path):
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.sd_notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", "vsock:2:1234")
    assert sdnotify.sd_notify("READY=1") is False


def test_watchdog_interval(monkeypatch):
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.setenv("WATCHDOG_USEC", "120000000")
    assert sdnotify.watchdog_interval_s() == 120.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert sdnotify.watchdog_interval_s() == 120.0
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert sdnotify.watchdog_interval_s() is None
    monkeypatch.delenv("WATCHDOG_PID")
    for bad in ("0", "-5", "abc", ""):
        monkeypatch.setenv("WATCHDOG_USEC", bad)
        assert sdnotify.watchdog_interval_s() is None


def test_scrub_notify_env():
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1", "WATCHDOG_PID": "2", "PATH": "/bin"}
    assert sdnotify.scrub_notify_env(env) == {"PATH": "/bin"}
