"""File access confined to one directory tree, with no symbolic link ever followed.

Every path is walked one component at a time from a directory descriptor
(`openat` with `O_NOFOLLOW`), so a link planted by a command — even one swapped
in while Assay walks — cannot lead a read, a write or a snapshot outside the
workspace. Running as root, files not owned by the sandbox's user are refused
too: such a file can only be a hard link the command did not create itself.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import PurePosixPath

from assay.sandbox.port import LimitExceeded, PathRefused

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Owner:
    """The uid and gid that own what Assay creates in a workspace (None: leave as is)."""

    uid: int | None = None
    gid: int | None = None

    def chown(self, fd: int) -> None:
        """Give the open file `fd` to this owner."""
        if self.uid is not None:
            os.fchown(fd, self.uid, -1 if self.gid is None else self.gid)

    def check(self, fd: int, path: str) -> os.stat_result:
        """`fstat` of `fd`; refuse a file that belongs to anyone else."""
        st = os.fstat(fd)
        if self.uid is not None and st.st_uid != self.uid:
            raise PathRefused(f"{path!r} is not owned by the sandbox user")
        return st


def parts(path: str) -> list[str]:
    """The components of a workspace-relative path.

    Raises:
        PathRefused: the path is empty, absolute, holds NUL, or has a `..` component.
    """
    if not path or "\x00" in path:
        raise PathRefused(f"not a path: {path!r}")
    pure = PurePosixPath(path)
    if pure.is_absolute():
        raise PathRefused(f"{path!r} is absolute; workspace paths are relative")
    names = [p for p in pure.parts if p != "."]
    if ".." in names:
        raise PathRefused(f"{path!r} leaves the workspace")
    if not names:
        raise PathRefused(f"{path!r} names the workspace itself")
    return names


def _open_dir(parent: int, name: str, path: str, *, create: bool, owner: Owner) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            raise
        with suppress(FileExistsError):
            os.mkdir(name, 0o755, dir_fd=parent)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        owner.chown(fd)
        return fd
    except OSError as exc:
        # ELOOP or ENOTDIR: the component is a symbolic link or a file.
        raise PathRefused(
            f"{path!r}: {name!r} is not a directory (symbolic links are not followed): "
            f"{exc.strerror}"
        ) from exc


@contextmanager
def parent_dir(
    root: str, names: list[str], path: str, *, create: bool, owner: Owner
) -> Iterator[int]:
    """A descriptor of the directory holding the last component of `names`."""
    fd = os.open(root, _DIR_FLAGS)
    try:
        for name in names[:-1]:
            nxt = _open_dir(fd, name, path, create=create, owner=owner)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def write(root: str, path: str, content: bytes, *, limit: int, owner: Owner) -> None:
    """Write `content` to `path` under `root`, creating directories as needed."""
    if len(content) > limit:
        raise LimitExceeded(f"{path!r}: {len(content)} bytes exceed the file size limit {limit}")
    names = parts(path)
    with parent_dir(root, names, path, create=True, owner=owner) as dirfd:
        flags = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            try:
                fd = os.open(names[-1], flags | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=dirfd)
                owner.chown(fd)
            except FileExistsError:
                fd = os.open(names[-1], flags, dir_fd=dirfd)
        except IsADirectoryError as exc:
            raise PathRefused(f"{path!r} is a directory") from exc
        except OSError as exc:
            raise PathRefused(f"{path!r} is a symbolic link or not writable: {exc}") from exc
        try:
            st = owner.check(fd, path)
            if not stat.S_ISREG(st.st_mode):
                raise PathRefused(f"{path!r} is not a regular file")
            os.ftruncate(fd, 0)
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)


def read(root: str, path: str, *, limit: int, owner: Owner) -> bytes:
    """The bytes of the regular file `path` under `root`."""
    names = parts(path)
    with parent_dir(root, names, path, create=False, owner=owner) as dirfd:
        try:
            fd = os.open(names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise PathRefused(f"{path!r} is a symbolic link or unreadable: {exc}") from exc
        try:
            st = owner.check(fd, path)
            if not stat.S_ISREG(st.st_mode):
                raise PathRefused(f"{path!r} is not a regular file")
            if st.st_size > limit:
                raise LimitExceeded(f"{path!r}: {st.st_size} bytes exceed the read limit {limit}")
            return read_fd(fd, limit)
        finally:
            os.close(fd)


def read_fd(fd: int, limit: int) -> bytes:
    """Everything from `fd`, refusing more than `limit` bytes."""
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, 1 << 20):
        total += len(chunk)
        if total > limit:
            raise LimitExceeded(f"a file grew past the limit of {limit} bytes while read")
        chunks.append(chunk)
    return b"".join(chunks)
