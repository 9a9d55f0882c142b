"""Handing a save's bytes from save() to the writer thread: a staging copy and a write, side by side.

The state's bytes, in the shard's order, are cut into parts (a tensor, or 32 MiB of one). Two
threads work on them at once, from opposite ends:

- save() (the training loop's thread, which is blocked meanwhile) copies parts into the
  staging buffers, from the last part backwards;
- the writer takes parts from the first one forwards. A part save() has not reached yet, the
  writer reads straight from the live tensor: the loop is blocked, so the tensor cannot change,
  and that part needs no copy at all. A part save() has copied (or is copying), the writer reads
  from the staging buffer, once the copy is done.

They meet in the middle. save() returns once every part is either copied or already read by the
writer, and never while the writer is reading a live tensor. So the checkpoint is exactly the
state at the moment of save(), as with a full copy, and the loop waits less: in a fresh process,
where every staging page is new memory the host must back first (~0.2 s per GB here), the parts
the writer reads directly are never copied.

This is for new buffers only (the first save, or a tensor whose shape changed). Once the
buffers are ours the copy runs at memory speed on all cores, and a writer beside it would
only slow it (measured: the loop's wait went from 0.09 to 0.15 s per 1.44 GB), so the writer
starts once the copy is done, as before. The pages of the parts the first save's writer read live are
left untouched; the second save touches them, once.

Only a reader that is done with a view before it asks for the next one may read live tensors
(``live_ok``): the O_DIRECT writer copies each part into its own aligned buffers at once; the
page-cache writer hands views to checksum threads that may read them later, so it waits for
staged copies of everything.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import torch

from .._format.memview import byte_view

PART = 32 << 20  # bytes

_NEW, _LIVE, _COPYING, _COPIED = range(4)
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)  # torch >= 2.1's batched copy


class CopyAborted(Exception):
    """The staging copy failed (save() raised why to its caller): the write stops, uncommitted."""


class Handoff:
    """The parts of one save, and who has each."""

    def __init__(self, sources: list[torch.Tensor], buffers: list[torch.Tensor], order: list[int],
                 deferred: set[int], fresh: set[int], layout: tuple | None = None,
                 flat: torch.Tensor | None = None) -> None:
        self._sources, self._buffers = sources, buffers
        # A live tensor may be read by the writer only when its buffer is new (``fresh``: the
        # first save, or a shape changed), it is a plain CPU tensor whose bytes are the buffer's,
        # and not deferred (copied later, while the loop runs: see staging.py). Only such a tensor
        # is cut into parts; any other is copied whole, by torch on all cores.
        readable = {i for i in order if i in fresh and i not in deferred and _readable(sources[i])} if fresh else set()
        if layout is not None and not readable:  # the last save's (staging.py: same structure, nothing deferred)
            self.parts, self._views = layout
        else:
            self.parts = [(i, start, end) for i in order
                          for start, end in (_cuts(buffers[i]) if i in readable else [(0, _nbytes(buffers[i]))])]
            self._views = [None] * len(self.parts)
            if not readable and flat is not None:
                self.parts, self._views = _runs(self.parts, buffers, deferred, flat)
        self._live_ok = [i in readable for i, _, _ in self.parts] if readable else [False] * len(self.parts)
        self.reads_live = bool(readable)  # else the writer starts once the copy is done
        self._state = [_NEW] * len(self.parts)
        self._cond = threading.Condition()
        self._reading_live = False
        self._awaited: int | None = None  # the part the writer waits for
        self._copy_done = False  # save() has returned, or is about to: no live reads from now on
        self._failed = False

    @property
    def layout(self) -> tuple:
        """The parts and their views, to be given to the next Handoff of the same buffers."""
        return self.parts, self._views

    @property
    def read_live(self) -> bool:
        """Some part was written straight from a live tensor."""
        return _LIVE in self._state

    # save()'s side

    def copy_now(self, which: set[int]) -> None:
        """save()'s copy of tensors ``which``: around the writer into new buffers, else at once."""
        if self.reads_live:
            self._copy_back_to_front(which)
        else:
            self._copy_whole(which)

    def _copy_whole(self, which: set[int]) -> None:
        """Every tensor at once, by torch on all cores; the writer starts after (the old way: with
        the buffers ours, the per-part hand-over only cost time, 0.08 s against 0.06 s here)."""
        try:
            self._copy_tensors(sorted(which))
        except BaseException:
            self.fail()
            raise
        with self._cond:
            for k, (i, _, _) in enumerate(self.parts):
                if i in which:
                    self._state[k] = _COPIED
            self._copy_done = True
            self._cond.notify_all()

    def _copy_back_to_front(self, which: set[int]) -> None:
        """Copy the parts of tensors ``which`` (CUDA ones first, all at once, then the rest from
        the last part backwards) until meeting the writer; then wait until it has let go of
        every live tensor."""
        try:
            mine = [k for k, (i, _, _) in enumerate(self.parts) if i in which]
            self._copy_cuda([k for k in mine if self._sources[self.parts[k][0]].device.type == "cuda"])
            for k in reversed([k for k in mine if self._sources[self.parts[k][0]].device.type != "cuda"]):
                if not self._claim(k):
                    break  # the writer has read this part live, and every one before it
                self._copy(k)
                self._mark(k)
        except BaseException:
            self.fail()
            raise
        finally:
            with self._cond:
                self._copy_done = True
                while self._reading_live:
                    self._cond.wait()

    def copy_all(self, which: set[int]) -> None:
        """Copy the parts of tensors ``which`` (the deferred ones, on the writer thread, before
        it writes)."""
        try:
            for k, (i, _, _) in enumerate(self.parts):
                if i in which and self._claim(k):
                    self._copy(k)
                    self._mark(k)
        except BaseException:
            self.fail()
            raise

    def fail(self) -> None:
        with self._cond:
            self._failed = True
            self._cond.notify_all()

    def _claim(self, k: int) -> bool:
        with self._cond:
            if self._state[k] != _NEW:
                return False
            self._state[k] = _COPYING
            return True

    def _copy(self, k: int) -> None:
        i, start, end = self.parts[k]
        src, dst = self._sources[i].detach(), self._buffers[i]
        if self._live_ok[k]:  # a plain byte copy, on this thread alone: the writer has the other core
            ctypes.memmove(dst.data_ptr() + start, src.data_ptr() + start, end - start)
            return
        with torch.no_grad():
            dst.copy_(src)

    def _copy_cuda(self, parts: list[int]) -> None:
        for k in parts:
            self._claim(k)
        self._copy_tensors([self.parts[k][0] for k in parts])
        for k in parts:
            self._mark(k)

    def _copy_tensors(self, which: list[int]) -> None:
        """Whole tensors by torch (GPU ones without blocking, then one synchronize). The CPU ones
        in one ``_foreach_copy_`` call: one dispatch for all, where a loop of ``copy_`` paid
        ~2 us of Python per tensor (0.3 s of a 100,000-tensor save)."""
        cpu = [i for i in which if not self._sources[i].is_cuda]
        gpu = [i for i in which if self._sources[i].is_cuda] if len(cpu) < len(which) else []
        with torch.no_grad():
            if cpu and _FOREACH_COPY is not None:
                _FOREACH_COPY([self._buffers[i] for i in cpu], [self._sources[i] for i in cpu])
            else:
                for i in cpu:
                    self._buffers[i].copy_(self._sources[i])
            for i in gpu:
                self._buffers[i].copy_(self._sources[i].detach(), non_blocking=True)
        if gpu:
            torch.cuda.synchronize()  # the snapshot is complete before anyone may change the sources

    def _mark(self, k: int) -> None:
        with self._cond:
            self._state[k] = _COPIED
            if k == self._awaited:  # wake the writer only for the part it waits on, not for each
                self._cond.notify_all()

    # the writer's side

    def stream(self, live_ok: bool) -> Iterator[memoryview]:
        """Every part's bytes, in order; a view is valid until the next one is asked for (or
        the iterator closed: the caller must close it, even when it fails)."""
        for k, (i, start, end) in enumerate(self.parts):
            live = self._take(k, live_ok)
            if self._views[k] is not None:  # a run of small tensors' buffers, never live
                yield self._views[k]
                continue
            try:
                tensor = self._sources[i] if live else self._buffers[i]
                yield byte_view(tensor.reshape(-1) if live else tensor.view(-1))[start:end]
            finally:
                if live:
                    with self._cond:
                        self._reading_live = False
                        self._cond.notify_all()

    def wait_copied(self) -> None:
        """Every part in its staging buffer (a reader of whole tensors: DTensor pieces' crcs)."""
        for k in range(len(self.parts)):
            self._take(k, live_ok=False)

    def _take(self, k: int, live_ok: bool) -> bool:
        """Wait for part ``k``; True if it is to be read from the live tensor."""
        with self._cond:
            if self._failed:
                raise CopyAborted("the staging copy failed; this step is not written")
            if live_ok and self._live_ok[k] and self._state[k] == _NEW and not self._copy_done:
                self._state[k] = _LIVE
                self._reading_live = True
                return True
            while self._state[k] != _COPIED:
                if self._state[k] == _LIVE:  # the store does not write a save twice once this happened
                    raise RuntimeError("a part of this save was read from its live tensor by an earlier "
                                       "attempt, and the loop has moved on since: it cannot be written again")
                if self._failed:
                    raise CopyAborted("the staging copy failed; this step is not written")
                self._awaited = k
                self._cond.wait()
            self._awaited = None
            return False


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _runs(parts: list, buffers: list[torch.Tensor], deferred: set[int], flat: torch.Tensor) -> tuple[list, list]:
    """``parts`` with each run of whole tensors lying side by side in ``flat`` (the small
    tensors' buffer, staging.py) made one part of up to PART bytes, and a view of each such
    part's bytes (None for the others). A run's part is named by its first tensor: every
    tensor in it is copied whole by _copy_whole, none is deferred, none read live."""
    base, size = flat.data_ptr(), flat.numel()
    whole = byte_view(flat) if size else memoryview(b"")
    out: list = []
    views: list[memoryview | None] = []
    run: list[int] | None = None  # [first tensor, start address, end address]

    def flush() -> None:
        if run is not None:
            out.append((run[0], 0, run[2] - run[1]))
            views.append(whole[run[1] - base:run[2] - base])
    for i, start, end in parts:
        ptr, n = buffers[i].data_ptr(), end - start
        if n == 0 and run is not None and i not in deferred:  # no bytes (nor a dependable address): joins the run
            continue
        inside = i not in deferred and start == 0 and n == _nbytes(buffers[i]) and base <= ptr and ptr + n <= base + size
        if inside and run is not None and run[2] == ptr and ptr + n - run[1] <= PART:
            run[2] = ptr + n
            continue
        flush()
        run = None
        if inside:
            run = [i, ptr, ptr + n]
        else:
            out.append((i, start, end))
            views.append(None)
    flush()
    return out, views


def _cuts(buffer: torch.Tensor) -> list[tuple[int, int]]:
    """A tensor's byte ranges of at most PART bytes, each a whole number of elements."""
    size = _nbytes(buffer)
    step = max(PART // buffer.element_size(), 1) * buffer.element_size()
    return [(start, min(start + step, size)) for start in range(0, size, step)] or [(0, 0)]


def _readable(t: torch.Tensor) -> bool:
    """Bytes the writer can read as they are: a plain (no subclass such as DTensor), dense,
    contiguous CPU tensor, no lazy conj/neg."""
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type == "cpu"
            and t.layout == torch.strided and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.is_quantized)
