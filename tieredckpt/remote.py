"""The remote tier: any fsspec URL (s3://, file://, memory://, ...).

Object stores have no rename, so the commit marker is the upload manifest:

    ROOT/step_000100/rank0.bin.p00000 ...   parts of each shard, 64 MiB raw each,
                                           encoded by the codec (zstd-planes, zstd, raw)
    ROOT/step_000100/upload.json            written LAST: without it the step does not exist
    ROOT/latest                             newest uploaded step, written after upload.json
    ROOT/run/.loss.json ...                 the run directory's side files

Upload order: side files -> every part -> upload.json -> latest. Parts are
encoded on the calling thread while a small pool sends the previous ones, so
compression overlaps the transfer. Each part records the checksum of its stored
bytes and of its raw bytes; the embedded checkpoint manifest carries each
file's whole-file crc32c and sha256.

Download order (into the local tier, same protocol as a save): parts fetched in
parallel into a scratch directory, stored and raw checksums checked, whole
files verified against the manifest, manifest.json written last, renamed.

Every backend error is mapped here to RemoteError naming the object (never a
credential); ``RemoteError.transient`` says whether a retry may help.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import fsspec

from . import layout
from .atomic import atomic_write_bytes, commit_dir, make_scratch_dir
from .checksum import crc32c_update, crc_hex, file_digest, map_file
from .codec import decode, encode
from .credentials import redact_url, scrub, secret_values, url_secrets
from .errors import CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError, TieredCkptError
from .manifest import ShardManifest, check_relative_path
from .memview import byte_view
from .sharded import read_manifest, shard_path, verify_checkpoint_files, write_manifest
from .uploadmanifest import PartEntry, UploadedFile, UploadManifest

UPLOAD_MANIFEST = "upload.json"
RUN_PREFIX = "run"
PART_SIZE = 64 << 20
SIDE_NAMES = (".loss.json", ".samples.json", ".state.json", "provenance.json")


class RemoteError(TieredCkptError, OSError):
    """A remote operation failed. ``transient``: a retry may succeed."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The remote object, prefix or bucket does not exist."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=False)


