"""The two methods ``bench`` compares: goodput's DCP storage plugins and torch's own.

Each is a :class:`BenchMethod`: how to make a writer and a reader for a location, and how to
verify a checkpoint (``None`` for torch, whose format has no checksums). torch's side is
``FileSystemWriter``/``FileSystemReader`` for paths and ``FsspecWriter``/``FsspecReader`` for
URLs; a URL whose fsspec driver is missing (``s3fs`` for ``s3://``) gives an :class:`Unavailable`
with the reason instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["BenchMethod", "Unavailable", "goodput_method", "is_save_or_load_failure", "torch_method", "wait_durable"]


@dataclass(frozen=True)
class BenchMethod:
    """A method that can run here."""

    name: str
    writer: Callable[[str], Any]  # location -> a DCP StorageWriter
    reader: Callable[[str], Any]  # location -> a DCP StorageReader
    describe_writer: str
    describe_reader: str
    verify: Callable[[str], Any] | None  # location -> a VerifyReport; None: no checksums
    reason: None = None  # as Unavailable's, so both can be handled alike


@dataclass(frozen=True)
class Unavailable:
    """A method that cannot run here, and why (``n/a: ...``)."""

    name: str
    describe_writer: str
    describe_reader: str
    reason: str
    verify: None = None


def goodput_method(thread_count: int | None, options: Mapping[str, Any]) -> BenchMethod:
    """:class:`~goodput_ckpt.CheckpointWriter` / :class:`~goodput_ckpt.CheckpointReader` (verifying)."""
    from ... import CheckpointReader, CheckpointWriter
    from ..ops.verify import verify_checkpoint

    tc = f"thread_count={thread_count}" if thread_count else "defaults"
    return BenchMethod(
        "goodput",
        lambda u: CheckpointWriter(u, thread_count=thread_count, **options),
        lambda u: CheckpointReader(u, verify=True, thread_count=thread_count, **options),
        f"CheckpointWriter ({tc})",
        "CheckpointReader (verify=True)",
        lambda u: verify_checkpoint(u, thread_count=thread_count, **options),
    )


def torch_method(
    remote_root: str | None, options: Mapping[str, Any], thread_count: int | None
) -> BenchMethod | Unavailable:
    """torch's writer and reader: for paths (``remote_root=None``), or for the URL ``remote_root``."""
    import torch.distributed.checkpoint as dcp

    tc = thread_count or 1  # torch's default
    if remote_root is None:
        return BenchMethod(
            "torch",
            lambda u: dcp.FileSystemWriter(u, thread_count=tc),
            dcp.FileSystemReader,
            f"FileSystemWriter (thread_count={tc})",
            "FileSystemReader",
            None,
        )
    names = (f"FsspecWriter (thread_count={tc})", "FsspecReader")
    protocol = remote_root.split("://", 1)[0]
    try:
        storage_options = _fsspec_options(protocol, options)
        import fsspec

        fsspec.get_filesystem_class(protocol)  # imports the driver (s3fs for s3://)
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    except (ImportError, ValueError) as e:
        hint = " (pip install s3fs)" if protocol == "s3" else ""
        return Unavailable("torch", *names, f"n/a: torch's FsspecWriter cannot reach {protocol}:// here{hint}: {e}")
    return BenchMethod(
        "torch",
        lambda u: FsspecWriter(u, thread_count=tc, **storage_options),
        lambda u: FsspecReader(u, **storage_options),
        *names,
        None,
    )


def _fsspec_options(protocol: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """fsspec storage options equivalent to goodput's backend options, as far as they go.

    For S3 the endpoint, region and addressing style carry over; credentials come from the
    environment for both. The rest (part size, concurrency, retries, checksums) are goodput's own.

    Raises:
        ValueError: an option that cannot be handed to fsspec (a ready client or filesystem).
    """
    if protocol != "s3":
        if options.get("filesystem") is not None:
            raise ValueError("a ready fsspec filesystem cannot be handed to FsspecWriter")
        return dict(options.get("storage_options") or {})
    if options.get("client") is not None or options.get("session") is not None:
        raise ValueError("a ready boto3 client or session cannot be handed to s3fs")
    out: dict[str, Any] = {}
    if options.get("endpoint_url"):
        out["endpoint_url"] = options["endpoint_url"]
    if options.get("region"):
        out["client_kwargs"] = {"region_name": options["region"]}
    if options.get("addressing_style") in ("path", "virtual"):
        out["config_kwargs"] = {"s3": {"addressing_style": options["addressing_style"]}}
    return out


def wait_durable(writer: Any) -> None:
    """With local staging in front of a volume, a save returns before its upload: wait for it."""
    durable = getattr(writer, "durable_future", None)
    if durable is not None:
        durable().result()


def is_save_or_load_failure(e: BaseException) -> bool:
    """An error of a save or load (``CheckpointException`` derives from ``BaseException``)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(e, (Exception, CheckpointException))
