"""The torch DCP adapters: the planners, the storage writer and reader, the commit record built
from DCP's plans, and staging. The bytes themselves (layout, hashing, writes, read runs) are
the torch-free ``goodput_ckpt.engine``'s."""

from .load_planner import GridLoadPlanner
from .reader import CheckpointReader
from .writer import CheckpointWriter

__all__ = ["CheckpointReader", "CheckpointWriter", "GridLoadPlanner"]
