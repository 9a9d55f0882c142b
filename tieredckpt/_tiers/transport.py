"""The remote transport: every request to the fsspec filesystem, bounded in time, errors mapped.

Owns these things and nothing else:

- opening the filesystem from a URL and options. For S3 the request timeouts
  are ours unless the caller sets them: connect 5 s, read 30 s, two attempts
  inside botocore and s3fs (our callers retry with backoff themselves, so a
  request never hides a minute of retries from the uploader);
- a deadline on every request: ``request_timeout`` (default 60 s) plus one
  second per MB moved. Async filesystems (s3fs) run the request's coroutine on
  fsspec's loop inside ``asyncio.wait_for``, so the connection is dropped at the
  deadline; synchronous ones run on a daemon thread that is abandoned there;
- the exit path (``abort``): every request in flight is cancelled (async) or
  abandoned (a thread), and every later one is bounded by one absolute deadline,
  so a process told to stop never waits on a remote that hangs. No thread a
  request runs on is one the interpreter joins at exit;
- mapping every backend exception, in one place (remoteerrors.py), to RemoteError (``transient``
  says whether a retry may help), RemoteNotFoundError or RemoteAccessError;
- keeping credentials out of every message: URLs without ``user:pass@``, and
  option values that look like secrets replaced by ``***``; and keeping aiohttp's
  orphaned body writers' tracebacks off the user's terminal during an outage
  (quietloop.py);
- sending upload parts to S3 from the caller's buffer (s3body.py) with the crc32c we
  computed anyway as the request's ``x-amz-checksum-crc32c``: S3 checks the bytes it
  stores against the checksum of the bytes we read, and botocore computes no CRC32 of
  its own. Over HTTPS botocore then leaves the payload unsigned, as it does whenever
  TLS and a checksum header cover the body; over plain HTTP it still signs it.

- conditional writes, where the backend has them (``conditional``): S3's
  ``If-None-Match: *`` and ``If-Match: <etag>`` on PUT; on a local or mounted disk
  an O_EXCL link and a flock'd compare-and-replace (diskcas.py). ``put_if_absent`` and
  ``put_if_match`` answer None when the condition failed; ``read_versioned`` gives
  an object's version and its age by the remote's own clock, never ours.

Paths handed to the methods are relative to the remote's root.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem

from ..errors import RemoteAccessError, RemoteError, RemoteNotFoundError, TieredCkptError
from . import diskcas
from .credentials import redact_url, scrub, secret_values, url_secrets
from .quietloop import quiet_orphaned_body_writers
from .remoteerrors import condition_conflict, condition_failed, is_transient, map_error
from .s3body import PartBody

REQUEST_TIMEOUT = 60.0  # seconds per request, plus one second per MB it moves
_BYTES_PER_SECOND = 1_000_000
_S3_DEFAULTS = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 2, "mode": "standard"}}
_STREAM_CHUNK = 1 << 20  # what get_stream hands its sink at a time
_CONFLICT_PAUSES = (0.05, 0.1, 0.2, 0.4, 0.8)  # seconds between the sends of a write that met a 409
_MAX_PUT = 5 << 30  # S3's limit for one PUT; s3fs sends larger bodies as a multipart upload
log = logging.getLogger("tieredckpt.transport")


class Transport:
    def __init__(self, url: str, options: dict | None = None, *, fs: fsspec.AbstractFileSystem | None = None,
                 request_timeout: float = REQUEST_TIMEOUT) -> None:
        self.options = dict(options or {})
        self.display_url = redact_url(url)
        self._secrets = secret_values(self.options) + secret_values(dict(os.environ), env=True) + url_secrets(url)
        self.protocol = fsspec.core.split_protocol(url)[0] or "file"
        if fs is None:
            fs, root = self._open(url)
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        self.root = root.rstrip("/")
        self.request_timeout = request_timeout
        self._async = isinstance(fs, AsyncFileSystem) and not getattr(fs, "asynchronous", False)
        if self._async:
            quiet_orphaned_body_writers(fs.loop)
        self._s3 = _is_s3(self.protocol) and hasattr(fs, "split_path")
        self._checksums = self._s3 and _sends_checksums(self.options)
        # set when the server was found to ignore or refuse If-None-Match/If-Match (condprobe.py)
        # and the writer chose to go on: its conditional writes then read, compare and write
        self.conditions_ignored = False
        self._inflight: set[Future] = set()  # requests waited on now (abort cancels them)
        self._inflight_lock = threading.Lock()
        self._deadline: float | None = None  # monotonic; set by abort(): no request outlives it

    def _open(self, url: str):
        options = dict(self.options)
        if self.protocol in ("file", "local"):
            options.setdefault("auto_mkdir", True)  # object stores need no directories; disks do
        if _is_s3(self.protocol):
            config = dict(options.get("config_kwargs") or {})
            for key, value in _S3_DEFAULTS.items():
                config.setdefault(key, value)
            if _sends_checksums(options) and _https(options):
                # Our crc32c header and TLS cover the body: what botocore itself requires before
                # it skips signing the payload (it cannot see a header we set ourselves).
                config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
            options["config_kwargs"] = config
            options.setdefault("skip_instance_cache", True)  # we tune this instance; never share it
        try:
            fs, root = fsspec.core.url_to_fs(url, **options)
        except (ImportError, ValueError, TypeError) as exc:
            raise TieredCkptError(self.scrub(f"{self.display_url}: cannot open this remote ({exc})")) from None
        if _is_s3(self.protocol) and "retries" not in self.options:
            fs.retries = 2  # s3fs's own retry loop; ours is the uploader's
        return fs, root

    # ---- names ------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *[p for p in parts if p]])

    def where(self, *parts: str) -> str:
        """An object's name for messages: the URL without credentials."""
        return "/".join([self.display_url.rstrip("/"), *[p for p in parts if p]])

    def scrub(self, text: str) -> str:
        return scrub(text, self._secrets)

    # ---- requests -----------------------------------------------------------------------

    def put(self, rel: str, data, crc32c: str | None = None) -> None:
        """Write one object. ``data``: bytes or any buffer that stays unchanged until this returns;
        ``crc32c`` (hex, of ``data``) goes along for the server to check where it can."""
        kwargs: dict = {}
        if self._s3 and len(data) < _MAX_PUT:
            kwargs["chunksize"] = max(50 << 20, len(data))  # one PUT: s3fs splits from 2x chunksize
            if crc32c is not None and self._checksums:
                kwargs.update(ChecksumAlgorithm="CRC32C", ChecksumCRC32C=_b64_crc(crc32c))
            data = PartBody(data)
        elif not isinstance(data, bytes) and self.protocol not in ("file", "local"):
            data = bytes(data)  # other backends may keep what they are given
        self._call("pipe_file", (self.path(rel), data), f"write {rel}", kwargs=kwargs, nbytes=len(data))

    def get(self, rel: str, max_size: int) -> bytes:
        """A whole object of at most ``max_size`` bytes; a larger one is refused unread (one ranged request)."""
        if self.protocol in ("file", "local"):  # not through fsspec: a planted FIFO or symlink is refused
            return self._disk_call(lambda: diskcas.read_regular(self.path(rel), max_size, self.where(rel))[0],
                                   f"read {rel}", max_size)
        data = self._call("cat_file", (self.path(rel),), f"read {rel}", kwargs={"start": 0, "end": max_size + 1},
                          nbytes=max_size)
        if len(data) > max_size:
            raise RemoteError(f"{self.where(rel)}: larger than the {max_size} bytes allowed for it "
                              "(not written by tieredckpt?)", transient=False)
        return data

    def get_stream(self, rel: str, max_size: int, open_sink: Callable[[], Callable[[Any], None]]) -> int:
        """Like :meth:`get`, but the object is handed to a sink in chunks of about 1 MiB as it arrives,
        never held whole (on S3; other backends read it whole first). Returns its size.

        ``open_sink()`` gives the chunk consumer of one attempt: when the body breaks part way (a
        transient error), the request is made again, up to s3fs's retry count, with a new sink,
        which starts over. The deadline is one, for all attempts, as for any request."""
        if not (self._s3 and self._async):
            data = memoryview(self.get(rel, max_size))
            write = open_sink()
            for start in range(0, len(data), _STREAM_CHUNK):
                write(data[start:start + _STREAM_CHUNK])
            return len(data)
        timeout = self.request_timeout + max_size / _BYTES_PER_SECOND
        try:
            return self._run(lambda: self._stream(rel, max_size, open_sink), timeout, f"read {rel}")
        except TieredCkptError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, as in _call
            raise self.map_error(exc, f"read {rel}", timeout) from None

    async def _stream(self, rel: str, max_size: int, open_sink) -> int:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        attempts, attempt = max(1, getattr(self.fs, "retries", 1)), 1
        while True:
            try:
                return await self._stream_once(bucket, key, rel, max_size, open_sink())
            except TieredCkptError:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken body is retried, anything else raised
                if attempt >= attempts or not is_transient(exc):
                    raise
                attempt += 1

    async def _stream_once(self, bucket: str, key: str, rel: str, max_size: int, write) -> int:
        response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{max_size}",
                                          **self.fs.req_kw)
        body, size = response["Body"], 0
        try:
            while chunk := await body.read(_STREAM_CHUNK):
                size += len(chunk)
                if size > max_size:
                    raise RemoteError(f"{self.where(rel)}: larger than the {max_size} bytes allowed for it "
                                      "(not written by tieredckpt?)", transient=False)
                write(chunk)
        finally:
            body.close()
        return size

    # ---- conditional writes ---------------------------------------------------------------

    @property
    def conditional(self) -> bool:
        """True when a write's condition is enforced by the backend itself (S3 and S3-compatible
        servers that honour If-None-Match/If-Match; a local or mounted disk): a compare-and-swap
        that no timing can break. Elsewhere the same calls read, compare and write."""
        return self.server_conditions or self.protocol in ("file", "local")

    @property
    def server_conditions(self) -> bool:
        """True when the conditions are sent to the server as headers (S3) and not known to be
        ignored there: what condprobe.py checks before a writer relies on them."""
        return self._s3 and not self.conditions_ignored

    def read_versioned(self, rel: str, max_size: int) -> tuple[bytes, str, float | None] | None:
        """(bytes, version, age) of an object, or None when it does not exist. ``version`` is what
        ``put_if_match`` compares (S3: the ETag; a disk: the sha256 of the bytes); ``age`` is how
        long ago it was written by the remote's own clock (S3: the response's Date minus the
        object's Last-Modified; a disk: the mtime of a probe file written now minus the object's),
        or None where the backend cannot tell. Never another host's clock against ours."""
        what = f"read {rel}"
        timeout = self.request_timeout + max_size / _BYTES_PER_SECOND
        try:
            if self._s3 and self._async:
                return self._run(lambda: self._s3_read_versioned(rel, max_size), timeout, what)
            if self.protocol in ("file", "local"):
                return self._run(lambda: diskcas.read_versioned(self.path(rel), max_size, self.where(rel)), timeout, what)
        except RemoteNotFoundError:
            return None
        except TieredCkptError:
            raise
        except FileNotFoundError:
            return None
        except Exception as exc:  # noqa: BLE001 - mapped, as in _call
            raise self.map_error(exc, what, timeout) from None
        data = self.get_optional(rel, max_size)
        return None if data is None else (data, diskcas.digest(data), None)

    def put_if_absent(self, rel: str, data: bytes) -> str | None:
        """Create ``rel`` only if nothing is there: its version, or None when something was."""
        if self.server_conditions:
            return self._s3_put(rel, data, {"IfNoneMatch": "*"})
        if self.protocol in ("file", "local"):
            return self._disk(rel, data, None, f"create {rel}")
        if self.exists(rel):
            return None
        return self._put_versioned(rel, data)

    def put_if_match(self, rel: str, data: bytes, version: str) -> str | None:
        """Replace ``rel`` only if it is still at ``version``: the new version, or None when it
        changed or is gone."""
        if self.server_conditions:
            return self._s3_put(rel, data, {"IfMatch": version})
        if self.protocol in ("file", "local"):
            return self._disk(rel, data, version, f"replace {rel}")
        current = self.read_versioned(rel, max(len(data), 1 << 20) * 4)
        if current is None or current[1] != version:
            return None
        return self._put_versioned(rel, data)

    def _put_versioned(self, rel: str, data: bytes) -> str:
        """An unconditional write, answering the version read_versioned will report for it."""
        if self._s3:
            return self._s3_put(rel, data, {}) or diskcas.digest(data)  # the ETag
        self.put(rel, data)
        return diskcas.digest(data)

    def delete_if_match(self, rel: str, version: str) -> bool:
        """Delete ``rel`` only if it is still at ``version`` (a disk: under its lock; S3 has no
        conditional delete everywhere: read, compare, delete)."""
        if self.protocol in ("file", "local"):
            return self._disk(rel, None, version, f"delete {rel}") is not None
        current = self.read_versioned(rel, 1 << 20)
        if current is None or current[1] != version:
            return False
        self.rm(rel)
        return True

    def _s3_put(self, rel: str, data: bytes, condition: dict) -> str | None:
        """One PUT, conditional or not: its ETag, or None when its condition did not hold.

        A 409 ConditionalRequestConflict (another conditional write on the key was in flight)
        decided nothing: the same write is sent again after a short pause, and its condition
        then holds or fails on its own (a create-only write the other one won answers 412)."""
        bucket, key, _ = self.fs.split_path(self.path(rel))
        for pause in (*_CONFLICT_PAUSES, None):
            try:
                out = self._call("call_s3", ("put_object",), f"write {rel}",
                                 kwargs={"Bucket": bucket, "Key": key, "Body": data, **condition}, nbytes=len(data))
                break
            except RemoteNotFoundError:
                if "IfMatch" in condition:
                    return None  # gone: the condition failed
                raise
            except RemoteError as exc:
                if condition and condition_conflict(exc) and pause is not None:
                    time.sleep(pause)
                    continue
                if condition_failed(exc):
                    return None
                raise  # a conflict that outlasted the pauses is transient: the caller's retry takes it
        self.fs.invalidate_cache(self.path(rel))
        return out.get("ETag") or diskcas.digest(data)

    async def _s3_read_versioned(self, rel: str, max_size: int) -> tuple[bytes, str, float | None]:
        bucket, key, _ = self.fs.split_path(self.path(rel))
        response = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes=0-{max_size}")
        body = response["Body"]
        try:
            data = await body.read()
        finally:
            body.close()
        if len(data) > max_size:
            raise RemoteError(f"{self.where(rel)}: larger than the {max_size} bytes allowed for it", transient=False)
        return data, response.get("ETag", ""), _server_age(response)

    def _disk_call(self, fn: Callable[[], Any], what: str, nbytes: int = 0) -> Any:
        """A disk backend's own request (not fsspec's), bounded and mapped as _call's are."""
        timeout = self.request_timeout + nbytes / _BYTES_PER_SECOND
        try:
            return self._run(fn, timeout, what)
        except TieredCkptError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, as in _call
            raise self.map_error(exc, what, timeout) from None

    def _disk(self, rel: str, data: bytes | None, version: str | None, what: str) -> str | None:
        """Conditional writes on a disk: create by O_EXCL link, replace or delete under a flock."""
        timeout = self.request_timeout + len(data or b"") / _BYTES_PER_SECOND
        try:
            return self._run(lambda: diskcas.conditional_write(self.path(rel), data, version), timeout, what)
        except TieredCkptError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped, as in _call
            raise self.map_error(exc, what, timeout) from None

    def get_optional(self, rel: str, max_size: int) -> bytes | None:
        """Like :meth:`get`, but None when the object does not exist."""
        try:
            return self.get(rel, max_size)
        except RemoteNotFoundError:
            return None

    def exists(self, rel: str) -> bool:
        return self._info(rel) is not None

    def size(self, rel: str) -> int | None:
        """The stored size of one object (one HEAD on S3), None when it does not exist."""
        info = self._info(rel)
        return None if info is None or info.get("type", "file") == "directory" else int(info.get("size") or 0)

    def _info(self, rel: str) -> dict | None:
        try:
            return self._call("info", (self.path(rel),), f"look up {rel}", fresh=rel)
        except RemoteNotFoundError:
            return None

    def list_dirs(self, rel: str = "") -> list[str]:
        """Names of the entries directly under ``rel`` (one delimiter listing, paged by the backend)."""
        try:
            entries = self._call("ls", (self.path(rel),), f"list {rel or '/'}", kwargs={"detail": False},
                                 fresh=rel or "/")
        except RemoteNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def list_files(self, rel: str) -> dict[str, int]:
        """Every object below ``rel`` (recursively) as {path relative to ``rel``: size}."""
        return {name: size for name, (size, _) in self.list_times(rel).items()}

    def list_times(self, rel: str) -> dict[str, tuple[int, float | None]]:
        """Every object below ``rel`` as {relative path: (size, modification time or None)}."""
        base = self.fs._strip_protocol(self.path(rel)).rstrip("/") + "/"
        try:
            found = self._call("find", (self.path(rel),), f"list {rel}", kwargs={"detail": True}, fresh=rel)
        except RemoteNotFoundError:
            return {}
        out = {}
        for path, info in found.items():
            path = path.rstrip("/")
            if path.startswith(base) and info.get("type", "file") != "directory":
                out[path[len(base):]] = (int(info.get("size") or 0), _mtime(info))
        return out

    def same_store(self, other: Transport) -> bool:
        """Whether ``other`` reaches the same storage as we do (one S3 endpoint and account, or one
        machine's disk), so that an object of its can be copied to us without passing through here."""
        if self.protocol != other.protocol:
            return False
        keys = ("endpoint_url", "client_kwargs", "key", "profile")
        return all(self.options.get(k) == other.options.get(k) for k in keys)

    def copy_from(self, source: Transport, src_rel: str, rel: str, nbytes: int) -> None:
        """Copy ``src_rel`` of ``source`` (``same_store``) to ``rel`` on the storage's side: S3
        copies the object itself (CopyObject, in parts above 5 GB), a disk copies the file; no
        byte of it is sent from this process."""
        self._call("copy", (source.path(src_rel), self.path(rel)), f"copy {source.where(src_rel)} to {rel}",
                   nbytes=nbytes)

    def rm(self, rel: str) -> None:
        """Delete one object; a missing one is fine."""
        try:
            self._call("rm_file", (self.path(rel),), f"delete {rel}")
        except RemoteNotFoundError:
            pass

    def rm_tree(self, rel: str) -> None:
        """Delete everything below ``rel``; nothing there is fine."""
        try:
            self._call("rm", (self.path(rel),), f"delete {rel}", kwargs={"recursive": True})
        except RemoteNotFoundError:
            pass

    def probe(self, create: bool) -> None:
        """One cheap request that tells a missing bucket or refused credentials from an empty remote.

        Raises RemoteNotFoundError / RemoteAccessError (permanent) or a transient RemoteError.
        ``create``: a writer may create the root directory of a disk-backed remote.
        """
        if _is_s3(self.protocol):
            bucket, key, _ = self.fs.split_path(self.root)
            try:
                self._call("call_s3", ("list_objects_v2",), f"list bucket {bucket}",
                           kwargs={"Bucket": bucket, "Prefix": key.rstrip("/") + "/" if key else "", "MaxKeys": 1})
            except RemoteNotFoundError:
                raise RemoteNotFoundError(f"{self.display_url}: the bucket {bucket!r} does not exist "
                                          "(or the endpoint is not the one that holds it)") from None
            except RemoteAccessError as exc:
                raise RemoteAccessError(f"{self.display_url}: access to bucket {bucket!r} was refused "
                                        f"(credentials or permissions): {exc}") from None
            return
        if self.protocol in ("file", "local") and create:
            self._call("makedirs", (self.root,), "create the remote directory", kwargs={"exist_ok": True})
            return
        if not self._call("exists", (self.root,), "look up the remote root", fresh="/"):
            if self.protocol in ("file", "local", "memory") and not create:
                raise RemoteNotFoundError(f"{self.display_url}: no such remote directory")
            top = self.root.lstrip("/").split("/", 1)[0]
            if top and top != self.root.lstrip("/") and not self._call("exists", (top,), f"look up {top}"):
                raise RemoteNotFoundError(f"{self.display_url}: {top!r} does not exist")

    # ---- the one place backend calls happen ---------------------------------------------

    def _call(self, method: str, args: tuple, what: str, *, kwargs: dict | None = None, nbytes: int = 0,
              fresh: str | None = None) -> Any:
        """``fs.method(*args, **kwargs)`` within the deadline; errors mapped to ours.

        ``fresh``: the call lists or looks up, so fsspec's listing cache is dropped first
        (other writers change the remote behind our back)."""
        kwargs = dict(kwargs or {})
        timeout = self.request_timeout + nbytes / _BYTES_PER_SECOND
        if fresh is not None:
            self.fs.invalidate_cache()
        if self._async:
            start = lambda: getattr(self.fs, "_" + method)(*args, **kwargs)  # noqa: E731 - a coroutine
        else:
            start = lambda: getattr(self.fs, method)(*args, **kwargs)  # noqa: E731 - a blocking call
        try:
            return self._run(start, timeout, what)
        except TieredCkptError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error is mapped here
            raise self.map_error(exc, what, timeout) from None

    def _run(self, start: Callable[[], Any], timeout: float, what: str) -> Any:
        """Run one request within ``timeout`` (and the exit deadline, once set): ``start()`` makes
        its coroutine (async filesystems, run on fsspec's loop) or makes the call itself (others,
        on a daemon thread). The caller waits on a future that ``abort`` can cancel."""
        if self._deadline is not None:
            timeout = min(timeout, self._deadline - time.monotonic())
            if timeout <= 0:
                raise RemoteError(f"{self.display_url}: {what} not tried: the store is closing", transient=True)
        if self._async:
            future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(start(), timeout), self.fs.loop)
        else:
            future = Future()
            threading.Thread(target=_settle, args=(future, start), daemon=True,
                             name="tieredckpt-remote").start()
        with self._inflight_lock:
            self._inflight.add(future)
        try:
            return future.result(timeout + 1.0)  # wait_for ends an async request at ``timeout`` itself
        except FutureTimeout:
            future.cancel()  # a blocking call still running is abandoned to finish on its own
            raise TimeoutError(f"no answer within {timeout:.0f} s") from None
        except CancelledError:
            raise RemoteError(f"{self.display_url}: {what} abandoned: the store is closing",
                              transient=True) from None
        finally:
            with self._inflight_lock:
                self._inflight.discard(future)

    def abort(self, seconds: float) -> None:
        """The exit path: cancel every request in flight now, and give every later one (a lease
        release, say) at most what is left of ``seconds`` from now. Never waits."""
        self._deadline = time.monotonic() + max(0.0, seconds)
        with self._inflight_lock:
            futures = list(self._inflight)
        for future in futures:
            future.cancel()

    def map_error(self, exc: BaseException, what: str, timeout: float | None = None) -> RemoteError:
        return map_error(exc, what, self.display_url, self.scrub, timeout)

    def close(self) -> None:
        """Nothing to let go of: requests run on fsspec's loop or on daemon threads."""


