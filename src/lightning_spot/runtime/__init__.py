"""Run training, evaluation and prediction steps through this rank's pipeline stages: the engine, the
step runner, schedules, gradient bookkeeping, the logging bridge, the step clock and trace hooks."""
