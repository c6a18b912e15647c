"""Workspace snapshots as deterministic tar archives.

`pack` walks a workspace from directory descriptors without following links
and writes entries in sorted order with zeroed times and owners, so the same
contents always give the same bytes (and the same blob ref). `unpack` never
hands a member name to the filesystem unchecked: each one goes through the
confined operations, so an archive cannot write outside its destination
whatever its symbolic links point at.
"""

from __future__ import annotations

import io
import os
import stat
import tarfile

from assay.sandbox.confined import Owner, parent_dir, parts, read_fd, write
from assay.sandbox.port import LimitExceeded, SandboxError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class ArchiveInvalid(SandboxError):
    """A snapshot archive does not decode or holds a member that is not allowed."""


def _info(name: str, kind: bytes, mode: int, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode & 0o777
    info.size = size
    info.linkname = link
    info.mtime = 0
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def pack(root: str, *, limit: int, owner: Owner) -> bytes:
    """The workspace under `root` as tar bytes; sockets, pipes and devices left out.

    Raises:
        LimitExceeded: the archive would be larger than `limit` bytes.
        PathRefused: a file is not owned by the sandbox user (a planted hard link).
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        fd = os.open(root, _DIR)
        try:
            _pack_dir(tar, buf, fd, "", limit, owner)
        finally:
            os.close(fd)
    data = buf.getvalue()
    if len(data) > limit:
        raise LimitExceeded(f"the snapshot is {len(data)} bytes, over the limit of {limit}")
    return data


def _pack_dir(
    tar: tarfile.TarFile, buf: io.BytesIO, dirfd: int, prefix: str, limit: int, owner: Owner
) -> None:
    for name in sorted(os.listdir(dirfd)):
        path = f"{prefix}{name}"
        st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
        if stat.S_ISLNK(st.st_mode):
            tar.addfile(_info(path, tarfile.SYMTYPE, 0o777, link=os.readlink(name, dir_fd=dirfd)))
        elif stat.S_ISDIR(st.st_mode):
            sub = os.open(name, _DIR, dir_fd=dirfd)
            try:
                tar.addfile(_info(path, tarfile.DIRTYPE, os.fstat(sub).st_mode))
                _pack_dir(tar, buf, sub, f"{path}/", limit, owner)
            finally:
                os.close(sub)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            try:
                real = owner.check(fd, path)
                data = read_fd(fd, limit)
            finally:
                os.close(fd)
            tar.addfile(_info(path, tarfile.REGTYPE, real.st_mode, len(data)), io.BytesIO(data))
        if buf.tell() > limit:
            raise LimitExceeded(f"the snapshot grew past the limit of {limit} bytes")


def unpack(data: bytes, root: str, *, file_limit: int, owner: Owner) -> None:
    """Recreate an archive made by `pack` under the existing directory `root`.

    Raises:
        ArchiveInvalid: the bytes are not a tar archive, or a member is not a
            relative path, a directory, a regular file or a symbolic link.
        PathRefused: a member would be written through a symbolic link.
    """
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for m in tar.getmembers():
                _unpack_member(tar, m, root, file_limit, owner)
    except tarfile.TarError as exc:
        raise ArchiveInvalid(f"the snapshot is not a readable tar archive: {exc}") from exc


def _unpack_member(
    tar: tarfile.TarFile, m: tarfile.TarInfo, root: str, file_limit: int, owner: Owner
) -> None:
    names = parts(m.name)
    if m.isdir():
        with parent_dir(root, [*names, "."], m.name, create=True, owner=owner):
            pass
    elif m.isfile():
        src = tar.extractfile(m)
        if src is None:
            raise ArchiveInvalid(f"the snapshot's {m.name!r} has no data")
        write(root, m.name, src.read(), limit=file_limit, owner=owner)
        _chmod(root, names, m.name, m.mode, owner)
    elif m.issym():
        with parent_dir(root, names, m.name, create=True, owner=owner) as dirfd:
            os.symlink(m.linkname, names[-1], dir_fd=dirfd)
            if owner.uid is not None:
                os.chown(
                    names[-1],
                    owner.uid,
                    -1 if owner.gid is None else owner.gid,
                    dir_fd=dirfd,
                    follow_symlinks=False,
                )
    else:
        raise ArchiveInvalid(f"the snapshot holds {m.name!r}, which is not allowed")


def _chmod(root: str, names: list[str], path: str, mode: int, owner: Owner) -> None:
    with parent_dir(root, names, path, create=False, owner=owner) as dirfd:
        fd = os.open(names[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
        try:
            os.fchmod(fd, mode & 0o777)
        finally:
            os.close(fd)
