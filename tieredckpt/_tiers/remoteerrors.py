"""The error map: every backend exception becomes one of ours, in one place. RemoteError
(``transient`` says whether a retry may help), RemoteNotFoundError, RemoteAccessError; and a
failed write condition is told apart from every other failure."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from ..errors import RemoteAccessError, RemoteError, RemoteNotFoundError, TieredCkptError

_NOT_FOUND = re.compile(r"\bNoSuchBucket\b")
_DENIED = re.compile(r"\b(AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|"
                     r"InvalidToken|TokenRefreshRequired|Forbidden)\b")
CONDITION_FAILED = re.compile(r"pre-?condition|PreconditionFailed|FileExistsError|\b412\b|"
                               r"ConditionalRequestConflict", re.IGNORECASE)


def map_error(exc: BaseException, what: str, where: str, scrub: Callable[[str], str],
              timeout: float | None = None) -> RemoteError:
    """``exc`` from ``what`` on the remote ``where`` as one of ours, its message scrubbed of secrets."""
    if isinstance(exc, TimeoutError) and timeout is not None and not str(exc):
        exc = TimeoutError(f"no answer within {timeout:.0f} s")
    message = scrub(f"{where}: {what} failed: {type(exc).__name__}: {exc}")
    if isinstance(exc, FileNotFoundError) or _NOT_FOUND.search(str(exc)):
        return RemoteNotFoundError(message)
    if isinstance(exc, PermissionError) or _DENIED.search(str(exc)):
        return RemoteAccessError(message)
    return RemoteError(message, transient=is_transient(exc))


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may fix: connection trouble, timeouts, 5xx, throttling."""
    if isinstance(exc, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                        ValueError, TypeError, TieredCkptError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    text = f"{type(exc).__name__} {exc}"
    if re.search(r"\b(5\d\d|SlowDown|Throttl|RequestTimeout|ServiceUnavailable|InternalError|"
                 r"Connect|Timeout|reset|Broken pipe|EOF|temporar|Disconnected|Payload)", text, re.IGNORECASE):
        return True
    return isinstance(exc, OSError)  # other I/O trouble: worth a retry
