"""The remote tier: moving checkpoints to and from any fsspec URL (s3://, file://, memory://...).

Object stores have no rename, so the commit marker is the upload manifest:

    ROOT/objects/<crc32c>-<size>-<hex16>    the parts of every step's shards, at most 64 MiB raw,
                                           cut at tensor edges (objects.py), encoded by the codec
                                           (zstd-dtype, zstd-planes, zstd, raw); never overwritten
    ROOT/step_000100/upload.json            written LAST: without it the step does not exist; it
                                           names the objects the step is made of
    ROOT/step_000100/rank0.bin.p00000 ...   the parts of a step uploaded before objects/ (read only)
    ROOT/latest                             newest uploaded step, written after upload.json
    ROOT/run/.loss.json ...                 the run directory's side files

Upload order: side files -> every part not already on the remote -> a listing
confirming every object the step names -> upload.json -> latest. A part whose
bytes an object of a kept step holds (compared byte for byte with that step's
local copy) is referenced, not sent. Parts are encoded on the calling thread
while a small pool sends the previous ones. Each part records the checksum of
its stored and of its raw bytes; the embedded checkpoint manifest carries each
file's crc32c and sha256.

Deletion keeps every reference whole: a step's marker goes first (the step stops
existing), then the objects no other committed step names, then its directory. A
crash in between leaves unreferenced objects, which ``orphan_objects`` finds for
gc; never a marker naming a missing object. Only the lease owner deletes.

Download: parts are fetched in parallel into files of a scratch directory the
caller owns (the local tier commits it); every size read from the remote is
bounded before anything is allocated, and decoding streams into the file
(download.py's).

Requests, deadlines and error mapping are transport.py's; this module never
calls the filesystem itself.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .._format import layout
from .._format.atomic import atomic_write_bytes
from .._format.checksum import crc32c_update, crc_hex
from .._format.lossfile import merge_loss
from .._format.manifest import ShardManifest
from .._format.shardheader import FLOAT_WIDTHS, tensor_spans
from .._format.uploadmanifest import MAX_UPLOAD_MANIFEST, PartEntry, UploadedFile, UploadManifest, generation_of
from ..errors import (
    CheckpointNotFoundError,
    CommitRefusedError,
    ManifestError,
    RemoteError,
    RemoteNotFoundError,
    TieredCkptError,
    WriterConflictError,
)
from .download import PartReader
from .framepool import FramePool
from .objects import Reuse, part_bounds
from .onethread import one_thread
from .partsource import SentCheck, open_source
from .sharded import shard_path
from .transport import REQUEST_TIMEOUT, Transport

PART_SIZE = 64 << 20
MAX_SIDE_FILE = 1 << 30  # a side file larger than this is not one we wrote
_POINTER_MAX = 256


class PartsMissingError(RemoteError):
    """Parts a step names are not on the remote at its commit (the server lost them, or they were
    deleted meanwhile). ``parts``: (file path, offset, object) of each; with many ranks, the leader
    finds them and every rank forgets those of its own file (``forget_part``) so it sends them again."""

    def __init__(self, message: str, parts: list[tuple[str, int, str]]) -> None:
        super().__init__(message, transient=True)
        self.parts = parts


def forget_part(done: dict, path: str, offset: int) -> None:
    """The next attempt sends this part again, and never references an object for it."""
    done.pop((path, offset), None)
    done[("missing", path, offset)] = True


class RemoteTier:
    def __init__(self, url: str, options: dict | None = None, *, fs=None, part_size: int = PART_SIZE,
                 concurrency: int = 4, request_timeout: float = REQUEST_TIMEOUT) -> None:
        self.t = Transport(url, options, fs=fs, request_timeout=request_timeout)
        self.display_url = self.t.display_url
        self.part_size = part_size
        self.concurrency = concurrency
        # Compressed parts are encoded into these, kept from one upload to the next: a fresh
        # part-sized buffer costs 0.4-0.5 s of CPU per GB in page faults here, and each upload
        # would fault in as many as were in flight. Held between uploads: at most concurrency + 2
        # buffers of a part (390 MiB at the defaults), only once something compressed was sent.
        self._frames = FramePool(part_size + (1 << 20))
        self._refs: dict[int, set[str]] = {}  # objects of committed steps (markers are create-only)
        self._gens: dict[int, int] = {}  # the lease generation each marker read or written records
        self._reader = PartReader(self.t, concurrency)

    @property
    def fs(self):
        return self.t.fs

    def path(self, *parts: str) -> str:
        return self.t.path(*parts)

    def where(self, *parts: str) -> str:
        return self.t.where(*parts)

    def scrub(self, text: str) -> str:
        return self.t.scrub(text)

    # ---- listing ------------------------------------------------------------------------

    def step_dirs(self) -> list[int]:
        """Steps that have a directory on the remote, committed or not (one delimiter listing)."""
        return sorted(s for s in map(layout.parse_step_dir, self.t.list_dirs()) if s is not None)

    def steps(self) -> list[int]:
        """Steps whose upload manifest exists (the only ones that exist for a reader)."""
        return sorted(s for s, committed in self._step_objects().items() if committed)

    def uncommitted(self) -> list[int]:
        """Step directories holding data but no upload manifest: a half-finished upload."""
        return sorted(s for s, committed in self._step_objects().items() if not committed)

    def _step_objects(self) -> dict[int, bool]:
        found: dict[int, bool] = {}
        for rel in self.t.list_files(""):
            top, _, rest = rel.partition("/")
            step = layout.parse_step_dir(top)
            if step is not None and rest:
                found[step] = found.get(step, False) or rest == layout.UPLOAD_MANIFEST
        return found

    def newest_object_time(self, step: int) -> float | None:
        """When the newest object of a step directory was written (for gc's grace period)."""
        times = [t for _, t in self.t.list_times(layout.step_dir_name(step)).values() if t is not None]
        return max(times) if times else None

    def is_committed(self, step: int) -> bool:
        return self.t.exists(f"{layout.step_dir_name(step)}/{layout.UPLOAD_MANIFEST}")

    def newest_step(self) -> int | None:
        """The newest committed step of the newest writer generation's timeline (lease.py).

        Three requests when the ``latest`` pointer is right: read it, read its upload manifest,
        and read the writer record to confirm that no later generation has committed since.
        Otherwise (no pointer, or one a writer that was replaced left behind) the markers are
        read newest first until one of that generation is found, and the newest of the highest
        generation wins: a zombie's step numbered above the owner's newest is not newer."""
        pointer = self.latest_pointer()
        top = self.timeline_generation()
        if pointer is not None:
            gen = self.marker_generation(pointer, top)
            if gen is not None and gen >= top:
                return pointer
        best: tuple[int, int] | None = None
        for step in reversed(self.step_dirs()):  # newest first: the first of the top generation wins
            found = self.marker_generation(step, top)
            if found is not None and (best is None or (found, step) > best):
                best = (found, step)
                if found >= top:
                    break
        return None if best is None else best[1]

    def marker_generation(self, step: int, unknown: int = 0) -> int | None:
        """The generation a committed step's marker records; None when it is not committed. A
        marker that cannot be parsed counts as ``unknown`` (as committed as any: restore names it)."""
        try:
            gen = self.upload_manifest(step).generation
        except CheckpointNotFoundError:
            return None
        except ManifestError:
            return unknown
        self._gens[step] = gen
        return gen

    def timeline_generation(self) -> int:
        """The generation whose timeline is the remote's newest, by the writer record: the record's
        own when its writer has committed something (or may have: an older or unreadable record),
        else the one it continued (its ``base``): a writer that took the remote and committed
        nothing yet does not hide the timeline it resumed from. 0 without a record."""
        data = self.t.get_optional(layout.WRITER_LEASE, 64 << 10)
        try:
            record = json.loads(data) if data is not None else None
        except ValueError:
            return 0
        if not isinstance(record, dict):
            return 0
        if record.get("committed") is False:
            base = record.get("base")
            return base if type(base) is int and 0 <= base <= generation_of(record) else generation_of(record)
        return generation_of(record)

    def newest_generation(self) -> int:
        """The lease generation of the newest committed step's writer (0: none, or unrecorded): the
        timeline a new writer continues, and the floor its generation must exceed."""
        step = self.newest_step()
        return 0 if step is None else (self.marker_generation(step) or 0)

    def upload_manifest(self, step: int) -> UploadManifest:
        rel = f"{layout.step_dir_name(step)}/{layout.UPLOAD_MANIFEST}"
        try:
            text = self.t.get(rel, MAX_UPLOAD_MANIFEST)
        except RemoteNotFoundError:
            raise CheckpointNotFoundError(f"{self.where(rel)}: no uploaded checkpoint for step {step}") from None
        except RemoteError as exc:
            if exc.transient:
                raise
            raise ManifestError(str(exc)) from None
        upload = UploadManifest.from_json(text, self.where(rel))
        if upload.step != step:
            raise ManifestError(f"{self.where(rel)}: names step {upload.step}, but it lies in the directory of "
                                f"step {step} (copied or planted?)")
        return upload

    def latest_pointer(self) -> int | None:
        data = self.t.get_optional(layout.LATEST, _POINTER_MAX)
        return None if data is None else layout.parse_step_dir(data.decode(errors="replace").strip())

    def write_latest(self, step: int) -> None:
        self.t.put(layout.LATEST, (layout.step_dir_name(step) + "\n").encode())

    # ---- upload -------------------------------------------------------------------------

    def upload(self, local_dir: Path, manifest: ShardManifest, codec: str = "zstd-dtype", level: int = 1,
               done: dict | None = None, progress: Callable[[int], None] | None = None,
               reuse: Reuse | None = None) -> UploadManifest:
        """Send a committed local checkpoint; upload.json goes last. With ``done``, a retry after a
        failure resumes, and sends again any part the commit found missing."""
        done = {} if done is None else done
        files = self.send_files(local_dir, manifest, manifest.shards, codec, level, done, progress, reuse)
        try:
            return self.commit_upload(manifest, codec, files)
        except PartsMissingError as exc:
            for path, offset, _ in exc.parts:
                forget_part(done, path, offset)
            raise

    def send_files(self, local_dir: Path, manifest: ShardManifest, shards, codec: str, level: int = 1,
                   done: dict | None = None, progress=None, reuse: Reuse | None = None) -> list[UploadedFile]:
        """Send the parts of ``shards`` (entries of ``manifest``) as objects; a part ``reuse`` finds on
        the remote already is referenced instead. ``done`` carries parts already sent (by shard and
        offset) across attempts, so a retry resumes instead of restarting."""
        done = {} if done is None else done
        typed = manifest.layout != "files"  # our shard files: their tensor index says where to cut
        return [UploadedFile(shard.path, shard.size,
                             self._upload_file(shard_path(local_dir, shard), shard.path, shard.size,
                                               codec, level, done, progress, self._frames, typed, reuse,
                                               shard.crc32c))
                for shard in shards]

    def commit_upload(self, manifest: ShardManifest, codec: str, files: list[UploadedFile],
                      writer: dict | None = None) -> UploadManifest:
        """Confirm every part of every rank is on the remote, then create upload.json -- the commit
        marker -- only if none is there (a conditional write where the backend has one): a
        committed step's marker is never overwritten, by us or by anyone. An existing marker that
        ``writer`` (our identity) wrote is an earlier attempt of ours whose answer was lost."""
        step_dir = layout.step_dir_name(manifest.step)
        self._confirm_parts(files)
        upload = UploadManifest(manifest.step, codec, files, json.loads(manifest.to_json()), time.time(),
                                writer=writer)
        rel = f"{step_dir}/{layout.UPLOAD_MANIFEST}"
        self._refs.pop(manifest.step, None)
        if self.t.put_if_absent(rel, upload.to_json().encode()) is None:
            existing = self.upload_manifest(manifest.step)
            if writer is None or (existing.writer or {}).get("token") != writer.get("token"):
                raise CommitRefusedError(
                    f"{self.where(rel)}: step {manifest.step} is already committed on the remote (by "
                    f"{describe_writer(existing.writer)}); a committed step is never overwritten")
            return existing
        self._refs[manifest.step] = upload.objects()
        self._gens[manifest.step] = upload.generation
        return upload

    def copy_step_from(self, source: RemoteTier, step: int, writer: dict | None = None,
                       fence: Callable[[], None] | None = None) -> UploadManifest:
        """Commit ``source``'s step ``step`` here without sending its bytes: every object it names is
        copied by the storage itself into our object store, under a name of ours, then the step's
        upload manifest is committed as an upload's is (parts confirmed, a create-only marker;
        ``fence`` first). The copies are ours: retention of either run never touches the other's.
        Parts are recorded as not sent (bytes_sent counts what went over the wire)."""
        if not self.t.same_store(source.t):
            raise ValueError(f"{self.display_url} and {source.display_url} are not on one storage: a fork copies "
                             "a step's objects on the storage's side; open the new run's store on the new remote "
                             "instead, and its uploader sends the step")
        upload = source.upload_manifest(step)
        copied: dict[str, str] = {}
        files = []
        for f in upload.files:
            parts = []
            for part in f.parts:
                rel = upload.part_rel(part)
                if rel not in copied:
                    copied[rel] = layout.object_name(part.raw_crc32c, part.raw_size)
                    self.t.copy_from(source.t, rel, copied[rel], part.stored_size)
                parts.append(dataclasses.replace(part, path=copied[rel], sent=False))
            files.append(UploadedFile(f.path, f.size, parts))
        if fence is not None:
            fence()
        return self.commit_upload(upload.shard_manifest, upload.codec, files, writer=writer)

    def committed_by(self, step: int) -> dict | None:
        """The writer identity recorded in a committed step's upload manifest (None: unrecorded)."""
        return self.upload_manifest(step).writer

    def _confirm_parts(self, files: list[UploadedFile]) -> None:
        """Before the commit marker: every object the step names must be on the remote with its
        stored size, those it sent and those it references.

        A retry skips parts an earlier attempt sent; if the server lost any of them
        meanwhile (or an object referenced was deleted), writing upload.json would publish
        a partial checkpoint. The attempt fails with PartsMissingError naming them; whoever keeps
        the record of sent parts forgets them (``forget_part``), so the next attempt sends them.

        One lookup per object the step names (``concurrency`` at a time), never a listing of
        ``objects/``: a commit costs the same whatever the run's kept steps hold.
        """
        wanted = {part.path: part.stored_size for f in files for part in f.parts}
        pool = ThreadPoolExecutor(max(1, self.concurrency), thread_name_prefix="tieredckpt-confirm")
        try:
            found = dict(zip(wanted, pool.map(self.t.size, wanted)))
        finally:  # on a failed lookup (a remote gone down) the queued ones are not tried one by one
            pool.shutdown(wait=True, cancel_futures=True)
        missing = [(f.path, part.offset, part.path) for f in files for part in f.parts
                   if found[part.path] != part.stored_size]
        if missing:
            raise PartsMissingError(f"{self.where(layout.OBJECTS)}: {len(missing)} part(s) of this step are missing "
                                    f"or short on the remote (first: {missing[0][2]}); sending them again", missing)

    def _upload_file(self, path, name, size, codec, level, done, progress, frames,
                     typed: bool = True, reuse: Reuse | None = None, expected: str = "") -> list[PartEntry]:
        """Send one file's parts. A save() step's shard (``typed``) is the store's alone and is read
        through a mapping; a folder step's file may be a framework's hard link and is read with
        preads (partsource.py). Either way the parts' crc32c, chained, must give the manifest's
        ``expected`` crc32c of the file, or the upload of this step fails by name."""
        source = open_source(Path(path), size, owned=typed)
        try:
            parts = self._send_parts(source, path, name, size, codec, level, done, progress, frames, typed, reuse)
        finally:
            source.close()
        check = SentCheck(Path(path), size, expected)
        for part in parts:
            check.add(part.raw_crc32c, part.raw_size)
        check.verify()
        return parts

    def _send_parts(self, buf, path, name, size, codec, level, done, progress, frames, typed, reuse) -> list[PartEntry]:
        # torch: imported only when something is sent
        from .._format.codec import encode, frame_bound, runs_in
        from .._format.memview import byte_view
        tensors = tensor_spans(path) if typed else _safetensors_spans(path)
        spans = [(s, e, FLOAT_WIDTHS[d]) for s, e, d in tensors if d in FLOAT_WIDTHS] if codec == "zstd-dtype" else []
        parts: list[PartEntry] = []
        in_flight = threading.BoundedSemaphore(self.concurrency + 1)
        errors: list[BaseException] = []

        def send(rel, key, entry, stored, frame):
            try:
                if not errors:
                    self.t.put(rel, stored, crc32c=entry.stored_crc32c)
                    done[key] = entry
                    if progress:
                        progress(entry.raw_size)
                    if frame is not None:
                        frames.give(frame)  # sent: the request that read it is over (a failed one is not)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                errors.append(exc)
            finally:
                in_flight.release()

        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="tieredckpt-upload") as pool:
            for offset, end in part_bounds(size, [(s, e) for s, e, _ in tensors], self.part_size):
                key = (name, offset)
                raw = buf[offset:end]
                raw_crc = crc_hex(crc32c_update(byte_view(raw)))
                cached = done.get(key)
                if cached is not None and cached.raw_crc32c == raw_crc and cached.raw_size == raw.numel():
                    parts.append(cached)  # sent (or found) by an earlier attempt
                    continue
                found = None if reuse is None or ("missing", name, offset) in done else reuse.find(raw, offset, raw_crc)
                if found is not None:
                    parts.append(found)  # an object of a kept step holds these bytes: referenced
                    done[key] = found
                    if progress:
                        progress(found.raw_size)
                    continue
                part = layout.object_name(raw_crc, raw.numel())
                runs = runs_in(spans, offset, raw.numel()) if codec == "zstd-dtype" else None
                frame = frames.take(frame_bound(raw.numel(), runs)) if runs is not None else None
                # raw parts are sent straight from the mapping (no copy); the others are encoded
                # here (zstd-dtype into a reused frame) while the sends already in flight go on
                if codec == "raw":
                    stored = byte_view(raw)
                else:
                    with one_thread():  # CPU is the cost here: no OpenMP team spinning beside the sends
                        stored = encode(raw, codec, level, runs, out=frame)
                stored_crc = raw_crc if codec == "raw" else crc_hex(crc32c_update(stored))  # raw: the same bytes
                entry = PartEntry(part, offset, raw.numel(), len(stored), raw_crc, stored_crc)
                parts.append(entry)
                in_flight.acquire()
                if errors:
                    in_flight.release()
                    break
                pool.submit(send, part, key, entry, stored, frame)
        if errors:
            raise errors[0]
        return parts

    # ---- download: download.py's ----------------------------------------------------------

    def fetch_files(self, upload: UploadManifest, files: list[UploadedFile], dest: Path,
                    progress: Callable[[int], None] | None = None) -> None:
        """Fetch every part of ``files`` in parallel into new files under ``dest``, fsynced (download.py)."""
        self._reader.fetch_files(upload, files, dest, progress)

    def fetch_part(self, upload: UploadManifest, fd: int, part: PartEntry) -> None:
        """One part, verified (stored and decoded crc32c), written at its offset into ``fd``."""
        self._reader.fetch_part(upload, fd, part)

    def damage(self, step: int, sample_bytes: int = 16 << 20) -> dict[str, str]:
        """What of committed ``step`` does not read back as its upload manifest records (download.py)."""
        return self._reader.damage(self.upload_manifest(step), sample_bytes)

    # ---- deletion -----------------------------------------------------------------------

    def delete(self, step: int, generation: int | None = None) -> None:
        """Remove a remote step: its upload manifest first (it stops existing), then the objects
        no other committed step names, then its directory. What the others reference is read
        before anything goes: a failure to read it deletes nothing (retried later), and a marker
        that cannot be parsed keeps every object (gc decides once it can). Only the owning writer
        calls this (see lease.py), with its lease ``generation``: a step a later generation
        committed is never deleted (WriterConflictError), whatever the fence said."""
        step_dir = layout.step_dir_name(step)
        doomed: set[str] = set()
        mine = self._objects_of(step)
        if generation is not None and self._gens.get(step, 0) > generation:
            raise WriterConflictError(f"{self.where(step_dir)}: step {step} was committed by a later writer "
                                      f"(generation {self._gens[step]}, this one holds {generation}); "
                                      "it is never deleted by an earlier one")
        if mine:
            others = self.referenced(exclude={step})
            doomed = mine - others if others is not None else set()
        self.t.rm(f"{step_dir}/{layout.UPLOAD_MANIFEST}")
        self._refs.pop(step, None)
        for rel in sorted(doomed):
            self.t.rm(rel)
        self.t.rm_tree(step_dir)

    def _objects_of(self, step: int) -> set[str]:
        """The objects a committed step names (none: not committed, schema 1, or unreadable)."""
        if step in self._refs:
            return set(self._refs[step])
        try:
            upload = self.upload_manifest(step)
        except (CheckpointNotFoundError, ManifestError):
            return set()
        self._gens[step] = upload.generation
        return upload.objects()

    def referenced(self, exclude: AbstractSet[int] = frozenset(), cached: bool = True) -> set[str] | None:
        """Every object a committed step other than ``exclude`` names; None when a committed
        step's marker cannot be parsed (what it names is unknown: nothing may be deleted)."""
        names: set[str] = set()
        for step in self.step_dirs():
            if step in exclude:
                continue
            if cached and step in self._refs:
                names |= self._refs[step]
                continue
            try:
                upload = self.upload_manifest(step)
            except CheckpointNotFoundError:
                continue  # no marker: not a step (a half-upload's objects are gc's)
            except ManifestError:
                return None
            objects = upload.objects()
            self._refs[step], self._gens[step] = objects, upload.generation
            names |= objects
        return names

    def orphan_objects(self, grace: float, now: float | None = None) -> tuple[list[str], str | None]:
        """Objects no committed step names, written at least ``grace`` seconds ago by the remote's
        clock (younger ones may belong to an upload about to commit); and why none may be
        deleted, if so. The objects are listed first, then looked up in what this process has read
        of the markers (each is read once); any found unnamed are confirmed against every marker
        read fresh from the remote, never only from what this process remembers."""
        now = time.time() if now is None else now
        found = self.t.list_times(layout.OBJECTS)
        unnamed: list[str] = []
        for cached in (True, False):
            refs = self.referenced(cached=cached)
            if refs is None:
                return [], "a committed step's upload manifest cannot be parsed, so what it names is unknown"
            unnamed = sorted(rel for name, (_, written) in found.items()
                             if (rel := f"{layout.OBJECTS}/{name}") not in refs and written is not None
                             and now - written >= grace)
            if not unnamed:
                break
        return unnamed, None

    def delete_objects(self, rels: list[str]) -> None:
        for rel in rels:
            if layout.parse_object(rel) is None:
                raise ValueError(f"{rel!r} is not an object path")
            self.t.rm(rel)

    # ---- side files ---------------------------------------------------------------------

    def put_side_files(self, run_dir: Path) -> int:
        """Upload the run directory's side files and archives; returns how many."""
        count = 0
        for rel in local_side_files(run_dir):
            data = (run_dir / rel).read_bytes()
            self.t.put(f"{layout.RUN_PREFIX}/{rel}", data)
            count += 1
        return count

    def get_side_files(self, run_dir: Path, warn: Callable[[str], None] | None = None) -> list[str]:
        """Fetch each side file the run directory lacks, or holds a shorter copy of.

        Only the names tieredckpt writes (layout.is_synced_name) are ever read; anything
        else under ``run/`` is ignored with a warning. ``.loss.json`` is append-only, so a
        local copy is replaced only by a longer remote one that starts with it... or, when
        they diverge, merged by step (see runlog.merge_loss).
        """
        fetched = []
        for rel, size in sorted(self.t.list_files(layout.RUN_PREFIX).items()):
            if not layout.is_synced_name(rel) or size > MAX_SIDE_FILE:
                if warn:
                    warn(f"{self.where(layout.RUN_PREFIX, rel)}: not a file tieredckpt writes; ignored")
                continue
            target = run_dir / rel
            if rel == layout.LOSS and target.exists():
                local = target.read_bytes()
                if size <= len(local):
                    continue
                merged = merge_loss(local, self.t.get(f"{layout.RUN_PREFIX}/{rel}", MAX_SIDE_FILE))
                if merged != local:
                    atomic_write_bytes(target, merged)
                    fetched.append(rel)
                continue
            if target.exists():
                continue  # the local copy is the newer one
            data = self.t.get(f"{layout.RUN_PREFIX}/{rel}", MAX_SIDE_FILE)
            target.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(target, data)
            fetched.append(rel)
        return fetched

    def close(self) -> None:
        self._frames.clear()
        self.t.close()


def _safetensors_spans(path) -> list[tuple[int, int, str]]:
    """A folder's file: its tensors (start, end, dtype) when it is a safetensors file (our shard format is
    one), else none -- every byte is then width 1 to zstd-dtype, plain zstd in effect."""
    if not str(path).endswith(".safetensors"):
        return []
    try:
        return tensor_spans(path)
    except (TieredCkptError, OSError):  # not a safetensors file after all: plain bytes
        return []


def describe_writer(writer: dict | None) -> str:
    if not writer:
        return "a writer that did not record itself"
    return f"host {writer.get('host', '?')}, pid {writer.get('pid', '?')}, token {writer.get('token', '?')[:8]}"


def local_side_files(run_dir: Path) -> list[str]:
    """The side files of ``run_dir`` that travel with it to the remote."""
    names = [n for n in layout.SYNCED_FILES if (run_dir / n).is_file()]
    archive = run_dir / layout.ARCHIVE
    if archive.is_dir():
        names += sorted(rel for rel in (str(p.relative_to(run_dir)) for p in archive.rglob("*") if p.is_file())
                        if layout.is_synced_name(rel))
    return names

