"""Detecting that a local path lies on a mounted volume (FUSE, NFS, CIFS/SMB, Lustre).

Such a path looks local but behaves like an object store or a network filesystem: files are
written once and in order, seek and append may fail, rename may be a copy or refused, and fsync
may be an upload. :func:`find_volume` tells :func:`~goodput_ckpt.storage.open_store` to use
:class:`~goodput_ckpt.storage.VolumeStore` there instead of the local-disk store.

How: the mount table (``/proc/self/mountinfo`` on Linux) gives the filesystem type of the mount
that holds the path (the longest mount point that is a prefix of the path's nearest existing
ancestor, symlinks resolved). Types that start with one of :data:`VOLUME_FS_PREFIXES` are
volumes. Paths under ``/Volumes/`` (Databricks Unity Catalog volumes) are volumes even where the
mount table is hidden, except on macOS, where ``/Volumes/`` holds ordinary local disks.

Detection only picks the default: ``volume=True`` or ``volume=False`` overrides it.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

__all__ = ["MountInfo", "VOLUME_FS_PREFIXES", "find_mount", "find_volume"]

#: Filesystem types (prefixes) that get volume mode: every FUSE filesystem (``fuse``,
#: ``fuse.rclone``, ``fuse.s3fs``, ``fuse.gcsfuse``, ``fuse.mountpoint-s3``, ``fuseblk`` ...),
#: NFS (``nfs``, ``nfs4``), CIFS/SMB (``cifs``, ``smb3``, ``smbfs``) and Lustre.
VOLUME_FS_PREFIXES = ("fuse", "nfs", "cifs", "smb", "lustre")

_MOUNTINFO = "/proc/self/mountinfo"
_DATABRICKS_VOLUMES = "/Volumes/"


@dataclass(frozen=True)
class MountInfo:
    """The mount that holds a path."""

    mount_point: str
    fstype: str
    source: str

    def describe(self) -> str:
        return f"{self.fstype} mount {self.source} at {self.mount_point}"


def _unescape(field: str) -> str:
    """Undo the octal escapes of mountinfo fields (``\\040`` for a space, ...)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def _read_mounts(mountinfo: str) -> list[MountInfo]:
    """Parse a mountinfo file: ``id parent maj:min root MOUNT_POINT opts [tags] - FSTYPE SOURCE ...``."""
    try:
        with open(mountinfo, encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    mounts = []
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        mounts.append(MountInfo(_unescape(fields[4]), rest[0], _unescape(rest[1])))
    return mounts


def _existing_ancestor(path: str) -> str:
    """``path`` made absolute with symlinks resolved, through its nearest existing ancestor
    (a checkpoint location usually does not exist yet)."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.exists(path):
        parent, name = os.path.split(path)
        if parent == path:
            break
        missing.append(name)
        path = parent
    return os.path.join(os.path.realpath(path), *reversed(missing))


def find_mount(path: str | os.PathLike, *, mountinfo: str = _MOUNTINFO) -> MountInfo | None:
    """The mount holding ``path`` according to the mount table, or ``None`` when there is none
    (not Linux, or the table is unreadable)."""
    resolved = _existing_ancestor(os.fspath(path))
    best: MountInfo | None = None
    for m in _read_mounts(mountinfo):
        mp = m.mount_point.rstrip("/") or "/"
        if resolved == mp or resolved.startswith(mp + "/") or mp == "/":
            if best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/"):
                best = m  # later entries shadow earlier ones at the same mount point
    return best


def find_volume(path: str | os.PathLike, *, mountinfo: str = _MOUNTINFO) -> str | None:
    """Why ``path`` is on a mounted volume (a short description), or ``None`` when it is not.

    Args:
        mountinfo: the mount table to read (a parameter for tests).
    """
    text = os.path.abspath(os.fspath(path))
    mount = find_mount(text, mountinfo=mountinfo)
    if mount is not None and mount.fstype.startswith(VOLUME_FS_PREFIXES):
        return mount.describe()
    if sys.platform != "darwin" and (text + "/").startswith(_DATABRICKS_VOLUMES):
        return f"{text} is under {_DATABRICKS_VOLUMES} (a Databricks volume)"
    return None
