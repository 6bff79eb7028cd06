"""The durable tier: sharded, layout-independent checkpoints on any fsspec URL, committed by a manifest, and the
run's history; what resumes them."""
