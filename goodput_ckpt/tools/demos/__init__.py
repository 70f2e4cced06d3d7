"""Demos: a real training job killed, resumed bit for bit, and its goodput accounted for.

:mod:`.demo` (``goodput-ckpt demo``: one tier) and :mod:`.demo_tiers` (``--tiers``: one tier
against two, for the same failure) run the job of :mod:`._demo_job` through
:mod:`._job_launch`; :mod:`.results` holds what both report about a resumed run.
"""
