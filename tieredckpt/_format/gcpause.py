"""The cyclic garbage collector held off while save() snapshots a state.

A snapshot makes a few Python objects per tensor (the skeleton's nodes, names, index
entries), none of them in a cycle. With tens of thousands of tensors those allocations
set off collections of every generation, each walking every tracked object of the process
(the model's modules, the optimizer's dicts, the data loader's): half the blocking time of
a 100,000-tensor save here (2.02 s -> 0.98 s for the snapshot with collection held off).
Reference counting still frees everything at once; only the search for cycles waits until
the snapshot is taken, which is what ``gc.freeze``-style pauses in servers do too.

Process-wide, so nested and concurrent pauses (two stores saving on two threads) are
counted: collection resumes when the last one ends, and only if it was on before the first.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
