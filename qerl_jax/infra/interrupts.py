"""Stopping a training run only at step boundaries: SIGINT and SIGTERM raise `Interrupted` where
the code is, except inside `StopSignals.deferred()` blocks (an update and the state change
that records it, a checkpoint save), where they wait until the block ends."""

from __future__ import annotations

import contextlib
import signal
import threading


class Interrupted(BaseException):
    """SIGINT or SIGTERM, raised where the running code is (outside deferred blocks)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.signal_name = signal.Signals(signum).name


class StopSignals:
    """SIGINT/SIGTERM raise Interrupted, except inside `deferred()` blocks (an update and the
    state change that records it, a checkpoint save), where they are held until the block
    ends. Installed only in the main thread (signal handlers can be set nowhere else)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self._depth = 0
        self._pending: list[int] = []
        self._active = False

    def _handle(self, signum, frame):
        del frame
        if self._depth:
            self._pending.append(signum)
        else:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        self._active = True
        try:
            yield
        finally:
            self._active = False
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    @contextlib.contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._pending:
            signum = self._pending[0]
            self._pending.clear()
            raise Interrupted(signum)


@contextlib.contextmanager
def logging_above_progress_bar(progress):
    """While the progress bar runs, log records are printed above it (one bar line)."""
    if progress is None:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm
    with logging_redirect_tqdm():
        yield
