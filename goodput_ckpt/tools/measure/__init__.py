"""Benchmarks and measurement: how fast a storage location saves and loads, and what that means
for the checkpoint interval.

:mod:`.bench` (``goodput-ckpt bench``: save, load, stall and verify throughput against torch's
own writers; its procedure in the ``_bench_*`` modules, which ``benchmarks/`` reuses), and
:mod:`.plan` and :mod:`.plan_two_level` (``goodput-ckpt plan``: the interval, or the two-tier
schedule, that maximizes goodput for measured costs and failure rates).
"""
