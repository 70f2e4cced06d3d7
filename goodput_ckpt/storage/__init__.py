"""Byte stores: where checkpoint files live. Knows nothing of torch.

:func:`open_store` turns a URI plus backend options into a :class:`~.base.Store`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from typing import Any
from urllib.parse import unquote, urlparse

from .base import FileSink, FileSource, Store, check_relative_name
from .local import LocalConfig, LocalStore

__all__ = [
    "FileSink",
    "FileSource",
    "LocalConfig",
    "LocalStore",
    "Store",
    "check_relative_name",
    "is_supported_uri",
    "open_store",
]


def _local_path(uri: str | os.PathLike) -> str | None:
    """The filesystem path for a local URI, or ``None`` when ``uri`` is not local."""
    text = os.fspath(uri)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if text.startswith("file://"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            return None
        return unquote(parsed.path)
    if "://" in text:
        return None
    return text


def is_supported_uri(uri: object) -> bool:
    """Whether :func:`open_store` can open ``uri`` (used by DCP's checkpoint-id detection)."""
    if not isinstance(uri, (str, os.PathLike)):
        return False
    try:
        return _local_path(uri) is not None
    except (TypeError, ValueError):
        return False


def _build_config(cls: type, options: Mapping[str, Any], backend: str):
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(
            f"unknown option(s) {', '.join(unknown)} for the {backend} backend; "
            f"known options: {', '.join(sorted(known)) or 'none'}"
        )
    return cls(**options)


def open_store(uri: str | os.PathLike, options: Mapping[str, Any] | None = None) -> Store:
    """Open the store for ``uri``.

    Args:
        uri: a local path or ``file://`` URL.
        options: backend options (see :class:`LocalConfig`); an unknown key is a ``TypeError``.

    Raises:
        ValueError: the URI scheme is not supported.
        TypeError: an option is unknown to the chosen backend.
    """
    options = dict(options or {})
    path = _local_path(uri)
    if path is None:
        raise ValueError(
            f"unsupported checkpoint URI {os.fspath(uri)!r}: expected a local path or file:// URL"
        )
    if not path:
        raise ValueError("empty checkpoint path")
    return LocalStore(path, _build_config(LocalConfig, options, "local"))
