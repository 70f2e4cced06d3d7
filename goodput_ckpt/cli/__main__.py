"""``python -m goodput_ckpt.cli ...``: the ``goodput-ckpt`` command without its entry point."""

import sys

from ._main import main

sys.exit(main())
