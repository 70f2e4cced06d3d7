"""The manager's async staging, in one place.

- :mod:`.stager`: ``ReusableStager``, CPU buffers kept from one save to the next;
- :mod:`.deferred_copy`: the copies of parameters and optimizer states left to finish after
  ``save`` returned, and the check that their sources did not change meanwhile;
- :mod:`.step_guard`: the optimizer step pre-hook that finishes those copies first;
- :mod:`.confirmed_writer`: the ``CheckpointWriter`` that commits only when every rank's
  copies are good.
"""
