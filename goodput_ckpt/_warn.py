"""Warnings that point at the user's line, however deep inside the package they are raised.

A fixed ``stacklevel`` breaks silently whenever a call chain gains or loses a frame (the two-tier
restore's warnings pointed into the package after one refactor); this finds the first frame
outside the package instead, as Python 3.12's ``skip_file_prefixes`` does.
"""

from __future__ import annotations

import os
import sys
import warnings

__all__ = ["warn_user"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message)`` attributed to the nearest caller outside this package."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
