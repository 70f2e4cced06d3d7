"""Helpers shared by every test folder, imported as ``helpers`` (tests/ is on pytest's ``pythonpath``).

- :mod:`helpers.trees`: state dicts: :func:`make_state` (the state most tests save),
  :func:`zeros_like` (a load destination that holds none of the values) and exact comparison.
- :mod:`helpers.wait`: :func:`wait_until`, the one bounded poll.
- :mod:`helpers.errors`: :func:`~helpers.errors.checkpoint_error`, the typed error inside what DCP raised.
- :mod:`helpers.dcp_saves`: simulated DCP saves (metadata and write results) for the coordinator's tests.
- :mod:`helpers.samples`: the tools' sample checkpoint and ways to damage one.
- :mod:`helpers.s3_roundtrip`: save to and load from an S3 test server, at S3's part sizes.
- :mod:`helpers.dist`: gloo process groups; :mod:`helpers.s3`, :mod:`helpers.volume`: real S3 servers,
  a fault proxy and FUSE mounts; :mod:`helpers.store_fixtures`: their pytest fixtures.

Only the light modules are re-exported here, so that ``import helpers`` starts no server code.
"""

from helpers.trees import assert_tree_equal, make_state, same_tensor, zeros_like
from helpers.wait import wait_until

__all__ = ["assert_tree_equal", "make_state", "same_tensor", "wait_until", "zeros_like"]
