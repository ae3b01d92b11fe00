"""The project's error type for user mistakes: bad configs, requests, checkpoints, datasets.

The CLI prints an `AerieError` as one line (no traceback) and exits non-zero; anything else is a bug.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class AerieError(ValueError):
    """A user-facing error whose message says what is wrong and how to fix it."""


class CheckpointError(AerieError):
    """A checkpoint directory whose files or tensors disagree with its config."""


def exit_status(body: Callable[[], object]) -> int:
    """A command's exit status: 0 once `body` returns; 2 with its AerieError printed in one line (no traceback)."""
    try:
        body()
    except AerieError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
