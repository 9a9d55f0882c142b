"""Processes that start in milliseconds: one Python process imports torch and tieredckpt once,
then forks a child per script run, which the test drives like any subprocess (real signals, a
real SIGKILL, its own pid, its own exit status).

Starting a fresh interpreter cost ~3 s of CPU each (torch's import) against well under a second
of the work in a kill loop or in one rank of a tiny distributed run. A forked child is a real
process running the same code a fresh one would: the server itself never runs a torch operation
nor starts a thread, so the child builds its own thread pools, process groups and signal
handlers. The server reaps every child as it ends (SIGCHLD) and says how it ended.

    with ForkServer() as server:                    # a kill loop: the children share one stdout
        pid = server.spawn(SCRIPT, run_dir, "1", stderr=tmp_path / "err")
        assert server.readline().startswith("READY")
        server.kill(pid, signal.SIGKILL)
        assert server.reap(pid) == -signal.SIGKILL

    proc = server.popen(["worker.py", "save"], env=...)   # like subprocess.Popen(text=True, PIPEs)
    out, err = proc.communicate(timeout=60)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

SERVER = r"""
import json, os, select, signal, sys
import torch, tieredckpt, tieredckpt._loop.store  # noqa: F401 - imported once, before any fork
for name in sys.argv[1:]:
    __import__(name)  # more of what the children import (torch.distributed, ...)

wake_r, wake_w = os.pipe()
os.set_blocking(wake_r, False)
os.set_blocking(wake_w, False)
signal.set_wakeup_fd(wake_w)
signal.signal(signal.SIGCHLD, lambda *_: None)


def reap(block=False):
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"EXIT {pid} {code}", flush=True)


def child(request):
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.close(wake_r)
    os.close(wake_w)
    if request.get("env") is not None:
        os.environ.clear()
        os.environ.update(request["env"])
    if request.get("cwd"):
        os.chdir(request["cwd"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request.get("stdout")), (2, request["stderr"])):
        if path:
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.stdin = open(os.devnull)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        torch.set_num_threads(int(threads))  # as a fresh interpreter reads it at its first op
    code = 0
    try:
        if "path" in request:
            import runpy
            sys.argv = [request["path"], *request["argv"]]
            sys.path[0] = os.path.dirname(os.path.abspath(request["path"]))
            runpy.run_path(request["path"], run_name="__main__")
        else:
            sys.argv = ["-c", *request["argv"]]
            exec(compile(request["code"], "<forked>", "exec"), {"__name__": "__main__"})
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    try:  # what the interpreter does on its way out: join threads, run atexit, flush
        import threading
        threading._shutdown()
        import atexit
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


pending = b""
while True:
    try:
        ready, _, _ = select.select([0, wake_r], [], [])
    except InterruptedError:
        continue
    if wake_r in ready:
        try:
            os.read(wake_r, 4096)
        except BlockingIOError:
            pass
        reap()
    if 0 not in ready:
        continue
    chunk = os.read(0, 1 << 16)
    if not chunk:
        break
    pending += chunk
    while b"\n" in pending:
        line, pending = pending.split(b"\n", 1)
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(request)
        print(f"PID {pid}", flush=True)
