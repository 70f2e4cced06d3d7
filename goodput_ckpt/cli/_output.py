"""Rendering for the CLI: tables, sizes, JSON, progress bars. No checkpoint logic here."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["Output", "escape", "human_bytes", "human_rate", "human_seconds", "parse_size", "table", "to_jsonable"]

#: Characters a terminal acts on or hides: C0 and C1 controls (CR, backspace, ESC that starts
#: cursor moves and erases), DEL, and the invisible format characters (zero-width ones, line
#: and paragraph separators, bidirectional overrides and isolates, the BOM).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
_UNSAFE_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _escaped(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape(text: object, *, keep_newlines: bool = False) -> str:
    """``text`` with every character a terminal would act on written as ``\\xNN``/``\\uNNNN``.

    Why: keys, file names, URIs and messages come from checkpoints, which may be hostile. Printed
    raw, a crafted key can move the cursor, erase the line that says CORRUPT and print a fake
    OK. Every human renderer goes through here (:func:`table` cells and :class:`Output`'s lines);
    ``--json`` output is escaped by the JSON encoder instead. A field that is one value (a key,
    a URI) escapes newlines too, so it cannot start a line of its own.
    """
    return (_UNSAFE_BUT_NEWLINE if keep_newlines else _UNSAFE).sub(_escaped, str(text))


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def human_rate(nbytes: int | float, seconds: float) -> str:
    """Bytes per second in the unit their size calls for (``"512 B/s"``, ``"164.3 MiB/s"``):
    a fixed GB/s printed ``0.00 GB/s`` for a small conversion."""
    if not seconds > 0:
        return "-"
    return human_bytes(nbytes / seconds) + "/s"


def human_seconds(seconds: float) -> str:
    """``0.0123`` -> ``"12 ms"``, ``2.5`` -> ``"2.50 s"``."""
    return f"{1000 * seconds:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 512 * 2**20 (for argparse ``type=``)."""
    import argparse

    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num) :]
    try:
        value = int(float(num) * _UNITS[unit])
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (examples: 512MiB, 5GB, 1048576)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A plain aligned text table; columns listed in ``right`` are right-aligned."""
    cells = [[escape(h) for h in headers]] + [["" if c is None else escape(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def to_jsonable(obj: Any) -> Any:
    """Dataclass reports (with their properties such as ``ok``/``gbps``) as JSON-ready data."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for name in ("ok", "gbps", "latest_complete"):
            if isinstance(getattr(type(obj), name, None), property):
                out[name] = to_jsonable(getattr(obj, name))
        return out
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


#: A command that ends within this many seconds never shows a bar. Counted from the command's
#: start, not the phase's: start-up (importing torch and DCP takes seconds on a busy machine)
#: and earlier phases count, so a short phase late in a long command draws at once.
BAR_DELAY = 1.0
#: The size used when the terminal reports none: a pseudo-terminal whose size nobody set
#: (``script``, ``docker exec -t``, many CI and agent harnesses) reports 0 columns and 0 rows,
#: and tqdm lays a bar out for 0 columns as an empty string, and hides every bar below row 0.
FALLBACK_SIZE = (80, 24)
#: Bytes done and in all, the rate and the time left, whatever the terminal's width.
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"


def _bar_size(stream: TextIO) -> dict[str, Any]:
    """tqdm's size arguments: follow the terminal when it reports a size; otherwise a fixed
    ``$COLUMNS`` x ``$LINES``, or :data:`FALLBACK_SIZE`."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, ValueError, OSError):
        size = os.terminal_size((0, 0))
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    fixed = []
    for name, default in zip(("COLUMNS", "LINES"), FALLBACK_SIZE):
        env = os.environ.get(name, "")
        fixed.append(int(env) if env.isdigit() and 0 < int(env) < 10_000 else default)
    return {"ncols": fixed[0], "nrows": fixed[1]}


class _Bar:
    """A thread-safe tqdm bar, one phase at a time (workers advance it concurrently)."""

    def __init__(self, stream: TextIO, started: float) -> None:
        self._stream = stream
        self._started = started
        self._bar = None
        self._lock = threading.Lock()  # tqdm.update is not safe from several threads

    def start(self, total: int, what: str) -> None:
        from tqdm import tqdm

        with self._lock:
            if self._bar is not None:
                self._bar.close()
            delay = max(0.0, BAR_DELAY - (time.monotonic() - self._started))
            self._bar = tqdm(
                total=total,
                desc=what,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self._stream,
                delay=delay,
                leave=False,
                bar_format=_BAR_FORMAT,
                **_bar_size(self._stream),
            )

    def advance(self, n: int) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(n)

    def note(self, text: str) -> None:
        """One line of text above the bar (the bar is cleared, the line written, the bar redrawn)."""
        with self._lock:
            if self._bar is not None:
                self._bar.clear()
            self._stream.write(escape(text, keep_newlines=True) + "\n")
            self._stream.flush()
            if self._bar is not None:
                self._bar.refresh()

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()
                self._bar = None


class StdoutClosed(Exception):
    """Whoever read stdout closed it (``goodput-ckpt inspect CKPT | head -1``): the command
    stops quietly, as Unix tools do (exit 141, the status of a process killed by SIGPIPE)."""


class Output:
    """Where a command's results go: text or ``--json`` on stdout, messages on stderr.

    A progress bar is drawn only when stderr is a terminal, ``--json`` is off and
    ``--no-progress`` was not given, and only once the command has run :data:`BAR_DELAY`
    seconds (counted from this object's creation, which ``main`` does before any heavy import).
    """

    def __init__(
        self,
        *,
        json_mode: bool = False,
        progress: bool = True,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.show_progress = progress and not json_mode and _isatty(self.stderr)
        self._started = time.monotonic()
        self._bar: _Bar | None = None

    def progress(self):
        """A :class:`~goodput_ckpt.tools._common.Progress` for the library call."""
        if self.show_progress:
            self._bar = _Bar(self.stderr, self._started)
            return self._bar
        from ..tools._common import NO_PROGRESS

        return NO_PROGRESS

    def note(self, text: str) -> None:
        """A line on stderr that does not tear a bar being drawn (above it, when one is)."""
        if self._bar is not None:
            self._bar.note(text)
        else:
            self.warn(text)

    def emit_json(self, obj: Any) -> None:
        self._write(json.dumps(to_jsonable(obj), indent=2, allow_nan=False) + "\n", flush=True)

    def print(self, text: str = "") -> None:
        """One or more lines of text, terminal controls escaped (:func:`escape`)."""
        self._write(escape(text, keep_newlines=True) + "\n")

    def flush(self) -> None:
        self._write("", flush=True)

    def _write(self, text: str, *, flush: bool = False) -> None:
        # Only stdout's own broken pipe means "the reader left"; one from a socket (S3) is an error.
        try:
            if text:
                self.stdout.write(text)
            if flush:
                self.stdout.flush()
        except BrokenPipeError as e:
            raise StdoutClosed("the reader of stdout went away") from e

    def warn(self, text: str) -> None:
        self.stderr.write(escape(text, keep_newlines=True) + "\n")


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
