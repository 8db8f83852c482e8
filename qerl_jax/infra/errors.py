"""The errors a user fixes by changing an input or freeing a resource: the CLIs print their
message as one line (no traceback) and exit with status 2. Anything else is a bug or the
platform's failure."""

from __future__ import annotations

EXIT_BAD_INPUT = 2


class ConfigError(ValueError):
    """A bad config field, data file or row, model file, or run directory; the message names
    it."""


class TrainingStopped(RuntimeError):
    """A run stopped before its last step (an interrupt, a full disk, repeated non-finite
    updates); the message says where it stopped and what was saved."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class StorageError(TrainingStopped):
    """A file that could not be written or read (a full disk, a read-only or missing
    directory); the message names the path. Exit status 2, like a bad input."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=EXIT_BAD_INPUT)
