"""A kill loop that spends its time killing: one Python process imports torch and tieredckpt
once, then forks a child per run of a script, which a test kills with a real SIGKILL.

Starting a fresh interpreter per kill cost ~3 s of CPU each (torch's import) against well under
a second of the work being killed. A forked child is a real process running the same code a
fresh one would (the server itself never runs a torch operation, so the child builds its own
thread pools), with its own pid for the test's signal; the server reaps it and says how it ended.

    with ForkServer() as server:
        pid = server.spawn(SCRIPT, run_dir, "1", stderr=tmp_path / "err")
        assert server.readline().startswith("READY")
        os.kill(pid, signal.SIGKILL)
        assert server.reap(pid) == -signal.SIGKILL
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import deque
from pathlib import Path

SERVER = r"""
import json, os, sys
import torch, tieredckpt, tieredckpt._loop.store  # noqa: F401 - imported once, before any fork
for line in sys.stdin:
    request = json.loads(line)
    if "wait" in request:
        _, status = os.waitpid(request["wait"], 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"EXIT {request['wait']} {code}", flush=True)
        continue
    pid = os.fork()
    if pid == 0:
        try:
            err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(err, 2)
            sys.stdin = open(os.devnull)
            sys.argv = ["-c", *request["argv"]]
            exec(compile(request["code"], "<forked>", "exec"), {"__name__": "__main__"})
            sys.stdout.flush()
            os._exit(0)
        except SystemExit as exc:
            sys.stdout.flush()
            os._exit(exc.code if isinstance(exc.code, int) else 1)
        except BaseException:
            import traceback
            traceback.print_exc()
            os._exit(1)
    print(f"PID {pid}", flush=True)
"""


class ForkServer:
    def __init__(self, cwd: str | Path | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=cwd)
        self._lines: deque[str] = deque()

    def _read(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server stopped: {self.proc.stderr.read()}")
        return line

    def _send(self, request: dict) -> None:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()

    def _until(self, prefix: str) -> str:
        """The server's next line starting with ``prefix``; the children's lines read meanwhile are kept."""
        while not (line := self._read()).startswith(prefix):
            self._lines.append(line)
        return line

    def spawn(self, code: str, *argv: str, stderr: str | Path) -> int:
        """Fork a child that runs ``code`` with ``argv``; its stderr goes to the file ``stderr``."""
        self._send({"code": code, "argv": [str(a) for a in argv], "stderr": str(stderr)})
        return int(self._until("PID ").split()[1])

    def readline(self) -> str:
        """The next line a child printed."""
        return self._lines.popleft() if self._lines else self._read()

    def reap(self, pid: int) -> int:
        """Wait for the child: its exit code, or minus the signal that ended it. What it printed
        and was not read is dropped (one child at a time: its lines all precede the answer)."""
        self._send({"wait": pid})
        while not (line := self._read()).startswith(f"EXIT {pid} "):
            pass
        self._lines.clear()
        return int(line.split()[2])

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
