"""SIGTERM = save and exit, SIGUSR1 = save and continue; handlers only set flags.

A handler never does I/O: it records the request and returns. The training
loop asks :meth:`Requests.save_requested` / :meth:`Requests.stop_requested` at
each step boundary and acts there. Previous Python handlers are chained (called
after ours); previous handlers are restored when the context exits.

A request that arrives while a save is running is not lost: the store clears
the save request just *before* it snapshots the state, so anything that
arrives later stays pending for the next boundary.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

SAVE_AND_EXIT = signal.SIGTERM
SAVE_AND_CONTINUE = signal.SIGUSR1


class Requests:
    """Flags set by signal handlers (or by code: :meth:`request_save`, :meth:`request_stop`)."""

    def __init__(self) -> None:
        self._save = threading.Event()
        self._stop = threading.Event()
        self.received: list[str] = []

    def request_save(self) -> None:
        self._save.set()

    def request_stop(self) -> None:
        self._stop.set()
        self._save.set()

    def save_requested(self) -> bool:
        return self._save.is_set()

    def stop_requested(self) -> bool:
        return self._stop.is_set()

    def clear_save(self) -> None:
        self._save.clear()

    def _handler(self, previous):
        def handle(signum, frame):
            # Only flag-setting here: no I/O, no locks the main thread may hold.
            self.received.append(signal.Signals(signum).name)
            if signum == SAVE_AND_EXIT:
                self.request_stop()
            else:
                self.request_save()
            if callable(previous):
                previous(signum, frame)
        return handle


@contextmanager
def handle_signals(requests: Requests, signals=(SAVE_AND_EXIT, SAVE_AND_CONTINUE)) -> Iterator[Requests]:
    """Install flag-setting handlers for ``signals``; restore the previous ones on exit."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("signal handlers can only be installed from the main thread")
    previous = {}
    try:
        for signum in signals:
            previous[signum] = signal.getsignal(signum)
            signal.signal(signum, requests._handler(previous[signum]))
        yield requests
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
