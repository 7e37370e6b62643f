"""Files that readers never see half-written, written without following a link planted on the way,
and directories private to the user.

Every write under a run directory goes through here. ``root`` names the directory the caller trusts
as it is given (the run directory, reached through whatever links its own path has); every component
below it is opened with ``O_NOFOLLOW`` relative to its parent's descriptor, so a symbolic link planted
there (``ln -s ~/victim RUN_DIR/plan.json``, or a linked ``RUN_DIR/export``) is refused with
:class:`LinkRefused` naming it, never written through. Without ``root`` the file's own directory is
trusted as given and only the file's name is checked.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class LinkRefused(OSError):
    """A symbolic link where dflash-ipc writes: refused, the file it points at left untouched."""

    def __init__(self, path: Path, what: str = "writes"):
        try:
            target = f" (-> {os.readlink(path)})"
        except OSError:
            target = ""
        super().__init__(
            errno.ELOOP,
            f"{path} is a symbolic link{target}: dflash-ipc {what} nothing through a link there; remove the link",
        )
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


class NotPrivate(OSError):
    """A directory or file outside the run directory that another user could have made or changed."""

    def __init__(self, path: Path, why: str, fix: str):
        super().__init__(errno.EPERM, f"{path}: {why}; {fix}")
        self.path = path

    def __str__(self) -> str:
        return str(self.strerror)


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _open_below(parent_fd: int, name: str, shown: Path, *, create: bool) -> int:
    """An O_DIRECTORY descriptor of ``name`` in ``parent_fd``, never through a link (made 0700 if ``create``)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=parent_fd)
    try:
        return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(name, parent_fd):
            raise LinkRefused(shown) from None
        raise


@contextlib.contextmanager
def open_dir(path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, create: bool = False) -> Iterator[int]:
    """A descriptor of the directory ``path``, every component below ``root`` (default: ``path`` itself)
    opened without following a link; ``create`` makes the missing ones 0700 (missing ancestors of
    ``root`` too)."""
    path = Path(path)
    base = Path(root) if root is not None else path
    parts = path.relative_to(base).parts
    if create and not base.is_dir():
        make_private_dirs(base)
    fd = os.open(base, _DIR_FLAGS)
    try:
        shown = base
        for part in parts:
            shown = shown / part
            child = _open_below(fd, part, shown, create=create)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def make_private_dirs(path: str | os.PathLike[str]) -> None:
    """``path`` and its missing ancestors made 0700, whatever the umask (``os.makedirs`` masks its mode)."""
    path = Path(path)
    missing = []
    while not path.exists() and not path.is_symlink():
        missing.append(path)
        path = path.parent
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, PRIVATE_DIR_MODE)


def make_private_dir(path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None) -> Path:
    """``path`` made (with its missing parents) and set to mode 0700, never through a link below ``root``
    (without ``root``: ``path`` is trusted as given, a run directory named through a link of the user's)."""
    path = Path(path)
    with open_dir(path, root=root, create=True) as fd:
        os.fchmod(fd, PRIVATE_DIR_MODE)
    return path


def _new_file(name: str, dir_fd: int, mode: int) -> int:
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


def write_atomic_at(
    dir_fd: int, path: Path, fill: Callable[[BinaryIO], None], *, durable: bool = False, mode: int = PRIVATE_FILE_MODE
) -> None:
    """:func:`write_atomic` in the directory ``dir_fd`` holds (``path``: its name there, and what errors show)."""
    if _is_link(path.name, dir_fd):
        raise LinkRefused(path)
    tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = _new_file(tmp, dir_fd, mode)
    try:
        os.fchmod(fd, mode)  # the mode asked, whatever the umask
        with os.fdopen(fd, "wb") as f:
            fill(f)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    if durable:
        os.fsync(dir_fd)


def write_atomic(
    path: str | os.PathLike[str],
    fill: Callable[[BinaryIO], None],
    *,
    root: str | os.PathLike[str] | None = None,
    durable: bool = False,
    mode: int = PRIVATE_FILE_MODE,
) -> None:
    """``fill`` writes the file's bytes to a new temporary file in the same directory, renamed over ``path``.

    A reader (``dflash-ipc status``, node_exporter's textfile collector, a resuming run) sees the
    old file or the new one, never a mix. ``durable`` also fsyncs the file and its directory, for
    files a crash must not lose (checkpoint pointers). A link at ``path`` or below ``root`` is refused."""
    path = Path(path)
    with open_dir(path.parent, root=root) as dfd:
        write_atomic_at(dfd, path, fill, durable=durable, mode=mode)


def write_bytes_atomic(
    path: str | os.PathLike[str], data: bytes, *, root: str | os.PathLike[str] | None = None, durable: bool = False
) -> None:
    """:func:`write_atomic` of ``data`` (0600)."""
    write_atomic(path, lambda f: f.write(data), root=root, durable=durable)


def write_text_atomic(
    path: str | os.PathLike[str], text: str, *, root: str | os.PathLike[str] | None = None, durable: bool = False
) -> None:
    write_bytes_atomic(path, text.encode(), root=root, durable=durable)


