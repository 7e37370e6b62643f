"""fsutil on real files: no write follows a planted link, private means 0700/0600 whatever the umask,
and a directory replaced whole is either the old one or the new one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ipc.rundir.fsutil import (
    LinkRefused,
    NotPrivate,
    check_own_private,
    links_below,
    make_private_dir,
    open_append,
    replace_dir,
    write_text_atomic,
)


@contextlib.contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def victim(tmp_path) -> Path:
    v = tmp_path / "victim"
    v.write_text("keep me\n")
    return v


def test_no_write_follows_a_link_at_its_name_or_below_its_root(tmp_path, victim):
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").symlink_to(victim)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    (run / "logs").symlink_to(elsewhere)  # a linked directory: what is written "in" it would land elsewhere
    with pytest.raises(LinkRefused, match=r"plan.json is a symbolic link \(-> .*victim\)"):
        write_text_atomic(run / "plan.json", "{}")
    with pytest.raises(LinkRefused, match="plan.json is a symbolic link"):
        open_append(run / "plan.json")
    with pytest.raises(LinkRefused, match="logs is a symbolic link"):
        write_text_atomic(run / "logs" / "victim", "x", root=run)
    with pytest.raises(LinkRefused, match="logs is a symbolic link"):
        open_append(run / "logs" / "victim", root=run)
    with pytest.raises(LinkRefused, match="logs is a symbolic link"):
        make_private_dir(run / "logs", root=run)
    assert victim.read_text() == "keep me\n" and mode(elsewhere) == 0o755 and os.listdir(elsewhere) == []
    assert sorted(os.listdir(run)) == ["logs", "plan.json"]  # no temporary file left


def test_private_files_and_directories_whatever_the_umask(tmp_path):
    with umask(0):
        made = make_private_dir(tmp_path / "a" / "b" / "c")
        write_text_atomic(made / "f", "x")
        with open_append(made / "log") as f:
            f.write("line\n")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c", "a/b/c/f", "a/b/c/log")] == [0o700] * 3 + [0o600] * 2


def test_a_directory_of_another_mode_or_user_is_not_private(tmp_path):
    d = tmp_path / "d"
    d.mkdir(mode=0o700)
    check_own_private(d, os.lstat(d), "the cache")
    d.chmod(0o1777)
    with pytest.raises(NotPrivate, match="the cache is mode 1777: other users can write it"):
        check_own_private(d, os.lstat(d), "the cache")
    if os.geteuid() == 0:
        d.chmod(0o700)
        os.chown(d, 65534, 65534)
        with pytest.raises(NotPrivate, match="the cache belongs to uid 65534"):
            check_own_private(d, os.lstat(d), "the cache")


def test_links_below_lists_every_link_but_the_allowed_ones(tmp_path, victim):
    (tmp_path / "sock").symlink_to(tmp_path)
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "sock").symlink_to(victim)
    (tmp_path / "a" / "dir").symlink_to(tmp_path / "a")
    assert links_below(tmp_path, allowed=frozenset({"sock"})) == [tmp_path / "a" / "b" / "sock", tmp_path / "a" / "dir"]


def write_files(files: dict[str, str]):
    def fill(d: Path) -> None:
        for name, text in files.items():
            (d / name).write_text(text)

    return fill


def test_a_replaced_directory_is_the_old_one_until_the_new_one_is_whole(tmp_path):
    out = tmp_path / "out"
    replace_dir(out, write_files({"a": "1", "b": "1"}))
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a": "1", "b": "1"} and mode(out) == 0o755

    def half_then_fail(d: Path) -> None:
        (d / "a").write_text("2")
        raise OSError("disk gone")

    with pytest.raises(OSError, match="disk gone"):
        replace_dir(out, half_then_fail)
    assert {p.name: p.read_text() for p in out.iterdir()} == {"a": "1", "b": "1"}
    assert sorted(os.listdir(tmp_path)) == ["out"]
    replace_dir(out, write_files({"c": "3"}))
    assert {p.name: p.read_text() for p in out.iterdir()} == {"c": "3"} and sorted(os.listdir(tmp_path)) == ["out"]


def test_a_killed_writers_staging_is_removed_a_live_ones_kept(tmp_path):
    out = tmp_path / "out"
    stale, live = tmp_path / ".out.staged-dead", tmp_path / ".out.staged-busy"
    for d in (stale, live):
        d.mkdir()
        (d / "half").write_text("x")
    fd = os.open(live, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as its writer holds it
        replace_dir(out, write_files({"a": "1"}))
        assert sorted(os.listdir(tmp_path)) == [".out.staged-busy", "out"]
    finally:
        os.close(fd)


def test_a_link_in_place_of_the_directory_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "out").symlink_to(target)
    with pytest.raises(LinkRefused):
        replace_dir(tmp_path / "out", write_files({"a": "1"}))
    assert os.listdir(target) == [] and sorted(os.listdir(tmp_path)) == ["elsewhere", "out"]
