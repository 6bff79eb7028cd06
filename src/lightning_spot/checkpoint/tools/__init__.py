"""Reading checkpoints outside training: consolidated weights, exports to other formats."""