def open_append(
    path: str | os.PathLike[str], *, root: str | os.PathLike[str] | None = None, text: bool = True, line_buffered: bool = False
):
    """``path`` opened to append (created 0600), never through a link at it or below ``root``."""
    path = Path(path)
    with open_dir(path.parent, root=root) as dfd:
        try:
            fd = os.open(path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, PRIVATE_FILE_MODE, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise LinkRefused(path) from None
            raise
    if text:
        return os.fdopen(fd, "a", buffering=1 if line_buffered else -1)
    return os.fdopen(fd, "ab")


def links_below(root: str | os.PathLike[str], *, allowed: frozenset[str] = frozenset()) -> list[Path]:
    """Every symbolic link in the tree under ``root`` (links are listed, never followed), but the
    top-level names in ``allowed``."""
    found = []
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(top) / name
            if p.is_symlink() and not (Path(top) == Path(root) and name in allowed):
                found.append(p)
    return sorted(found)


def check_own_private(path: Path, st: os.stat_result, what: str, fix: str = "use one of your own") -> None:
    """``st`` (of ``path``, not followed) is a directory or regular file of this user that no other
    user can write; else :class:`NotPrivate` naming ``what`` it is and ``fix``."""
    uid = os.geteuid()
    if stat.S_ISLNK(st.st_mode):
        raise NotPrivate(path, f"{what} is a symbolic link", fix)
    if not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise NotPrivate(path, f"{what} is neither a directory nor a regular file", fix)
    if st.st_uid != uid:
        raise NotPrivate(path, f"{what} belongs to uid {st.st_uid}, not to this user (uid {uid})", fix)
    if st.st_mode & 0o022:
        raise NotPrivate(path, f"{what} is mode {stat.S_IMODE(st.st_mode):04o}: other users can write it", fix)


# --------------------------------------------------------------------------- whole directories

_RENAME_EXCHANGE = 2  # linux/fs.h: renameat2() swaps the two names atomically


def _staging_prefix(name: str) -> str:
    return f".{name}.staged-"


def _exchange(dir_fd: int, a: str, b: str) -> bool:
    """Swap names ``a`` and ``b`` in ``dir_fd`` in one step; False where the C library, kernel or file
    system has no RENAME_EXCHANGE."""
    import ctypes

    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(dir_fd, os.fsencode(a), dir_fd, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _remove_tree(parent_fd: int, name: str, parent: Path) -> None:
    import shutil

    if _is_link(name, parent_fd):
        os.unlink(name, dir_fd=parent_fd)
    else:
        shutil.rmtree(parent / name, ignore_errors=True)


def _remove_stale_staging(parent_fd: int, name: str, parent: Path) -> None:
    """Staging directories of writers killed before they finished (none holds its flock any more)."""
    import fcntl

    for entry in os.listdir(parent_fd):
        if not entry.startswith(_staging_prefix(name)):
            continue
        try:
            fd = os.open(entry, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=parent_fd)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a writer at work
        finally:
            os.close(fd)
        _remove_tree(parent_fd, entry, parent)


def _fsync_files(dir_fd: int) -> None:
    for entry in os.listdir(dir_fd):
        if stat.S_ISREG(os.stat(entry, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    os.fsync(dir_fd)


def replace_dir(
    path: str | os.PathLike[str], fill: Callable[[Path], None], *, root: str | os.PathLike[str] | None = None, mode: int = 0o755
) -> None:
    """A whole new directory at ``path``: ``fill`` writes it into a fresh sibling (``.NAME.staged-*``,
    flocked while written), every file is fsynced, and it takes ``path``'s place in one rename
    (RENAME_EXCHANGE with a previous one, which is then removed). A kill at any moment leaves
    ``path`` as it was or wholly new; a staging directory a killed writer left is removed by the
    next call. Without RENAME_EXCHANGE (a file system lacking it) the previous directory is renamed
    aside first: a kill between the two renames leaves it whole under ``.NAME.staged-*``.
    A link at ``path`` or below ``root`` is refused."""
    import fcntl

    path = Path(path)
    parent, name = path.parent, path.name
    with open_dir(parent, root=root) as pfd:
        if _is_link(name, pfd):
            raise LinkRefused(path)
        _remove_stale_staging(pfd, name, parent)
        staged = _staging_prefix(name) + secrets.token_hex(6)
        os.mkdir(staged, PRIVATE_DIR_MODE, dir_fd=pfd)
        sfd = os.open(staged, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=pfd)
        try:
            fcntl.flock(sfd, fcntl.LOCK_EX)
            try:
                fill(parent / staged)
                _fsync_files(sfd)
                os.fchmod(sfd, mode)
                if not os.path.lexists(path):
                    os.rename(staged, name, src_dir_fd=pfd, dst_dir_fd=pfd)
                elif not _exchange(pfd, staged, name):
                    aside = _staging_prefix(name) + secrets.token_hex(6)
                    os.rename(name, aside, src_dir_fd=pfd, dst_dir_fd=pfd)
                    os.rename(staged, name, src_dir_fd=pfd, dst_dir_fd=pfd)
                    staged = aside
                os.fsync(pfd)
            finally:
                _remove_tree(pfd, staged, parent)  # what failed half-way, or the previous directory
        finally:
            os.close(sfd)
