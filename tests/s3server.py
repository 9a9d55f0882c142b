"""A real S3 endpoint for the tests: moto's server as a subprocess on 127.0.0.1."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
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
