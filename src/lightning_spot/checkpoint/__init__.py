"""Sharded checkpoints of pipeline-parallel models (see ``sharded``)."""
