"""``CheckpointError``: what every checkpoint reader raises for a checkpoint that does not match the model."""


class CheckpointError(ValueError):
    """A checkpoint does not hold what the model needs (missing, truncated, extra or mis-shaped tensors)."""
