"""The error map: every backend exception becomes one of ours, in one place. RemoteError
(``transient`` says whether a retry may help), RemoteNotFoundError, RemoteAccessError; and a
failed write condition is told apart from every other failure.

What the backend said decides, not the wording of a message: the S3 error code and HTTP
status of the botocore ClientError that s3fs keeps as the ``__cause__`` of what it raises,
botocore's own exception classes (no credentials, endpoint unreachable), then Python's
(OSError subclasses, timeouts). The message text is looked at only for backends that give
nothing else (other fsspec filesystems), and only for the few words they all use.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

from ..errors import RemoteAccessError, RemoteError, RemoteNotFoundError, TieredCkptError

# S3 error codes (AWS's list, and what S3-compatible servers answer) by what a caller can do
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "NotFound", "404"}
_DENIED_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken",
                 "TokenRefreshRequired", "Forbidden", "403", "AllAccessDisabled", "AccountProblem",
                 "InvalidSecurity", "RequestTimeTooSkewed", "AuthorizationHeaderMalformed"}
_CONDITION_CODES = {"PreconditionFailed", "412"}
# 409: another conditional write on the key was in flight; nothing was decided, so it is retried
_CONFLICT_CODES = {"ConditionalRequestConflict", "409"}
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestThrottled", "RequestTimeout",
                    "ServiceUnavailable", "InternalError", "OperationAborted", "ConditionalRequestConflict",
                    "BadDigest", "XAmzContentSHA256Mismatch", "IncompleteBody"}
_NOT_IMPLEMENTED_CODES = {"NotImplemented", "501"}
_NO_CREDENTIALS = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError")
_UNREACHABLE = ("EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                "ProxyConnectionError", "ResponseStreamingError", "IncompleteReadError")

# for backends that give only text
_NOT_FOUND = re.compile(r"\bNoSuchBucket\b")
_DENIED = re.compile(r"\b(AccessDenied|InvalidAccessKeyId|SignatureDoesNotMatch|ExpiredToken|"
                     r"InvalidToken|TokenRefreshRequired|Forbidden)\b")
CONDITION_FAILED = re.compile(r"pre-?condition|PreconditionFailed|FileExistsError|\b412\b", re.IGNORECASE)
_TRANSIENT_TEXT = re.compile(r"\b(5\d\d|SlowDown|Throttl|RequestTimeout|ServiceUnavailable|InternalError|"
                             r"Connect|Timeout|reset|Broken pipe|EOF|temporar|Disconnected|Payload)", re.IGNORECASE)


def backend_answer(exc: BaseException) -> tuple[str | None, int | None]:
    """(S3 error code, HTTP status) of the server's answer behind ``exc``, or (None, None)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        response = getattr(cur, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            code = error.get("Code")
            return (str(code) if code else None), (int(status) if isinstance(status, int) else None)
        cur = cur.__cause__  # s3fs keeps the ClientError there; a __context__ is another story
    return None, None


def _botocore_kind(exc: BaseException) -> str | None:
    """The name of a botocore exception class anywhere in ``exc``'s chain that decides its kind."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        for klass in type(cur).__mro__:
            if klass.__name__ in _NO_CREDENTIALS or klass.__name__ in _UNREACHABLE:
                return klass.__name__
        cur = cur.__cause__ or cur.__context__  # botocore raises these inside its own handlers
    return None


def condition_failed(err: RemoteError) -> bool:
    """True when a conditional write was refused because its condition did not hold."""
    if err.code is not None or err.status is not None:
        return err.code in _CONDITION_CODES or err.status == 412
    return bool(CONDITION_FAILED.search(str(err)))


def condition_conflict(err: RemoteError) -> bool:
    """True when a conditional write met another in flight on its key (409): it decided nothing."""
    return err.code in _CONFLICT_CODES or (err.code is None and err.status == 409)


def map_error(exc: BaseException, what: str, where: str, scrub: Callable[[str], str],
              timeout: float | None = None) -> RemoteError:
    """``exc`` from ``what`` on the remote ``where`` as one of ours, its message scrubbed of secrets."""
    if isinstance(exc, TimeoutError) and timeout is not None and not str(exc):
        exc = TimeoutError(f"no answer within {timeout:.0f} s")
    message = scrub(f"{where}: {what} failed: {type(exc).__name__}: {exc}")
    code, status = backend_answer(exc)
    kind = _botocore_kind(exc)
    if kind in _NO_CREDENTIALS:
        return _tag(RemoteAccessError(scrub(
            f"{where}: {what} failed: no credentials for it ({type(exc).__name__}). Give them as remote_options "
            "(key=..., secret=...), AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an instance role")),
            code, status)
    if code is not None or status is not None:
        return _tag(_by_answer(message, code, status), code, status)
    if isinstance(exc, FileNotFoundError) or _NOT_FOUND.search(str(exc)):
        return RemoteNotFoundError(message)
    if isinstance(exc, PermissionError) or _DENIED.search(str(exc)):
        return RemoteAccessError(message)
    return RemoteError(message, transient=kind in _UNREACHABLE or is_transient(exc))


def _by_answer(message: str, code: str | None, status: int | None) -> RemoteError:
    if code in _NOT_IMPLEMENTED_CODES or status == 501:
        return RemoteError(f"{message} (the server does not implement this request)", transient=False)
    if code in _TRANSIENT_CODES or (status is not None and (status >= 500 or status in (408, 429))):
        return RemoteError(message, transient=True)
    if code in _NOT_FOUND_CODES or status == 404:
        return RemoteNotFoundError(message)
    if code in _DENIED_CODES or status in (401, 403):
        return RemoteAccessError(message)
    return RemoteError(message, transient=False)


def _tag(err: RemoteError, code: str | None, status: int | None) -> RemoteError:
    err.code, err.status = code, status
    return err


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may fix: connection trouble, timeouts, 5xx but 501, throttling."""
    code, status = backend_answer(exc)
    if code is not None or status is not None:
        return _by_answer("", code, status).transient
    if isinstance(exc, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                        ValueError, TypeError, TieredCkptError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    if _TRANSIENT_TEXT.search(f"{type(exc).__name__} {exc}"):
        return True
    return isinstance(exc, OSError)  # other I/O trouble: worth a retry