class RemoteTier:
    def __init__(self, url: str, options: dict | None = None, *, fs: fsspec.AbstractFileSystem | None = None,
                 part_size: int = PART_SIZE, concurrency: int = 4) -> None:
        self.options = dict(options or {})
        self.display_url = redact_url(url)
        self._secrets = secret_values(self.options) + secret_values(dict(os.environ), env=True) + url_secrets(url)
        if fs is None:
            options = dict(self.options)
            if fsspec.core.split_protocol(url)[0] in (None, "file", "local"):
                options.setdefault("auto_mkdir", True)  # object stores need no directories; disks do
            try:
                fs, root = fsspec.core.url_to_fs(url, **options)
            except (ImportError, ValueError, TypeError) as exc:
                raise TieredCkptError(self.scrub(f"{self.display_url}: cannot open this remote ({exc})")) from None
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        self.root = root.rstrip("/")
        self.part_size = part_size
        self.concurrency = concurrency

    # ---- names --------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def step_path(self, step: int) -> str:
        return self.path(layout.step_dir_name(step))

    def where(self, *parts: str) -> str:
        """A remote object's name for messages: the URL without credentials."""
        return "/".join([self.display_url.rstrip("/"), *parts])

    # ---- listing ------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps whose upload manifest exists (the only ones that exist for a reader)."""
        return sorted(s for s, committed in self._step_dirs().items() if committed)

    def uncommitted(self) -> list[int]:
        """Step directories holding data but no upload manifest: a half-finished upload."""
        return sorted(s for s, committed in self._step_dirs().items() if not committed)

    def _step_dirs(self) -> dict[int, bool]:
        def listing():
            self.fs.invalidate_cache()
            try:
                entries = self.fs.find(self.root, withdirs=False, detail=False)
            except FileNotFoundError:
                return []
            return entries
        found: dict[int, bool] = {}
        prefix = self.root + "/"
        for entry in self.call(listing, "list"):
            rel = entry[len(prefix):] if entry.startswith(prefix) else entry
            head, _, rest = rel.partition("/")
            step = layout.parse_step_dir(head)
            if step is not None:
                found[step] = found.get(step, False) or rest == UPLOAD_MANIFEST
        return found

    def upload_manifest(self, step: int) -> UploadManifest:
        path = self.path(layout.step_dir_name(step), UPLOAD_MANIFEST)
        where = self.where(layout.step_dir_name(step), UPLOAD_MANIFEST)
        try:
            text = self.call(lambda: self.fs.cat_file(path), f"read {UPLOAD_MANIFEST}", missing_ok=False)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{where}: no uploaded checkpoint for step {step}") from None
        return UploadManifest.from_json(text, where)

    def latest_pointer(self) -> int | None:
        try:
            text = self.call(lambda: self.fs.cat_file(self.path(layout.LATEST)), "read latest", missing_ok=False)
        except FileNotFoundError:
            return None
        return layout.parse_step_dir(text.decode(errors="replace").strip())

    # ---- upload -------------------------------------------------------------------------

    def upload(self, local_dir: Path, codec: str = "zstd-planes", level: int = 1,
               done: dict | None = None, progress: Callable[[int], None] | None = None) -> UploadManifest:
        """Send a committed local checkpoint; upload.json goes last. ``done`` carries parts
        already sent (by remote path) across retries so a retry resumes instead of restarting."""
        manifest = read_manifest(local_dir)
        files = self.send_files(local_dir, manifest, manifest.shards, codec, level, done, progress)
        return self.commit_upload(manifest, codec, files)

    def send_files(self, local_dir: Path, manifest: ShardManifest, shards, codec: str, level: int = 1,
                   done: dict | None = None, progress=None) -> list[UploadedFile]:
        """Send the parts of ``shards`` (entries of ``manifest``) and confirm they all arrived."""
        step_dir = layout.step_dir_name(manifest.step)
        done = {} if done is None else done
        files = [UploadedFile(shard.path, shard.size,
                              self._upload_file(shard_path(local_dir, shard), shard.path, shard.size, step_dir,
                                                codec, level, done, progress))
                 for shard in shards]
        self._confirm_parts(step_dir, files, done)
        return files

    def commit_upload(self, manifest: ShardManifest, codec: str, files: list[UploadedFile]) -> UploadManifest:
        """Write upload.json -- the commit marker -- once every file of every rank is sent."""
        step_dir = layout.step_dir_name(manifest.step)
        upload = UploadManifest(manifest.step, codec, files, json.loads(manifest.to_json()), time.time())
        data = upload.to_json().encode()
        self.call(lambda: self.fs.pipe_file(self.path(step_dir, UPLOAD_MANIFEST), data),
                  f"write {step_dir}/{UPLOAD_MANIFEST}")
        return upload

    def _confirm_parts(self, step_dir: str, files: list[UploadedFile], done: dict) -> None:
        """Before the commit marker: every part must be on the remote with its stored size.

        A retry skips parts an earlier attempt sent; if the server lost any of them
        meanwhile, writing upload.json would publish a partial checkpoint. Missing
        parts are forgotten (so the next attempt re-sends them) and the attempt fails.
        """
        def listing():
            self.fs.invalidate_cache()
            return self.fs.find(self.path(step_dir), detail=True)
        present = {path.rstrip("/"): info.get("size") for path, info in self.call(listing, f"list {step_dir}").items()}
        missing = []
        for f in files:
            for part in f.parts:
                remote = self.path(step_dir, part.path)
                if present.get(self.fs._strip_protocol(remote)) != part.stored_size:
                    missing.append(part.path)
                    done.pop(remote, None)
        if missing:
            raise RemoteError(f"{self.where(step_dir)}: {len(missing)} uploaded part(s) are missing or short "
                              f"on the remote (first: {missing[0]}); sending them again", transient=True)

    def _upload_file(self, path, name, size, step_dir, codec, level, done, progress) -> list[PartEntry]:
        buf = map_file(path, size)
        parts: list[PartEntry] = []
        in_flight = threading.BoundedSemaphore(self.concurrency + 1)
        errors: list[BaseException] = []

        def send(remote, stored, raw_size):
            try:
                if not errors:
                    self.call(lambda: self.fs.pipe_file(remote, stored), f"write {remote}")
                    if progress:
                        progress(raw_size)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors.append(exc)
            finally:
                in_flight.release()

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="tieredckpt-upload") as pool:
            for i, offset in enumerate(range(0, max(size, 1), self.part_size)):
                rel = f"{name}.p{i:05d}"
                remote = self.path(step_dir, rel)
                raw = buf[offset:offset + self.part_size]
                raw_crc = crc_hex(crc32c_update(byte_view(raw)))
                cached = done.get(remote)
                if cached is not None and cached.raw_crc32c == raw_crc and cached.offset == offset:
                    parts.append(cached)  # sent by an earlier attempt
                    continue
                stored = encode(raw, codec, level)  # overlaps the sends already in flight
                entry = PartEntry(rel, offset, raw.numel(), len(stored), raw_crc,
                                  crc_hex(crc32c_update(stored)))
                parts.append(entry)
                in_flight.acquire()
                if errors:
                    in_flight.release()
                    break
                pool.submit(send, remote, stored, raw.numel()).add_done_callback(
                    lambda f, remote=remote, entry=entry: (not f.exception() and not errors) and done.__setitem__(remote, entry))
        if errors:
            raise errors[0]
        return parts

    def _read_object(self, path: str, size: int) -> bytes:
        """One whole object in one request: s3fs's cat_file costs ~2x the time and CPU of
        a single unbuffered read of the same object (measured against moto)."""
        with self.fs.open(path, "rb", block_size=max(size, 5 << 20), cache_type="none") as f:
            return f.read()

    def write_latest(self, step: int) -> None:
        data = (layout.step_dir_name(step) + "\n").encode()
        self.call(lambda: self.fs.pipe_file(self.path(layout.LATEST), data), "write latest")

    # ---- download -----------------------------------------------------------------------

    def download(self, step: int, dest: Path, verify: str = "crc",
                 progress: Callable[[int], None] | None = None) -> ShardManifest:
        """Fetch a remote checkpoint into ``dest`` (a local step dir) with the local commit protocol."""
        upload = self.upload_manifest(step)
        manifest = upload.shard_manifest
        if dest.exists():
            raise CheckpointExistsError(f"{dest}: a checkpoint is already committed here")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_scratch_dir(dest)
        try:
            self._fetch_files(step, upload, upload.files, tmp, progress)
            verify_checkpoint_files(tmp, manifest, full=verify == "sha256")
            write_manifest(tmp, manifest)  # last, as in a save
            commit_dir(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return manifest

    def download_shard(self, step: int, rank: int, root: Path) -> tuple[Path, ShardManifest]:
        """Fetch one rank's shard into a new scratch dir under ``root``; verified (crc32c)."""
        upload = self.upload_manifest(step)
        manifest = upload.shard_manifest
        if not 0 <= rank < manifest.world_size:
            raise CheckpointNotFoundError(f"{self.where(layout.step_dir_name(step))}: has no rank {rank} "
                                          f"(world_size {manifest.world_size})")
        tmp = make_scratch_dir(root / layout.step_dir_name(step))
        try:
            self._fetch_files(step, upload, [upload.files[rank]], tmp, None)
            entry = manifest.shards[rank]
            got = file_digest(tmp / entry.path, sha256=False)
            if got.crc32c != entry.crc32c:
                raise CorruptCheckpointError(f"{self.where(layout.step_dir_name(step), entry.path)}: "
                                             f"crc32c {got.crc32c} differs from the manifest's {entry.crc32c}")
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp, manifest

    def _fetch_files(self, step: int, upload: UploadManifest, files: list[UploadedFile], tmp: Path, progress) -> None:
        """Fetch every part of ``files`` in parallel into new files under ``tmp``, fsynced."""
        jobs, fds = [], []
        try:
            for f in files:
                fd = os.open(tmp / f.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
                fds.append(fd)
                os.ftruncate(fd, f.size)
                jobs += [(fd, part, upload.codec) for part in f.parts]
            with ThreadPoolExecutor(self.concurrency, thread_name_prefix="tieredckpt-download") as pool:
                for _ in pool.map(lambda job: self._fetch_part(step, *job, progress), jobs):
                    pass
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    def _fetch_part(self, step: int, fd: int, part: PartEntry, codec: str, progress) -> None:
        rel = f"{layout.step_dir_name(step)}/{part.path}"
        stored = self.call(lambda: self._read_object(self.path(rel), part.stored_size), f"read {rel}")
        if len(stored) != part.stored_size or crc_hex(crc32c_update(stored)) != part.stored_crc32c:
            raise CorruptCheckpointError(
                f"{self.where(rel)}: {len(stored)} bytes with crc32c {crc_hex(crc32c_update(stored))}, "
                f"the upload manifest records {part.stored_size} bytes with {part.stored_crc32c} (corrupt remote object)")
        raw = decode(stored, codec, part.raw_size, self.where(rel))
        if crc_hex(crc32c_update(raw)) != part.raw_crc32c:
            raise CorruptCheckpointError(f"{self.where(rel)}: decoded bytes fail their crc32c (corrupt remote object)")
        view = memoryview(raw)
        written = 0
        while written < len(view):
            written += os.pwrite(fd, view[written:], part.offset + written)
        if progress:
            progress(part.raw_size)

    # ---- deletion and retention ---------------------------------------------------------

    def delete(self, step: int) -> None:
        """Remove a remote step: its upload manifest first (it stops existing), then its data."""
        step_dir = layout.step_dir_name(step)
        marker = self.path(step_dir, UPLOAD_MANIFEST)
        self.call(lambda: self.fs.rm_file(marker) if self.fs.exists(marker) else None, f"delete {step_dir}/{UPLOAD_MANIFEST}")
        self.call(lambda: self.fs.rm(self.path(step_dir), recursive=True), f"delete {step_dir}", missing_ok=True)

    # ---- side files ---------------------------------------------------------------------

    def put_side_files(self, run_dir: Path) -> int:
        """Upload the run directory's side files and archives; returns how many."""
        count = 0
        for rel in side_files(run_dir):
            data = (run_dir / rel).read_bytes()
            self.call(lambda: self.fs.pipe_file(self.path(RUN_PREFIX, rel), data), f"write {RUN_PREFIX}/{rel}")
            count += 1
        return count

    def get_side_files(self, run_dir: Path) -> list[str]:
        """Download side files the local run directory lacks (a fresh machine)."""
        prefix = self.path(RUN_PREFIX) + "/"

        def listing():
            self.fs.invalidate_cache()
            try:
                return self.fs.find(self.path(RUN_PREFIX), detail=False)
            except FileNotFoundError:
                return []
        fetched = []
        for entry in self.call(listing, "list run files"):
            rel = entry[len(prefix):] if entry.startswith(prefix) else None
            if not rel:
                continue
            check_relative_path(rel, self.where(RUN_PREFIX))
            target = run_dir / rel
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            data = self.call(lambda: self.fs.cat_file(entry), f"read {RUN_PREFIX}/{rel}")
            atomic_write_bytes(target, data)
            fetched.append(rel)
        return fetched

    # ---- error mapping ------------------------------------------------------------------

    def call(self, fn, what: str, missing_ok: bool = False):
        """Run one backend operation; map its errors to RemoteError (credentials scrubbed)."""
        try:
            return fn()
        except TieredCkptError:
            raise
        except FileNotFoundError as exc:
            if missing_ok:
                return None
            raise RemoteNotFoundError(self.scrub(f"{self.display_url}: {what} failed: not found ({exc})")) from None
        except Exception as exc:  # noqa: BLE001 - every backend error is mapped here
            message = self.scrub(f"{self.display_url}: {what} failed: {type(exc).__name__}: {exc}")
            raise RemoteError(message, transient=is_transient(exc)) from None

    def scrub(self, text: str) -> str:
        return scrub(text, self._secrets)


def is_transient(exc: BaseException) -> bool:
    """True for errors a retry may fix: connection trouble, timeouts, 5xx, throttling."""
    if isinstance(exc, (PermissionError, FileNotFoundError, NotADirectoryError, IsADirectoryError,
                        ValueError, TypeError, TieredCkptError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
        return True
    text = f"{type(exc).__name__} {exc}"
    if re.search(r"\b(5\d\d|SlowDown|Throttl|RequestTimeout|ServiceUnavailable|InternalError|"
                 r"Connect|Timeout|reset|Broken pipe|EOF|temporar)", text, re.IGNORECASE):
        return True
    return isinstance(exc, OSError)  # other I/O trouble: worth a retry


def side_files(run_dir: Path) -> list[str]:
    names = [n for n in SIDE_NAMES if (run_dir / n).is_file()]
    archive = run_dir / "archive"
    if archive.is_dir():
        names += sorted(str(p.relative_to(run_dir)) for p in archive.rglob("*")
                        if p.is_file() and layout.scratch_owner_pid(p.parent.name) is None)
    return names
