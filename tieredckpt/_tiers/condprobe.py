"""Does the remote enforce the write conditions the lease's fencing rests on? Asked by a writer
before it takes the lease, so a server that ignores them is found out before it costs a step.

Every guarantee against a second writer (two relaunches racing for a free remote, a zombie
writer after a takeover, a re-commit of a committed step) is a conditional PUT: S3's
``If-None-Match: *`` (create only) and ``If-Match: <etag>`` (replace only that version). Many
S3-compatible servers accept both headers and ignore them, answering 200 to every write; then
both writers own the remote and neither is ever told. Others refuse the headers (501 Not
Implemented, 400). Neither shows until two writers meet, which is when it costs a run.

The probe, in order, on one fresh key under ``ROOT/.probe/`` (no reader looks there):
  1. a create-only PUT: must succeed (the key is new);
  2. the same create-only PUT again: must be refused (412, or 409 on a race);
  3. a PUT with ``If-Match`` of an ETag the object never had: must be refused;
  4. the key is deleted (best effort: an object left there is harmless and never read).
Four small requests, once per writer at open. A backend whose conditions are not the
server's (a disk: O_EXCL and flock, enforced by our own code) needs no probe.
"""

from __future__ import annotations

import secrets

from ..errors import RemoteError
from .transport import Transport

PROBE_DIR = ".probe"
_STALE_ETAG = '"00000000000000000000000000000000"'


def ignored_conditions(t: Transport) -> str | None:
    """None when the remote refuses what it must; else what it did instead, as a sentence.
    Transient trouble (the remote does not answer) is raised as it is: the probe is asked again
    at the next try to take the lease."""
    if not t.server_conditions:
        return None
    key = f"{PROBE_DIR}/{secrets.token_hex(8)}"
    try:
        if _refused(t, lambda: t.put_if_absent(key, b"probe 1\n"), "If-None-Match: *") is None:
            return "it refused a create-only write (If-None-Match: *) of a new key"
        if _refused(t, lambda: t.put_if_absent(key, b"probe 2\n"), "If-None-Match: *") is not None:
            return "it accepted a create-only write (If-None-Match: *) over an object that exists"
        if _refused(t, lambda: t.put_if_match(key, b"probe 3\n", _STALE_ETAG), "If-Match") is not None:
            return "it accepted a write with If-Match naming an ETag the object never had"
        return None
    except _Unsupported as exc:
        return str(exc)
    finally:
        try:
            t.rm(key)
        except RemoteError:
            pass  # never read; a later writer's probe uses its own key


class _Unsupported(Exception):
    pass


def _refused(t: Transport, write, header: str):
    """The write's answer (a version, or None when its condition failed); a server that answers
    the header with 501 Not Implemented or 400 is _Unsupported."""
    try:
        return write()
    except RemoteError as exc:
        if exc.transient or exc.status not in (400, 501) and exc.code not in ("NotImplemented", "InvalidArgument"):
            raise
        raise _Unsupported(f"it answered {exc.status or ''} {exc.code or ''} to {header}".replace("  ", " ")) from None
