"""A fault-injecting HTTP proxy on 127.0.0.1, between s3fs and a real S3 server (moto).

    proxy = FaultProxy(moto.endpoint).start()
    options = {**moto.options(), "endpoint_url": proxy.endpoint}
    proxy.set("503", rate=0.3)            # 30% of requests answered 503 SlowDown
    proxy.set("reset", seconds=60)        # every request for 60 s: connection reset
    proxy.set("drop")                     # requests hang, unanswered, until faults are cleared
    proxy.set("dead")                     # connections are refused outright (accept + RST)
    proxy.clear()

Modes: "503" (SlowDown), "500" (InternalError), "403" (AccessDenied), "404bucket"
(NoSuchBucket), "reset" (RST instead of an answer), "drop" (the request is read,
never answered; the connection stays open until the fault ends), "dead" (every
new connection is reset at once), "truncate" (the real answer, cut off half way
through its body, then RST), "flip" (the real answer with one byte of its body
flipped), "strip-conditions" (If-None-Match and If-Match are taken off every request
before it is forwarded: a server that ignores conditional writes, as many S3-compatible
ones do), "501-conditions" (a request carrying either header is answered 501
NotImplemented: a server that refuses them), "409-conditions" (a request carrying either
header is answered 409 ConditionalRequestConflict, as AWS answers a conditional write racing
another on the same key). ``methods`` limits a fault to some HTTP methods, ``path`` to request paths
containing a substring, ``times`` to the next N requests that match.

Requests that pass are forwarded over a keep-alive connection to the upstream and
its answer relayed. Every request is counted (``counts``, by method; ``body_bytes``, the
bytes of their bodies) so tests can check how many requests and bytes an operation costs.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
import time
from collections import Counter

_ERRORS = {
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "500": (500, "Internal Server Error", "InternalError", "We encountered an internal error."),
    "403": (403, "Forbidden", "AccessDenied", "Access Denied"),
    "404bucket": (404, "Not Found", "NoSuchBucket", "The specified bucket does not exist"),
    "501-conditions": (501, "Not Implemented", "NotImplemented",
                       "A header you provided implies functionality that is not implemented"),
    "409-conditions": (409, "Conflict", "ConditionalRequestConflict",
                       "A conflicting conditional operation is currently in progress against this resource."),
}
_CONDITIONS = {"if-none-match", "if-match"}
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "expect", "te", "upgrade"}


class FaultProxy:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.split("//", 1)[1].split(":")
        self.upstream = (host, int(port))
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._lock = threading.Lock()
        self._fault: dict | None = None
        self._cleared = threading.Event()
        self.counts: Counter = Counter()
        self.body_bytes = 0  # request bodies passed to the proxy: what a client sent over the wire
        self.injected: Counter = Counter()
        self.log: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.targets: list[str] = []  # "METHOD target" of every request, query string included
        self._stop = False

    def start(self) -> FaultProxy:
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def set(self, mode: str, rate: float = 1.0, seconds: float | None = None, methods=None, path: str | None = None,
            times: int | None = None):
        with self._lock:
            self._fault = {"mode": mode, "rate": rate, "until": None if seconds is None else time.monotonic() + seconds,
                           "methods": set(methods) if methods else None, "path": path, "times": times}
            self._cleared.clear()

    def clear(self) -> None:
        with self._lock:
            self._fault = None
            self._cleared.set()

    def reset_counts(self) -> None:
        with self._lock:
            self.counts.clear()
            self.log.clear()
            self.targets.clear()

    def requests(self, method: str | None = None, contains: str = "") -> list[str]:
        with self._lock:
            return [p for m, p in self.log if (method is None or m == method) and contains in p]

    def calls(self) -> list[str]:
        """Every request counted, as "METHOD target" with its query string."""
        with self._lock:
            return list(self.targets)

    def total(self) -> int:
        with self._lock:
            return sum(self.counts.values())

    def close(self) -> None:
        self._stop = True
        self.clear()
        self._sock.close()

    # ---- internals ----------------------------------------------------------------------

    def _active(self, method: str | None, path: str | None) -> str | None:
        with self._lock:
            fault = self._fault
            if fault is None:
                return None
            if fault["until"] is not None and time.monotonic() > fault["until"]:
                self._fault = None
                self._cleared.set()
                return None
            if method is not None and fault["methods"] and method not in fault["methods"]:
                return None
            if path is not None and fault["path"] and fault["path"] not in path:
                return None
            if fault["times"] is not None:  # counted per request (not per connection: no "dead")
                if method is None:
                    return None
                fault["times"] -= 1
                if fault["times"] <= 0:
                    self._fault = None
                    self._cleared.set()
                return fault["mode"]
            return fault["mode"] if random.random() < fault["rate"] else None

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            if self._active(None, None) == "dead":
                _reset(conn)
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        upstream = None
        reader = conn.makefile("rb")
        try:
            while True:
                request = _read_request(reader, conn)
                if request is None:
                    return
                method, target, headers, body = request
                with self._lock:
                    self.counts[method] += 1
                    self.body_bytes += len(body)
                    self.log.append((method, target.split("?")[0]))
                    self.targets.append(f"{method} {target}")
                mode = self._active(method, target)
                if mode is not None:
                    with self._lock:
                        self.injected[mode] += 1
                if mode in ("reset", "dead"):
                    _reset(conn)
                    return
                if mode == "drop":
                    while not self._cleared.wait(0.2):
                        if self._active(method, target) != "drop":
                            break
                    conn.close()
                    return
                conditional = any(k.lower() in _CONDITIONS for k, _ in headers)
                if mode == "strip-conditions":
                    headers = [(k, v) for k, v in headers if k.lower() not in _CONDITIONS]
                elif mode in ("501-conditions", "409-conditions") and not conditional:
                    mode = None
                if mode in _ERRORS:
                    conn.sendall(_error_response(mode, method))
                    conn.close()
                    return
                if upstream is None:
                    upstream = http.client.HTTPConnection(*self.upstream, timeout=120)
                upstream.request(method, target, body=body,
                                 headers={k: v for k, v in headers if k.lower() not in _HOP})
                response = upstream.getresponse()
                data = response.read()
                if mode == "flip" and data:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0xFF
                lines = [f"HTTP/1.1 {response.status} {response.reason}"]
                for key, value in response.getheaders():
                    if key.lower() not in _HOP and key.lower() != "content-length":
                        lines.append(f"{key}: {value}")
                length = response.getheader("content-length") if method == "HEAD" else str(len(data))
                lines.append(f"Content-Length: {length or 0}")
                head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
                if mode == "truncate":
                    conn.sendall(head + bytes(data[:len(data) // 2]))
                    _reset(conn)
                    return
                conn.sendall(head + (b"" if method == "HEAD" else bytes(data)))
        except (OSError, http.client.HTTPException):
            return
        finally:
            try:
                conn.close()
            except OSError:
                pass
            if upstream is not None:
                upstream.close()


def _read_request(reader, conn):
    line = reader.readline()
    if not line:
        return None
    method, target, _ = line.decode("latin-1").split(" ", 2)
    headers = []
    while True:
        h = reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        key, _, value = h.decode("latin-1").partition(":")
        headers.append((key.strip(), value.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in lower.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size = int(reader.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while reader.readline() not in (b"\r\n", b"\n", b""):
                    pass
                break
            body += reader.read(size)
            reader.readline()
        body = bytes(body)
    else:
        body = reader.read(int(lower.get("content-length", "0") or 0))
    return method, target, headers, body


def _error_response(mode: str, method: str) -> bytes:
    status, reason, code, message = _ERRORS[mode]
    body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
            f"<RequestId>fault</RequestId></Error>").encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    return head + (b"" if method == "HEAD" else body)


def _reset(conn: socket.socket) -> None:
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    except OSError:
        pass
