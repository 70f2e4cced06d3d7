"""Byte stores: where checkpoint files live. Knows nothing of torch.

:func:`open_store` turns a URI plus backend options into a :class:`~.base.Store`:

- a local path or ``file://`` URL: :class:`LocalStore` (:class:`LocalConfig`), or
  :class:`VolumeStore` (:class:`VolumeConfig`) when the path lies on a mounted volume (FUSE, NFS,
  CIFS/SMB, Lustre, ``/Volumes/``; see :mod:`.mounts`) or the option ``volume=True`` is given
  (``volume=False`` forces the local-disk store). With ``stage_dir=`` the volume store is wrapped
  in :class:`StagedStore` (local staging, background upload);
- ``s3://bucket/prefix``: :class:`S3Store` (:class:`S3Config`), through boto3;
- any other URL whose protocol fsspec knows (``gs://``, ``az://``, ``memory://`` ...):
  :class:`FsspecStore` (:class:`FsspecConfig`).

Options come flat (``CheckpointWriter(uri, endpoint_url=...)``) or, for the dedicated backends
(local disk, volume, S3), also gathered in one mapping, ``storage_options={"endpoint_url": ...}``,
the spelling fsspec users know; both may be mixed, but a name given twice is refused. For the
fsspec backend ``storage_options`` keeps its fsspec meaning: the filesystem's own arguments.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import fields
from typing import Any
from urllib.parse import unquote, urlparse

from ..errors import CheckpointError
from .base import (
    BackgroundCommit,
    FileSink,
    FileSource,
    StaleUploads,
    Store,
    StoreTraits,
    check_relative_name,
    redact,
)
from .fsspec_store import FsspecConfig, FsspecStore, fsspec_protocol, require_driver
from .local import LocalConfig, LocalStore
from .mounts import find_volume
from .overlap import locations_overlap as _overlap
from .s3 import S3Config, S3Store, parse_s3_uri
from .staged import DEFAULT_COMMIT_TIMEOUT_S, DEFAULT_UPLOAD_THREADS, StagedStore
from .volume import VolumeConfig, VolumeStore

__all__ = [
    "BackgroundCommit",
    "FileSink",
    "FileSource",
    "FsspecConfig",
    "FsspecStore",
    "LocalConfig",
    "LocalStore",
    "S3Config",
    "S3Store",
    "StagedStore",
    "StaleUploads",
    "Store",
    "StoreTraits",
    "VolumeConfig",
    "VolumeStore",
    "check_relative_name",
    "find_volume",
    "is_supported_uri",
    "locations_overlap",
    "open_store",
    "redact",
]


def _local_path(uri: str | os.PathLike) -> str | None:
    """The filesystem path for a local URI, or ``None`` when ``uri`` is not local."""
    text = os.fspath(uri)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.startswith(("file://", "local://")):  # fsspec's local:// is the local disk too
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            return None
        return unquote(parsed.path)
    if "://" in text:
        return None
    _refuse_broken_url(text)
    return text


#: ``scheme:`` at the start of a string (two characters at least: ``C:`` is a Windows drive).
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):(.*)", re.DOTALL)


def _refuse_broken_url(text: str) -> None:
    """Refuse a string that looks like a URL but does not parse as one (``s3:/bucket/run``,
    ``s3:bucket``, ``foo:/x``): taken as a local path it would put a checkpoint meant for a
    bucket into ``./s3:/bucket/run`` on local disk, silently.

    Refused: any scheme followed by ``:/`` but not ``://``, and a bucket scheme
    (:data:`_BUCKET_SCHEMES`) followed by anything but ``//``. Kept as local paths: a drive
    letter (``C:/x``), a name with a colon that is no such scheme (``run:3``, ``data:v2``,
    ``./s3:/x``, ``/data/a:b``).

    Raises:
        ValueError: naming the spelling it probably meant.
    """
    m = _SCHEME.fullmatch(text)
    if m is None:
        return
    scheme, rest = m.group(1), m.group(2)
    if not rest.startswith("/") and scheme.lower() not in _BUCKET_SCHEMES:
        return
    meant = f"{scheme}://{'/' if scheme.lower() in ('file', 'local') else ''}{rest.lstrip('/')}"
    known = scheme.lower() in _BUCKET_SCHEMES or scheme.lower() in ("file", "local") or _known_to_fsspec(scheme)
    shown = f"{scheme}:{rest[: len(rest) - len(rest.lstrip('/'))]}" + redact(meant).split("://", 1)[1].lstrip("/")
    local = "" if known else f", or './{shown}' for a local path"
    raise ValueError(
        f"checkpoint location {shown!r} looks like a URL but is not one (a URL has '://' after "
        f"its scheme); did you mean {redact(meant)!r}{local}?"
    )


#: Schemes whose URLs name a bucket: ``s3:bucket`` is a typo, never a local name.
_BUCKET_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "oci", "r2"})


def _known_to_fsspec(scheme: str) -> bool:
    return fsspec_protocol(f"{scheme.lower()}://") is not None


def is_supported_uri(uri: object) -> bool:
    """Whether :func:`open_store` can open ``uri`` (used by DCP's checkpoint-id detection)."""
    if not isinstance(uri, (str, os.PathLike)):
        return False
    try:
        if _local_path(uri) is not None:
            return True
        text = os.fspath(uri)
        if not isinstance(text, str):
            return False
        if text.startswith("s3://"):
            parse_s3_uri(text)
            return True
        return fsspec_protocol(text) is not None
    except (TypeError, ValueError, CheckpointError):
        return False


def locations_overlap(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two locations (URIs, or stores' ``uri``) are one place or one lies inside the other.

    Local paths are compared by their real paths and by the device and inode of every directory
    on the way, so a symbolic link to a directory, a bind mount or ``..`` in a path is seen as the
    directory itself (see :mod:`.overlap`). Used to refuse writing a checkpoint into its source.
    """
    return _overlap(a, b, local=(_local_path(a), _local_path(b)))


#: Names other S3 clients (s3fs, botocore) use for our S3 options: named in the error, not accepted.
_S3_SPELLINGS = {
    "key": "aws_access_key_id",
    "secret": "aws_secret_access_key",
    "token": "aws_session_token",
    "region_name": "region",
    "client_kwargs": "endpoint_url / region, given directly",
    "config_kwargs": "addressing_style, connect_timeout, read_timeout ...",
}


def _build_config(cls: type, options: Mapping[str, Any], backend: str, spellings: Mapping[str, str] | None = None):
    """``cls(**options)`` after refusing unknown keys (by name only: values may be secrets)."""
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        hints = [f"{k} -> {spellings[k]}" for k in unknown if spellings and k in spellings]
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for the {backend} backend; "
            f"known options: {', '.join(sorted(known)) or 'none'}" + (f" (use: {'; '.join(hints)})" if hints else "")
        )
    return cls(**options)


def _flatten(options: dict[str, Any]) -> dict[str, Any]:
    """Merge a ``storage_options`` mapping into the flat options (dedicated backends only).

    Raises:
        TypeError: ``storage_options`` is not a mapping with string keys, or a name is given both
            flat and inside it. Messages name keys, never values (they may be credentials).
    """
    nested = options.pop("storage_options", None)
    if nested is None:
        return options
    if not isinstance(nested, Mapping) or not all(isinstance(k, str) for k in nested):
        raise TypeError(f"storage_options must be a mapping with string keys, got {type(nested).__name__}")
    twice = sorted(set(nested) & set(options))
    if twice:
        raise TypeError(f"option(s) {', '.join(twice)} given both directly and in storage_options: give each once")
    return {**options, **nested}


def open_store(uri: str | os.PathLike, options: Mapping[str, Any] | None = None) -> Store:
    """Open the store for ``uri``.

    Args:
        uri: a local path or ``file://`` URL, ``s3://bucket/prefix``, or another fsspec URL.
        options: backend options (see :class:`LocalConfig`, :class:`VolumeConfig`,
            :class:`S3Config`, :class:`FsspecConfig`), flat or (except for fsspec URLs) under a
            ``storage_options`` mapping; an unknown key is a ``TypeError``. For local paths, ``volume`` (``None``, the default: detect; ``True``/``False``: force)
            chooses between :class:`VolumeStore` and :class:`LocalStore`.

    Credentials in a URL never reach the store's ``uri`` or a message (:func:`redact`).

    Raises:
        ValueError: the URI scheme is not supported, or the URI is malformed, or fsspec
            knows the protocol but its package is not installed (``gs://`` without ``gcsfs``):
            an environment problem, named with the package to install.
        TypeError: an option is unknown to the chosen backend, or given twice.
    """
    options = dict(options or {})
    path = _local_path(uri)
    if path is None:
        text = os.fspath(uri)
        if isinstance(text, str) and text.startswith("s3://"):
            parse_s3_uri(text)  # a malformed URI is a ValueError before any option error
            return S3Store(text, _build_config(S3Config, _flatten(options), "S3", _S3_SPELLINGS))
        if isinstance(text, str) and fsspec_protocol(text) is not None:
            require_driver(fsspec_protocol(text), redact(text))
            return FsspecStore(text, _build_config(FsspecConfig, options, f"fsspec {fsspec_protocol(text)}://"))
        raise ValueError(
            f"unsupported checkpoint URI {redact(str(text))!r}: expected a local path, file:// URL, "
            "s3://bucket/prefix, or a URL whose protocol fsspec knows"
        )
    if not path:
        raise ValueError("empty checkpoint path")
    options = _flatten(options)
    volume = options.pop("volume", None)
    if volume is not None and not isinstance(volume, bool):
        raise TypeError(f"volume must be True, False or None (detect), got {volume!r}")
    detected = find_volume(path) if volume is None else None
    if volume or detected is not None:
        return _open_volume(path, _build_config(VolumeConfig, options, "volume"), detected)
    if set(options) & _VOLUME_ONLY:
        why = (
            "volume=False chose the local-disk store"
            if volume is False
            else f"{path} is not on one that goodput-ckpt detects (FUSE, NFS, CIFS/SMB, Lustre, /Volumes/); "
            "pass volume=True to use volume mode there"
        )
        raise TypeError(f"option(s) {', '.join(sorted(set(options) & _VOLUME_ONLY))} apply to mounted volumes: {why}")
    return LocalStore(path, _build_config(LocalConfig, options, "local"))


#: Options that only the volume backend knows (a clearer error than "unknown option").
_VOLUME_ONLY = {f.name for f in fields(VolumeConfig)} - {f.name for f in fields(LocalConfig)}


def _open_volume(path: str, config: VolumeConfig, detected: str | None) -> Store:
    store = VolumeStore(path, config, detected=detected)
    if config.stage_dir is None:
        return store
    stage = os.fspath(config.stage_dir)
    on_volume = find_volume(stage)
    if on_volume is not None:
        raise ValueError(f"stage_dir {stage} must be on local disk, but it is on a volume ({on_volume})")
    return StagedStore(
        store,
        stage,
        upload_threads=config.upload_threads or DEFAULT_UPLOAD_THREADS,
        commit_timeout_s=config.commit_timeout_s or DEFAULT_COMMIT_TIMEOUT_S,
    )
