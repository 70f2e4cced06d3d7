"""The report of ``bench``: what each method measured, and its JSON document.

The document (:meth:`BenchReport.to_json`) is the ``--json`` output of ``goodput-ckpt bench`` and
the input of ``goodput-ckpt plan --from-bench``. Its keys are stable within one ``schema``
(:data:`BENCH_SCHEMA`): a change that renames or removes one must change the schema name.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ._bench_measure import RatioSpread, ratio_spread

__all__ = ["BENCH_SCHEMA", "GB", "SAMPLES", "BenchReport", "MethodResult"]

#: The ``schema`` of :meth:`BenchReport.to_json`; a reader (``plan --from-bench``) checks it.
BENCH_SCHEMA = "goodput-ckpt.bench/1"
GB = 1e9
#: The sample lists of :class:`MethodResult`, in the order of the report.
SAMPLES = ("save_s", "load_s", "stall_s", "async_total_s", "verify_s")


@dataclass
class MethodResult:
    """What one method measured. Times in seconds, one sample per repeat.

    Attributes:
        name: ``goodput`` or ``torch``.
        writer, reader: what was used, with its settings.
        payload_bytes: the state's tensor bytes (the numerator of save and load GB/s).
        reason: why the method could not run (``n/a: ...``); ``None`` when it ran.
        verify_reason: why there is no verify figure, for a method that ran.
        files, stored_bytes: what its checkpoint occupies on the storage.
        verify_bytes: the bytes ``verify`` hashed.
        save_s: synchronous ``dcp.save``, until durable.
        load_s: ``dcp.load`` from storage.
        stall_s: how long ``dcp.async_save`` blocked the caller.
        async_total_s: ``dcp.async_save`` until its future completed.
        verify_s: :func:`~goodput_ckpt.tools.verify_checkpoint`.
        save_cpu_s: this process's CPU seconds in each timed save (page faults show here).
        save_other_cpus: CPUs other processes kept busy during each timed save (a noise gauge).
    """

    name: str
    writer: str
    reader: str
    payload_bytes: int
    reason: str | None = None
    verify_reason: str | None = None
    files: int = 0
    stored_bytes: int = 0
    verify_bytes: int = 0
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    stall_s: list[float] = field(default_factory=list)
    async_total_s: list[float] = field(default_factory=list)
    verify_s: list[float] = field(default_factory=list)
    save_cpu_s: list[float] = field(default_factory=list)
    save_other_cpus: list[float] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.reason is None

    def median(self, sample: str) -> float | None:
        """The median of one of :data:`SAMPLES`, or ``None`` when there is none."""
        xs = getattr(self, sample)
        return statistics.median(xs) if xs else None

    def _gbps(self, nbytes: int, sample: str) -> float | None:
        s = self.median(sample)
        return nbytes / s / GB if s else None

    @property
    def save_gbps(self) -> float | None:
        return self._gbps(self.payload_bytes, "save_s")

    @property
    def load_gbps(self) -> float | None:
        return self._gbps(self.payload_bytes, "load_s")

    @property
    def verify_gbps(self) -> float | None:
        return self._gbps(self.verify_bytes, "verify_s")


@dataclass
class BenchReport:
    """The outcome of :func:`bench`; :meth:`to_json` is the ``--json`` document.

    Attributes:
        uri: the location asked for (the current directory by default).
        root: the ``goodput-bench-*`` directory or prefix the run wrote under.
        backend: ``local``, ``volume``, ``s3`` or ``fsspec``.
        size_bytes: the state's payload; ``requested_bytes``: the size asked for.
        cold_cache: whether loads and verifies read from storage (page cache evicted); ``None``
            for remote storage (no local cache to evict).
        kept: checkpoints left in place (``keep=True``).
        seconds: the whole run, state building and clean-up included.
        quiet: the most seconds each step waited for a quiet machine (``None``: a report from
            before it was recorded).
        order: the order the methods ran in, per repeat (saves and loads; the stall pass after
            them ran in the same order).
        loadavg: the 1/5/15-minute load average at the start and at the end.
    """

    uri: str
    root: str
    backend: str
    size_bytes: int
    requested_bytes: int
    tensors: int
    repeats: int
    seed: int
    thread_count: int | None
    torch_thread_count: int | None
    cold_cache: bool | None
    host: dict[str, Any]
    methods: list[MethodResult]
    kept: list[str] = field(default_factory=list)
    seconds: float = 0.0
    quiet: float | None = None
    order: list[list[str]] = field(default_factory=list)
    loadavg: list[list[float]] = field(default_factory=list)

    def method(self, name: str) -> MethodResult:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(name)

    @property
    def ratios(self) -> dict[str, float | None]:
        """goodput / torch for save and load GB/s (above 1: faster) and stall (below 1: shorter)."""
        ours, theirs = self.method("goodput"), self.method("torch")

        def ratio(a: float | None, b: float | None) -> float | None:
            return a / b if a is not None and b else None

        return {
            "save_gbps": ratio(ours.save_gbps, theirs.save_gbps),
            "load_gbps": ratio(ours.load_gbps, theirs.load_gbps),
            "stall_s": ratio(ours.median("stall_s"), theirs.median("stall_s")),
        }

    @property
    def ratio_spreads(self) -> dict[str, RatioSpread | None]:
        """The same ratios as :attr:`ratios`, per repeat (min / median / max; ``stall_s`` is
        goodput's stall over torch's, below 1 shorter); ``None`` where a method has no samples."""
        ours, theirs = self.method("goodput"), self.method("torch")
        out: dict[str, RatioSpread | None] = {}
        for key, sample in (("save_gbps", "save_s"), ("load_gbps", "load_s")):
            a, b = getattr(ours, sample), getattr(theirs, sample)
            out[key] = ratio_spread(a, b) if len(a) == len(b) else None
        a, b = theirs.stall_s, ours.stall_s  # a ratio of times, not of speeds
        out["stall_s"] = ratio_spread(a, b) if len(a) == len(b) else None
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready document with stable keys (GB = 1e9 bytes, times in seconds)."""
        doc: dict[str, Any] = {"schema": BENCH_SCHEMA, "gb": GB}
        for f in fields(self):
            if f.name != "methods":
                doc[f.name] = getattr(self, f.name)
        doc["methods"] = [_method_json(m) for m in self.methods]
        doc["ratios"] = self.ratios
        doc["ratio_spread"] = {
            k: None if r is None else {"min": r.min, "median": r.median, "max": r.max, "per_repeat": list(r.per_repeat)}
            for k, r in self.ratio_spreads.items()
        }
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> BenchReport:
        """Rebuild a report from :meth:`to_json`'s document (derived keys are recomputed).

        Raises:
            ValueError: not a bench report of this schema.
        """
        if not isinstance(doc, Mapping) or doc.get("schema") != BENCH_SCHEMA:
            got = doc.get("schema") if isinstance(doc, Mapping) else type(doc).__name__
            raise ValueError(f"not a goodput-ckpt bench report (schema {BENCH_SCHEMA!r} expected, got {got!r})")
        try:
            methods = [
                MethodResult(
                    **{
                        f.name: m[f.name]
                        for f in fields(MethodResult)
                        if f.name not in SAMPLES and (f.name in m or f.name not in _ADDED)
                    },
                    **{s: list(m["samples"][s]) for s in SAMPLES},
                )
                for m in doc["methods"]
            ]
            return cls(
                **{
                    f.name: doc[f.name]
                    for f in fields(cls)
                    if f.name != "methods" and (f.name in doc or f.name not in _ADDED)
                },
                methods=methods,
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed bench report: {type(e).__name__}: {e}") from None


#: Keys added to the schema later: a report without them (an older one) still reads.
_ADDED = ("quiet", "order", "loadavg", "save_cpu_s", "save_other_cpus")


def _method_json(m: MethodResult) -> dict[str, Any]:
    doc = {f.name: getattr(m, f.name) for f in fields(m) if f.name not in SAMPLES}
    doc["available"] = m.available
    doc["samples"] = {s: getattr(m, s) for s in SAMPLES}
    doc["median"] = {s: m.median(s) for s in SAMPLES}
    doc.update(
        save_gbps=m.save_gbps, load_gbps=m.load_gbps, verify_gbps=m.verify_gbps, stall_s_median=m.median("stall_s")
    )
    return doc
