"""``SpotPipelineStrategy`` (``strategy="spot_pipeline"``), and the modules that do its work at setup and in steps."""

from lightning_spot.strategy.strategy import SpotPipelineStrategy

__all__ = ["SpotPipelineStrategy"]
