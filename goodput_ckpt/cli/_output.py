"""Rendering for the CLI: tables, sizes, JSON, progress bars. No checkpoint logic here."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["Output", "escape", "human_bytes", "parse_size", "table", "to_jsonable"]

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


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30,
          "t": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}  # fmt: skip


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


class _Bar:
    """A thread-safe tqdm bar for one phase (workers advance it concurrently)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._bar = None
        self._lock = threading.Lock()  # tqdm.update is not safe from several threads

    def start(self, total: int, what: str) -> None:
        from tqdm import tqdm

        with self._lock:
            if self._bar is not None:
                self._bar.close()
            # delay: work that ends within a second never shows a bar.
            self._bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, unit_divisor=1024,
                             file=self._stream, delay=1.0, leave=False, dynamic_ncols=True)  # fmt: skip

    def advance(self, n: int) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.update(n)

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
    ``--no-progress`` was not given.
    """

    def __init__(self, *, json_mode: bool = False, progress: bool = True, stdout: TextIO | None = None, stderr: TextIO | None = None) -> None:
        self.json_mode = json_mode
        self.stdout = stdout or sys.stdout
        self.stderr = stderr or sys.stderr
        self.show_progress = progress and not json_mode and _isatty(self.stderr)

    def progress(self):
        """A :class:`~goodput_ckpt.tools._common.Progress` for the library call."""
        if self.show_progress:
            return _Bar(self.stderr)
        from ..tools._common import NO_PROGRESS

        return NO_PROGRESS

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
