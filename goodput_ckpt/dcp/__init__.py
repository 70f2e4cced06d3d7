"""The torch DCP adapters: byte layout planning, hashing, staging and the commit."""

from .load_planner import GridLoadPlanner
from .reader import CheckpointReader
from .writer import CheckpointWriter

__all__ = ["CheckpointReader", "CheckpointWriter", "GridLoadPlanner"]
