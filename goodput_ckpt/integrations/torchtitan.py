"""torchtitan: a ``CheckpointManager`` whose DCP saves and loads go through goodput-ckpt's
writer and reader. Needs the ``torchtitan`` package (0.3), imported only here: ``import
goodput_ckpt`` does not import it.

torchtitan's ``CheckpointManager`` (``torchtitan/components/checkpointer/dcp.py``) saves with
``dcp.save``/``dcp.async_save(state_dict, checkpoint_id=<folder>/step-<n>)`` and loads with
``dcp.load(state_dict, checkpoint_id=...)``, never naming a storage writer or reader, so torch
picks its own ``FileSystemWriter``. Its two public methods ``dcp_save`` and ``dcp_load`` are
where every save and load passes (periodic, last-step and initial loads alike), and this
subclass overrides them to pass :class:`~goodput_ckpt.CheckpointWriter` and
:class:`~goodput_ckpt.CheckpointReader`. One private method must be overridden too:
``_find_load_step`` recognises a saved step by its ``.metadata`` file, which our format does
not write (its commit record is ``manifest.json``); here a step counts once its commit record is
valid, so a save killed half-way is never the one a restart loads.

What it gains: every chunk hashed with blake3 and verified on load (a damaged file is named),
a commit record written last, S3 and mounted volumes through our stores, and the reader's
parallel ranged reads. Hugging Face exports (``last_save_in_hf``, ``initial_load_in_hf``) keep
torchtitan's own safetensors path. torchtitan still lists, checks and purges step folders
through its ``torchtitan.tools.filesystem`` (local paths, or fsspec for remote URLs, which then
needs the fsspec driver, ``s3fs`` for ``s3://``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager
from torchtitan.tools.utils import GarbageCollection

from ..dcp.reader import CheckpointReader
from ..dcp.writer import CheckpointWriter
from ..errors import as_checkpoint_error
from ._locations import committed_numbered

__all__ = ["GoodputCheckpointManager"]

_MODEL = "model"  # torchtitan.components.checkpointer.base.MODEL


class GoodputCheckpointManager(CheckpointManager):
    """torchtitan's ``CheckpointManager`` through goodput-ckpt's writer and reader (module doc).

    Built like torchtitan's own: ``GoodputCheckpointManager.Config(enable=True, ...)``
    ``.build(dataloader=..., model_parts=..., optimizers=..., lr_schedulers=..., states=...,
    sd_adapter=..., base_folder=...)``, or through a trainer config that names this class.
    The extra fields are the writer's and reader's options.
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        """torchtitan's checkpoint config, plus how our writer and reader run."""

        verify: bool = True
        """Check every chunk's blake3 on load."""

        thread_count: int | None = None
        """Writer and reader threads per rank (their defaults when ``None``)."""

        storage_options: dict[str, Any] = dataclasses.field(default_factory=dict)
        """Backend options (``endpoint_url=...`` for S3, ``volume=True``, ...)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.goodput = config

    @torch.no_grad()
    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ) -> Any:
        """torchtitan's ``dcp_save`` with our writer (Hugging Face exports: torchtitan's own)."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        cfg = self.goodput
        writer = CheckpointWriter(checkpoint_id, overwrite=True, thread_count=cfg.thread_count, **cfg.storage_options)
        if async_mode == AsyncMode.ASYNC:
            ret = dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)
        elif async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            ret = dcp.async_save(
                state_dict,
                storage_writer=writer,
                process_group=self.pg,
                async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )
        else:
            try:
                ret = dcp.save(state_dict, storage_writer=writer)
            except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
                raise as_checkpoint_error(e, f"saving the checkpoint at {writer.checkpoint_id}")  # noqa: B904 - it chains e
        if enable_garbage_collection:  # as torchtitan's own dcp_save does after a blocking save
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool, from_quantized: bool) -> None:
        """torchtitan's ``dcp_load`` with our reader (Hugging Face imports: torchtitan's own)."""
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        cfg = self.goodput
        reader = CheckpointReader(
            checkpoint_id, verify=cfg.verify, thread_count=cfg.thread_count, **cfg.storage_options
        )
        try:
            dcp.load(state_dict, storage_reader=reader)
        except (Exception, CheckpointException) as e:  # a damaged file: CorruptCheckpointError, named
            raise as_checkpoint_error(e, f"loading the checkpoint at {reader.checkpoint_id}")  # noqa: B904 - it chains e
        if _MODEL in self.states:  # torchtitan flattens the model's states into state_dict
            self.states[_MODEL].load_state_dict(state_dict)
        return None

    def _find_load_step(self, folder: str = "") -> int:
        """The highest step under ``folder`` whose commit record is valid (-1: none)."""
        found = committed_numbered(folder or self.folder, "step-", self.goodput.storage_options)
        return max(found, default=-1)