reap(block=True)
"""


class ForkServer:
    def __init__(self, cwd: str | Path | None = None, preload: tuple[str, ...] = ()) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER, *preload], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
        self._cond = threading.Condition()
        self._lines: deque[str] = deque()
        self._pids: deque[int] = deque()
        self.exits: dict[int, int] = {}
        self._closed = False
        self._spawning = threading.Lock()
        self._tmp = tempfile.TemporaryDirectory(prefix="forkserver-")
        self._count = 0
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cond:
                if line.startswith("EXIT "):
                    _, pid, code = line.split()
                    self.exits[int(pid)] = int(code)
                elif line.startswith("PID "):
                    self._pids.append(int(line.split()[1]))
                else:
                    self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _wait_for(self, predicate, timeout: float | None = None) -> bool:
        with self._cond:
            ok = self._cond.wait_for(lambda: predicate() or self._closed, timeout)
            if not predicate():
                if self._closed:
                    raise RuntimeError(f"the fork server stopped: {self.proc.stderr.read()}")
                return False
            return ok

    def _request(self, request: dict) -> int:
        with self._spawning:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            self._wait_for(lambda: bool(self._pids))
            with self._cond:
                return self._pids.popleft()

    def spawn(self, code: str, *argv: str, stderr: str | Path) -> int:
        """Fork a child that runs ``code`` with ``argv``; its stderr goes to the file ``stderr``,
        its stdout to the server's (read with readline)."""
        return self._request({"code": code, "argv": [str(a) for a in argv], "stderr": str(stderr)})

    def popen(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> Forked:
        """Run the script ``argv[0]`` with ``argv[1:]`` as a fresh ``python SCRIPT ...`` would."""
        self._count += 1
        out, err = (Path(self._tmp.name) / f"{self._count}.{n}" for n in ("out", "err"))
        pid = self._request({"path": str(argv[0]), "argv": [str(a) for a in argv[1:]], "env": env,
                             "cwd": str(cwd) if cwd else None, "stdout": str(out), "stderr": str(err)})
        return Forked(self, pid, out, err)

    def readline(self) -> str:
        """The next line a child printed to the server's stdout."""
        self._wait_for(lambda: bool(self._lines))
        with self._cond:
            return self._lines.popleft()

    def wait(self, pid: int, timeout: float | None = None) -> int | None:
        """The child's exit code (minus the signal that ended it), or None after ``timeout``."""
        self._wait_for(lambda: pid in self.exits, timeout)
        return self.exits.get(pid)

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the child unless it has ended already (then its pid is no longer its own)."""
        if pid in self.exits:
            return
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # it ended just now; the server reaped it
            pass

    def reap(self, pid: int) -> int:
        """Wait for the child; what the children printed and was not read is dropped."""
        code = self.wait(pid)
        with self._cond:
            self._lines.clear()
        return code

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Forked:
    """A forked child, driven as a ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)``."""

    def __init__(self, server: ForkServer, pid: int, out: Path, err: Path) -> None:
        self.server, self.pid, self._out, self._err = server, pid, out, err
        self.args = [str(out)]
        self.stdout, self.stderr = _Tail(self, out), _Tail(self, err)

    @property
    def returncode(self) -> int | None:
        return self.server.exits.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self.server.wait(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self._out.read_text(errors="replace"), self._err.read_text(errors="replace")

    def send_signal(self, sig: int) -> None:
        self.server.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


_SHARED: ForkServer | None = None
_SHARED_LOCK = threading.Lock()
DISTRIBUTED = ("torch.distributed", "torch.distributed.device_mesh", "torch.distributed.fsdp",
               "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.checkpoint")


def shared() -> ForkServer:
    """This test process's server for rank launches, with torch.distributed imported too; started
    on first use, stopped at exit."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED.proc.poll() is not None:
            import atexit
            _SHARED = ForkServer(preload=DISTRIBUTED)
            atexit.register(_SHARED.close)
        return _SHARED


class _Tail:
    """A child's output as its pipe reads: lines as they are written, the end once it has exited."""

    def __init__(self, proc: Forked, path: Path) -> None:
        self.proc, self.path, self._file = proc, path, None

    def _open(self):
        while self._file is None:
            try:
                self._file = open(self.path, errors="replace")
            except FileNotFoundError:  # the child has not opened it yet
                if self.proc.poll() is not None:
                    return None
                time.sleep(0.01)
        return self._file

    def readline(self) -> str:
        f, partial = self._open(), ""
        while f is not None:
            partial += f.readline()
            if partial.endswith("\n"):
                return partial
            if self.proc.poll() is not None:  # ended: what is left, then "" (EOF)
                return partial + f.read()
            time.sleep(0.01)
        return partial

    def read(self) -> str:
        self.proc.wait()
        f = self._open()
        return "" if f is None else f.read()

    def __iter__(self):
        while line := self.readline():
            yield line
