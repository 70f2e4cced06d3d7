"""Checkpoint operations: the tools that read or rewrite a checkpoint a user already has.

:mod:`.verify` (every file and chunk against its hash), :mod:`.inspect` (what a checkpoint
holds), :mod:`.ls` (the checkpoints under a manager root), :mod:`.reshard` (rewrite for another
world size) and :mod:`.convert` (between the goodput format, torch DCP, ``torch.save`` and
safetensors); :mod:`._dcp_foreign` reads a plain torch DCP checkpoint for ``verify`` and
``inspect``. The format adapters they stream through are ``tools/_formats/`` (shared, below the
three purposes, as is ``tools/_common``).
"""
