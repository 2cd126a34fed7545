"""Errors of a run that started (kept free of torch imports: the CLI catches them)."""


class TrainingError(RuntimeError):
    """The run could not go on, e.g. train.max_skipped_steps non-finite steps in a row."""
