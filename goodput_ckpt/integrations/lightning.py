"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves Lightning's checkpoint dict in our
format (``Trainer(plugins=[GoodputCheckpointIO()])``). Needs the ``lightning`` package, imported
only here: ``import goodput_ckpt`` does not import it.

Each Lightning "checkpoint file" (``epoch=1-step=8.ckpt``, ``last.ckpt``) becomes a checkpoint
*location* (a directory on disk, a prefix on S3) in goodput-ckpt's format: tensors as raw bytes
hashed with blake3 (:class:`~goodput_ckpt.CheckpointWriter`), the rest as JSON in the manifest,
and values JSON cannot hold as ``torch.save`` bytes read back with ``weights_only=True``
(:mod:`._tree`). Any URL our stores take works: a local path, a mounted volume, ``s3://``.

Lightning calls the plugin on global rank 0 only (``Strategy.save_checkpoint``), with the whole
(unsharded) dict, so saves and loads run in one process (``no_dist``).

Async saves: Lightning's ``AsyncCheckpointIO(GoodputCheckpointIO())`` works (it clones the
tensors and runs each save on its one worker thread; each save builds its own writer), but it
runs ``remove_checkpoint`` at once on the training thread, while the save it removes may still
be queued: ``ModelCheckpoint(save_top_k=...)`` then finds no commit record and the checkpoint it
meant to drop stays (with Lightning's own ``TorchCheckpointIO`` the removal is a no-op and the
file appears later, the same leftover). :class:`AsyncGoodputCheckpointIO` is that wrapper with
removals and loads queued behind the saves before them, in order.
Limits (sharded strategies, ``save_last="link"``) are in docs/integrations.md.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from ..errors import CheckpointError
from ._locations import is_plain_file, remove_location
from ._tree import load_tree, save_tree

__all__ = ["AsyncGoodputCheckpointIO", "GoodputCheckpointIO"]


class GoodputCheckpointIO(CheckpointIO):
    """Lightning's ``CheckpointIO`` through goodput-ckpt's verified format.

    Args:
        verify: check every chunk's blake3 on load; a damaged file raises
            :class:`~goodput_ckpt.CorruptCheckpointError` naming it.
        thread_count: writer and reader threads (the writer's and reader's defaults).
        **options: backend options for every location (``endpoint_url=...`` for S3,
            ``volume=True`` ...; see :class:`~goodput_ckpt.CheckpointWriter`). A save's
            ``storage_options`` (``trainer.save_checkpoint(path, storage_options=...)``) add to
            them for that save.
    """

    def __init__(self, *, verify: bool = True, thread_count: int | None = None, **options: Any) -> None:
        super().__init__()
        self.verify = bool(verify)
        self.thread_count = thread_count
        self.options = dict(options)

    def _options(self, extra: Any = None) -> dict[str, Any]:
        if extra is None:
            return dict(self.options)
        if not isinstance(extra, Mapping):
            raise TypeError(
                f"storage_options must be a mapping of goodput-ckpt backend options, got {type(extra).__name__}"
            )
        return {**self.options, **extra}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any = None) -> None:
        """Save Lightning's checkpoint dict at ``path``, replacing a checkpoint of ours there
        (Lightning re-saves ``last.ckpt`` under the same name).

        Raises:
            CheckpointError: the save failed; nothing was committed at ``path``.
            TypeError: ``storage_options`` is not a mapping, or names an unknown option.
        """
        save_tree(checkpoint, path, thread_count=self.thread_count, **self._options(storage_options))

    def load_checkpoint(
        self, path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the dict saved at ``path``.

        Args:
            map_location: where tensors go: ``None`` (the CPU, where they are read), a device or
                its name, or a ``{"cpu": device}`` mapping. Lightning itself passes ``None`` and
                moves the state when it loads it into the model and optimizers.
            weights_only: ``False`` decodes non-tensor values with full pickle (trusted
                checkpoints only; Lightning passes what ``trainer.fit(weights_only=...)`` got);
                ``None`` and ``True`` keep ``torch.load(weights_only=True)``.

        Raises:
            CheckpointNotFoundError: no committed checkpoint at ``path``.
            CorruptCheckpointError: a damaged file (named), or a damaged record.
            CheckpointError: ``path`` is a single file (another plugin's checkpoint).
            TypeError: a ``map_location`` this plugin cannot apply (a callable).
        """
        device = _device_of(map_location)
        if is_plain_file(path):
            raise CheckpointError(
                f"{os.fspath(path)} is a single file, not a goodput-ckpt checkpoint location (one saved by "
                "Lightning's default TorchCheckpointIO?): GoodputCheckpointIO loads the checkpoints it saved",
                path=os.fspath(path),
            )
        tree = load_tree(
            path,
            verify=self.verify,
            trust_pickle=weights_only is False,
            thread_count=self.thread_count,
            **self._options(),
        )
        if device is None:
            return tree
        return _move(tree, device)

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Delete the checkpoint at ``path`` (Lightning removes checkpoints beyond ``save_top_k``).

        Removes only what is provably ours: the commit record first (so that an interrupted
        removal leaves a visibly incomplete location, never a record pointing at missing
        files), then the data files it lists that have the recorded sizes, then files named as
        our writers name data files. A location without our commit record is left alone and
        logged. The directory itself goes when it is left empty (local disk, volumes).
        """
        remove_location(path, self._options())

    def teardown(self) -> None:
        """Nothing to release: every save and load opens and closes its own writer or reader."""


def _device_of(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")
        return None if target is None else torch.device(target)
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise TypeError(
        f"GoodputCheckpointIO.load_checkpoint: map_location {type(map_location).__name__} is not supported "
        "(give a device, its name, or a {'cpu': device} mapping)"
    )


def _move(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return {k: _move(v, device) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(_move(v, device) for v in x)
    return x


class AsyncGoodputCheckpointIO(AsyncCheckpointIO):
    """``AsyncCheckpointIO`` around :class:`GoodputCheckpointIO` whose removals and loads run in
    order behind the saves queued before them (see the module doc).

    Why: Lightning's wrapper queues only saves; ``ModelCheckpoint`` removes the previous best
    right after queuing the next save, often before the older save has run, and a resume in the
    same process could read a checkpoint still being written. Queuing both on the wrapper's one
    worker thread makes every call see the saves submitted before it.

    Args:
        checkpoint_io: the plugin that does the work (default: ``GoodputCheckpointIO()``).
    """

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io if checkpoint_io is not None else GoodputCheckpointIO())

    def remove_checkpoint(self, path: str | os.PathLike) -> None:
        """Queue the removal behind the saves before it; an error surfaces like a save's (at the
        next call, or at ``teardown``)."""
        self._ensure_setup()
        inner = self.checkpoint_io

        def _remove() -> None:
            try:
                inner.remove_checkpoint(path)
            except BaseException as ex:  # noqa: BLE001 - kept and raised again, as the wrapper does for saves
                self._error = ex

        self._executor.submit(_remove)
        if self._error:
            raise self._error

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load once the saves queued before this call are done (waits for them), then load on
        the caller's thread."""
        self._ensure_setup()
        self._executor.submit(lambda: None).result()  # the queue is in order: a barrier
        if self._error:
            raise self._error
        return self.checkpoint_io.load_checkpoint(*args, **kwargs)
