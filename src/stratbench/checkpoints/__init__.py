"""Checkpoint files: the full-state file, the sharded (DCP) folder, weights-only loading, layouts across methods."""
