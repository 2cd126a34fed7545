"""The trainer: loop, runtime seam, schedule, metrics and checkpoints."""
