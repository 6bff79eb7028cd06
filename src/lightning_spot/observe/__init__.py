"""See what a run does: the pipeline timeline, throughput and bubble figures, Gantt charts and the
report of a run's history."""
