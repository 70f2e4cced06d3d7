"""Adapters for the trainers users already run (issue 39).

Each submodule imports its trainer's library and is imported only when used, so the core keeps
no dependency on them: ``from goodput_ckpt.integrations.lightning import GoodputCheckpointIO``.
This package's own import pulls in nothing of theirs. The layer sits above ``tools/``: it
imports the layers below it (dcp, format, storage, errors), and nothing below imports it.
"""
