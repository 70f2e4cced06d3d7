"""The byte engine between the format and the DCP adapters: how items are laid out in data
files (``layout``), hashed, written and committed on a store (``hashed_write``), how a manifest
is loaded against its commit record (``manifest_load``), each rank's compact write record and the
coordinator's grid detection over it (``rank_writes``, ``group_grids``), how reads are planned
into runs and run (``read_plan``, ``read_runs``), and the guards around decoding stored values
(``untrusted_load``).

It never imports torch (tests/test_layers.py checks this in a process where torch cannot be
imported): the DCP adapters in ``dcp/`` drive it from a save or load, and the tools' format
converters (``tools/_formats/goodput.py``) and the manager's tiers use it directly, with bytes
that did not come from a torch ``StorageWriter``. Nothing is re-exported here: import the module
that owns what you need.
"""
