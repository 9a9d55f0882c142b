"""The loss history file ``.loss.json`` as bytes: two copies of it made one.

JSON Lines, append-only (see _loop/runlog.py for writing and reading it). A run
directory and its remote may each hold a copy; :func:`merge_loss` keeps the longer
and adds any step only the other has, never losing an entry.
"""

from __future__ import annotations

import json


def merge_loss(local: bytes, remote: bytes) -> bytes:
    """Two copies of an append-only ``.loss.json`` made one: the longer, plus any step only the other has.

    When one is a prefix of the other (the usual case: the remote copy lags or leads),
    that is the longer one unchanged.
    """
    longer, shorter = (local, remote) if len(local) >= len(remote) else (remote, local)
    if longer.startswith(shorter):
        return longer
    if longer and not longer.endswith(b"\n"):
        longer += b"\n"
    have = {_step_of(line) for line in longer.splitlines()}
    extra = [line for line in shorter.splitlines() if _step_of(line) not in have and _step_of(line) is not None]
    return longer + b"".join(line + b"\n" for line in extra)


def _step_of(line: bytes):
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    return entry.get("step") if isinstance(entry, dict) and "loss" in entry else None
