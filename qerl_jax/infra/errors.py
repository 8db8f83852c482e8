"""The errors a user fixes by changing an input: the CLIs print their message as one line
(no traceback) and exit with status 2. Anything else is a bug or the platform's failure."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad config field, data file or row, or run directory; the message names it."""


class TrainingStopped(RuntimeError):
    """A run stopped before its last step (an interrupt, a full disk, repeated non-finite
    updates); the message says where it stopped and what was saved."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code
