"""The typed error inside what DCP raised: dcp.save and dcp.load wrap errors in their own
``CheckpointException`` (a ``BaseException``), and tests check the ``CheckpointError`` within."""

from __future__ import annotations

from typing import Any

from goodput_ckpt import CheckpointError
from goodput_ckpt.errors import find_checkpoint_error

__all__ = ["checkpoint_error"]


def checkpoint_error(raised: Any) -> CheckpointError:
    """The first :class:`CheckpointError` in ``raised`` (an exception or pytest's ``ExceptionInfo``);
    a test failure if there is none."""
    exc = getattr(raised, "value", raised)
    err = find_checkpoint_error(exc)
    assert err is not None, f"no CheckpointError in {exc!r}"
    return err
