"""What the manager reports in its log: a restore's notes and tier fallbacks go to the
``goodput_ckpt`` loggers at WARNING, one record per event, and nowhere else (no ``UserWarning``
beside them, issue 32)."""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Iterator


@contextlib.contextmanager
def logged_warnings(pattern: str) -> Iterator[list[logging.LogRecord]]:
    """Collect the WARNING records of the ``goodput_ckpt`` loggers made inside; on leaving,
    require one that matches ``pattern`` (``re.search``) and no ``UserWarning`` that matches it
    (one channel). Yields the list of records (filled as they come)."""
    records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = _Keep(logging.WARNING)
    log = logging.getLogger("goodput_ckpt")
    level = log.level
    log.addHandler(handler)
    log.setLevel(min(level or logging.WARNING, logging.WARNING))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    messages = [r.getMessage() for r in records]
    assert any(re.search(pattern, m) for m in messages), (pattern, messages)
    doubled = [str(w.message) for w in caught if re.search(pattern, str(w.message))]
    assert not doubled, f"also warned as a UserWarning: {doubled}"
