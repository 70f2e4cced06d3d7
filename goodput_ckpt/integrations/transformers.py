"""Hugging Face ``transformers``: a ``Trainer`` whose checkpoints are goodput-ckpt checkpoints.
Needs the ``transformers`` package (and ``accelerate``, which the Trainer needs), imported only
here: ``import goodput_ckpt`` does not import them.

Why a Trainer mixin and not a ``TrainerCallback``: the Trainer has no public hook that replaces
its checkpoint format. A callback's ``on_save`` runs after ``_save_checkpoint`` has written
``torch.save`` files, and on resume the Trainer reads ``trainer_state.json``, the weights, the
optimizer, scheduler and RNG files by path (``train()``, ``_init_training_state``,
``_load_optimizer_and_scheduler``, ``_load_rng_state``) before any callback runs, and computes
the epoch and batch to resume from in locals no callback can set. So this module overrides the
Trainer's own checkpoint methods: underscored, not a documented API (written against
transformers 5.25; a release that renames them breaks the mixin, and the tests say so):

- ``_save_checkpoint``: one checkpoint *location* ``<root>/checkpoint-<step>`` in our format
  (tensors as raw bytes hashed with blake3, the rest as JSON in the manifest, :mod:`._tree`):
  the model's state dict, the optimizer, the LR scheduler, the gradient scaler, every process's
  RNG streams, and the ``TrainerState`` (global step, log history, callback states);
  ``save_total_limit`` removes only committed checkpoints of ours, oldest step first;
- ``train(resume_from_checkpoint=...)``: ``True`` takes the newest *committed* checkpoint
  under the root (a save killed half-way is skipped), a string takes that location; the
  checkpoint is loaded once, verified, and the Trainer's own resume logic then runs unchanged
  (it skips the batches already trained in the epoch and restores the RNG where it always does);
- ``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
  ``_load_rng_state``, ``_load_best_model``: read from that checkpoint instead of files.

``trainer_state.json`` is the one thing the Trainer reads by path with no method around it
(``TrainerState.load_from_json(os.path.join(checkpoint, ...))``): the mixin writes the state
from the verified checkpoint into a private temporary directory and hands the Trainer that
directory as the checkpoint path; everything else comes from the loaded checkpoint.

A path that is not one of our checkpoints (a directory the stock Trainer saved) goes to the
Trainer's own methods, so a run can switch formats and still resume from its last old
checkpoint. Limits (DeepSpeed, FSDP, ``push_to_hub``) are in docs/integrations.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from typing import Any

from transformers import Trainer
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ..errors import CheckpointError
from ..format.commit_record import MISSING
from ..manager.step_layout import child_uri
from ..state.rng import capture_rng
from ._locations import committed_numbered, is_committed, record_status, remove_location
from ._processes import gather_per_process, load_into, restore_process_rng
from ._tree import check_tree_kind, load_tree, save_tree

__all__ = ["CHECKPOINT_KIND", "GoodputTrainer", "GoodputTrainerMixin"]

logger = logging.getLogger("goodput_ckpt.integrations.transformers")

#: What the checkpoint's tree says it is, and the layout version of that tree.
CHECKPOINT_KIND = "transformers.Trainer"
_VERSION = 1
_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_STATE_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainerState))


@dataclasses.dataclass
class _Resume:
    staged: str  # the directory the Trainer is handed as its checkpoint path
    uri: str  # where the checkpoint really is
    tree: dict[str, Any]


class GoodputTrainerMixin:
    """Put before ``Trainer`` (or a subclass of it) in the bases; see the module doc.

    Args:
        checkpoint_root: where the ``checkpoint-<step>`` locations go: any URL our stores take
            (a local path, a mounted volume, ``s3://bucket/prefix``). Default: the Trainer's
            ``args.output_dir``. With a hyper-parameter search, each trial's run name is a
            sub-location of it, as with the Trainer's own layout.
        checkpoint_options: backend options for every location (``endpoint_url=...`` for S3,
            ``volume=True``, ...; see :class:`~goodput_ckpt.CheckpointWriter`).
        verify: check every chunk's blake3 on load; a damaged file raises
            :class:`~goodput_ckpt.CorruptCheckpointError` naming it.
        thread_count: writer and reader threads (their defaults).
        *args, **kwargs: the Trainer's own.

    Raises:
        CheckpointError: the Trainer runs DeepSpeed or FSDP, whose checkpoints the Trainer
            writes through their own engines (not supported here).
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_root: str | os.PathLike | None = None,
        checkpoint_options: dict[str, Any] | None = None,
        verify: bool = True,
        thread_count: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise CheckpointError(
                "GoodputTrainerMixin does not support DeepSpeed or FSDP: the Trainer saves their sharded "
                "state through their own engines (deepspeed save_checkpoint, accelerate's save_fsdp_model)"
            )
        if self.args.push_to_hub:
            logger.warning(
                "push_to_hub: checkpoints in goodput-ckpt's format are not pushed (the model that "
                "trainer.push_to_hub() or save_model() writes is)"
            )
        self.checkpoint_root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        self.checkpoint_options = dict(checkpoint_options or {})
        self.checkpoint_verify = bool(verify)
        self.checkpoint_threads = thread_count
        self._goodput_resume: _Resume | None = None

    # ---- where checkpoints are ----

    def _goodput_run_root(self, trial: Any) -> str:
        run_dir = self._get_output_dir(trial=trial)
        if self.checkpoint_root is None:
            return run_dir
        if os.path.normpath(run_dir) == os.path.normpath(self.args.output_dir):
            return self.checkpoint_root
        return child_uri(self.checkpoint_root, os.path.basename(os.path.normpath(run_dir)))

    def _goodput_io(self) -> dict[str, Any]:
        return {"thread_count": self.checkpoint_threads, **self.checkpoint_options}

    # ---- save ----

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save the whole training state at ``<root>/checkpoint-<global step>`` (all processes
        call this; the world's main process writes, after gathering every process's RNG)."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        root = self._goodput_run_root(trial)
        uri = child_uri(root, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        best_step = getattr(self.state, "best_global_step", None)  # not in older transformers
        if self.args.save_strategy in ("steps", "epoch", "best") and best_step:  # a str enum
            best = child_uri(root, f"{PREFIX_CHECKPOINT_DIR}-{best_step}")
            if best == uri or is_committed(best, self.checkpoint_options):
                self.state.best_model_checkpoint = best
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name, state = cb.__class__.__name__, cb.state()  # the Trainer's own bookkeeping, as it does it
            if isinstance(self.state.stateful_callbacks[name], list):
                self.state.stateful_callbacks[name].append(state)
            else:
                self.state.stateful_callbacks[name] = state
        rngs = gather_per_process(capture_rng()) if not self.args.save_only_model else None
        if not self.args.should_save:
            return
        tree: dict[str, Any] = {
            "kind": CHECKPOINT_KIND,
            "version": _VERSION,
            "model": self.model.state_dict(),
            "trainer_state": dataclasses.asdict(self.state),
        }
        if not self.args.save_only_model:
            scaler = getattr(self.accelerator, "scaler", None)
            tree["optimizer"] = self.optimizer.state_dict()
            tree["scheduler"] = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
            tree["scaler"] = scaler.state_dict() if scaler is not None else None
            tree["rng"] = rngs  # one per process, by process index
        save_tree(tree, uri, **self._goodput_io())
        self._goodput_rotate(root)

    def _goodput_rotate(self, root: str) -> None:
        """``save_total_limit``: keep the newest checkpoints and the best one; remove the oldest
        committed checkpoints of ours beyond the limit (by step, not by file time)."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        found = committed_numbered(root, f"{PREFIX_CHECKPOINT_DIR}-", self.checkpoint_options)
        uris = list(found.values())
        protected = {uris[-1]} if uris else set()
        if self.state.best_model_checkpoint is not None:
            protected.add(str(self.state.best_model_checkpoint))
        excess = len(uris) - max(limit, len(protected))
        for uri in uris:
            if excess <= 0:
                break
            if uri not in protected:
                logger.info("removing %s (save_total_limit=%d)", uri, limit)
                remove_location(uri, self.checkpoint_options)
                excess -= 1

    # ---- resume ----

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint=True`` resumes from the newest committed
        checkpoint of ours under the root (the Trainer's own search when there is none), a
        string from that location (the Trainer's own load when it is not ours).

        Raises:
            CheckpointNotFoundError, CorruptCheckpointError, CheckpointError: the checkpoint
                cannot be loaded (a damaged file is named).
        """
        uri = self._goodput_find(resume_from_checkpoint, trial)
        if uri is None:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        tree = _load_checkpoint(uri, verify=self.checkpoint_verify, **self._goodput_io())
        with tempfile.TemporaryDirectory(prefix="goodput-hf-resume-") as staged:
            with open(os.path.join(staged, _STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(tree["trainer_state"], f)
            self._goodput_resume = _Resume(staged, uri, tree)
            logger.info("resuming from %s", uri)
            try:
                return super().train(
                    resume_from_checkpoint=staged, trial=trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
                )
            finally:
                self._goodput_resume = None

    def _goodput_find(self, resume: str | bool | None, trial: Any) -> str | None:
        if resume is None or resume is False:
            return None
        if resume is True:
            found = committed_numbered(
                self._goodput_run_root(trial), f"{PREFIX_CHECKPOINT_DIR}-", self.checkpoint_options
            )
            return next(reversed(found.values()), None)
        uri = os.fspath(resume)
        # Ours when it has a commit record of ours, even a damaged one: the load then says what is
        # wrong, instead of the Trainer's "Can't find a valid checkpoint".
        return None if record_status(uri, self.checkpoint_options) == MISSING else uri

    def _goodput_tree(self, checkpoint: Any) -> dict[str, Any] | None:
        r = self._goodput_resume
        return r.tree if r is not None and checkpoint == r.staged else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        tree = self._goodput_tree(resume_from_checkpoint)
        if tree is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        load_into(
            model if model is not None else self.model, tree["model"], "model", self._goodput_resume.uri, strict=True
        )

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        tree = self._goodput_tree(checkpoint)
        if tree is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        uri = self._goodput_resume.uri
        if tree.get("optimizer") is not None:  # absent with save_only_model, as the Trainer's own
            load_into(self.optimizer, tree["optimizer"], "optimizer", uri)
        if tree.get("scheduler") is not None and self.lr_scheduler is not None:
            load_into(self.lr_scheduler, tree["scheduler"], "scheduler", uri)

    def _load_scaler(self, checkpoint: str | None) -> None:
        tree = self._goodput_tree(checkpoint)
        if tree is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if tree.get("scaler") is not None and scaler is not None:
            load_into(scaler, tree["scaler"], "scaler", self._goodput_resume.uri)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        tree = self._goodput_tree(checkpoint)
        if tree is None:
            return super()._load_rng_state(checkpoint)
        restore_process_rng(tree.get("rng"), self.args.process_index, self.args.world_size, self._goodput_resume.uri)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not is_committed(best, self.checkpoint_options):
            return super()._load_best_model()
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        tree = _load_checkpoint(best, verify=self.checkpoint_verify, **self._goodput_io())
        load_into(self.model, tree["model"], "model", best, strict=True)


class GoodputTrainer(GoodputTrainerMixin, Trainer):
    """``transformers.Trainer`` saving and resuming through goodput-ckpt (see the module doc)."""


def _load_checkpoint(uri: str, **reader_options: Any) -> dict[str, Any]:
    tree = load_tree(uri, **reader_options)
    check_tree_kind(tree, uri, kind=CHECKPOINT_KIND, version=_VERSION, layout="Trainer")
    state = tree.get("trainer_state")
    if not isinstance(tree.get("model"), dict) or not isinstance(state, dict):
        raise CheckpointError(f"{uri}: the Trainer checkpoint lacks its model or trainer state", path=uri)
    unknown = sorted(set(state) - _STATE_FIELDS, key=str)
    if unknown:  # the Trainer builds TrainerState(**state): an unknown key would be its TypeError
        raise CheckpointError(
            f"{uri}: the trainer state holds fields this transformers does not know: {unknown[:5]!r:.200}",
            path=uri,
            key="trainer_state",
        )
    return tree
