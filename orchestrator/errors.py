"""The project's error type for user mistakes: bad configs, requests, checkpoints, datasets.

The CLI prints an `AerieError` as one line (no traceback) and exits non-zero; anything else is a bug.
"""


class AerieError(ValueError):
    """A user-facing error whose message says what is wrong and how to fix it."""


class CheckpointError(AerieError):
    """A checkpoint directory whose files or tensors disagree with its config."""