def _server_age(response: dict) -> float | None:
    """Seconds since an S3 object was written, by the server's clock alone (Date - Last-Modified)."""
    from email.utils import parsedate_to_datetime
    date = (response.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("date")
    stamp = getattr(response.get("LastModified"), "timestamp", None)
    if not date or stamp is None:
        return None
    try:
        return max(0.0, parsedate_to_datetime(date).timestamp() - stamp())
    except (TypeError, ValueError):
        return None


def _settle(future: Future, call: Callable[[], Any]) -> None:
    """A blocking request on its own daemon thread: its outcome goes to ``future`` unless the
    caller already gave up on it (cancelled at the deadline or by abort)."""
    try:
        result = call()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
        try:
            future.set_exception(exc)
        except InvalidStateError:
            pass
        return
    try:
        future.set_result(result)
    except InvalidStateError:
        pass


def _is_s3(protocol: str) -> bool:
    return protocol in ("s3", "s3a")


def _sends_checksums(options: dict) -> bool:
    """False when the user asked botocore for checksums only where an API requires them
    (S3-compatible servers that refuse checksum headers): then we send none either."""
    config = options.get("config_kwargs") or {}
    asked = config.get("request_checksum_calculation") or os.environ.get("AWS_REQUEST_CHECKSUM_CALCULATION", "")
    return str(asked).lower() != "when_required"


def _https(options: dict) -> bool:
    """Whether requests go over TLS: AWS's own endpoints do; a configured endpoint says."""
    client = options.get("client_kwargs") or {}
    if options.get("use_ssl") is False or client.get("use_ssl") is False:
        return False
    endpoint = (options.get("endpoint_url") or client.get("endpoint_url")
                or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "https://")
    return str(endpoint).lower().startswith("https://")


def _b64_crc(crc_hex: str) -> str:
    """S3's spelling of a crc32c: the four big-endian bytes, base64."""
    return base64.b64encode(int(crc_hex, 16).to_bytes(4, "big")).decode()


def _mtime(info: dict) -> float | None:
    """An object's modification time in Unix seconds, from whichever key the backend uses."""
    for key in ("LastModified", "mtime", "last_modified", "updated", "created"):
        value = info.get(key)
        stamp = getattr(value, "timestamp", None)
        if stamp is not None:
            return stamp()
        if isinstance(value, (int, float)):
            return float(value)
    return None
