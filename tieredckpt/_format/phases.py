"""Where a save's time goes, without threading timers through every call.

    with collecting() as spent:          # the caller that wants the figures
        save_sharded(...)                 # deep inside: with phase("fsync"): os.fsync(fd)
    spent == {"fsync": 0.41, "commit": 0.002}

A phase outside any ``collecting`` costs one context-variable lookup. Collection is
per thread (a context variable), so the writer thread's figures never mix with
another thread's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_spent: ContextVar[dict | None] = ContextVar("tieredckpt_phases", default=None)


@contextmanager
def collecting() -> Iterator[dict]:
    spent: dict[str, float] = {}
    token = _spent.set(spent)
    try:
        yield spent
    finally:
        _spent.reset(token)


@contextmanager
def phase(name: str) -> Iterator[None]:
    spent = _spent.get()
    if spent is None:
        yield
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - start
