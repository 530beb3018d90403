"""Trainer-side library: rematerialize features from refs (``materialize``)."""

from trainer_lib.materialize import MaterializedBatch, MaterializeStats, materialize

__all__ = ["MaterializeStats", "MaterializedBatch", "materialize"]
