"""Shard format v1 (docs/FORMAT.md): reader API and the inspect/verify/export/merge commands."""

from .codec import CorruptRecord
from .reader import HiddenStatesDataset, ShardReader

__all__ = ["CorruptRecord", "HiddenStatesDataset", "ShardReader"]
