"""Writes docs/cli.md: every command's help and a session of real commands on a small run.

    python docs/gen_cli.py            (run from the repository's root; takes ~20 s)

The run is made here (a small model saved at steps 100-300, a file:// remote standing in for
a bucket), then each command runs as a user would type it and its output goes on the page
as printed, with the temporary directory's path shortened to ``/tmp/demo``.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["ls", "verify", "inspect", "restore", "push", "push-dir", "restore-dir", "convert", "reshard",
            "plot", "gc"]

SESSION = [
    ("The steps of a run, where each lives and how far uploads lag:", "ls runs/lm"),
    ("What checkpoints cost the loop (from `RUN_DIR/.events.jsonl`):", "ls runs/lm --stats"),
    ("Every step's sizes and crc32c, then sha256 too (exit status 1 on any problem):", "verify runs/lm --full"),
    ("A checkpoint's manifest and tensor index:", "inspect runs/lm --step 300"),
    ("A brand-new machine: the run back from its remote (verified, staged, renamed into place):",
     "restore file://{work}/bucket/lm --to runs/lm-copy"),
    ("A framework's checkpoint folder committed as a step and uploaded, then brought back:",
     "push-dir runs/lm 400 hf-checkpoint"),
    (None, "restore-dir runs/lm --step 400 --to hf-restored"),
    ("Half-uploaded steps nobody is finishing (none here):", "gc file://{work}/bucket/lm --dry-run"),
]


def make_run(work: Path) -> None:
    sys.path.insert(0, str(ROOT))
    import torch

    from tieredckpt import CheckpointStore

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(256, 64), torch.nn.Linear(64, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointStore(work / "runs" / "lm", (work / "bucket" / "lm").as_uri(), every=100) as store:
        for step in range(1, 301):
            loss = model(torch.randint(0, 256, (8, 16))).logsumexp(-1).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            store.log_loss(step, loss.item())
            if step % 100 == 0:
                store.save(step, {"model": model, "optim": opt, "step": step}).wait()
        store.wait(uploads=True, timeout=60)
    folder = work / "hf-checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "demo"}\n')
    (folder / "trainer_state.json").write_text('{"global_step": 400}\n')
    (folder / "optimizer.pt.bin").write_bytes(os.urandom(1 << 16))


def run(work: Path, command: str) -> str:
    exe = Path(sys.executable).parent / "tieredckpt"
    done = subprocess.run([str(exe), *command.format(work=work).split()], cwd=work, capture_output=True, text=True,
                          env=dict(os.environ, COLUMNS="100"))
    out = (done.stdout + done.stderr).replace(str(work), "/tmp/demo").rstrip()
    out = re.sub(rf"\bby {re.escape(socket.gethostname())} pid", "by node1 pid", out)  # the same page on any host
    return out + (f"\n(exit status {done.returncode})" if done.returncode else "")


EXIT_CODES = """| exit | meaning |
|---|---|
| 0 | fine |
| 1 | a problem found: a damaged checkpoint, saves failing, a remote step that does not restore |
| 2 | bad usage (an unknown option, a missing argument) |
| 3 | the command could not run: no such run or step, the remote refused or cannot be reached, a full disk |
| 130 | interrupted (Ctrl-C) |
| 141 | the output pipe closed (`tieredckpt ls RUN \\| head`) |"""


def render() -> str:
    """The page, from a run made here and the commands' real output."""
    work = Path(tempfile.mkdtemp(prefix="tieredckpt-cli-"))
    try:
        make_run(work)
        page = ["# CLI", "",
                "`tieredckpt` inspects and manages runs, local or remote. Every command below ran as shown",
                "(written by `docs/gen_cli.py` on a small run with a `file://` remote; paths shortened;",
                "`tests/test_docs.py` runs it again and compares). Global flags (`--debug`: the traceback",
                "of an error) go before or after the command.", "",
                "## Exit codes and errors", "", EXIT_CODES, "",
                "An error is one line on stderr: `tieredckpt: error (ErrorClass): ` and what went wrong,",
                "naming the file, step or URL. Look the class up in [Troubleshooting](troubleshooting.md).", "",
                "```console", "$ tieredckpt ls runs/missing", run(work, "ls runs/missing"), "```", "",
                "## A session", ""]
        for text, command in SESSION:
            if text:
                page += [text, ""]
            shown = command.format(work="/tmp/demo")
            page += ["```console", f"$ tieredckpt {shown}", run(work, command), "```", ""]
        page += ["## Every command", ""]
        for name in COMMANDS:
            page += [f"### `tieredckpt {name}`", "", "```text", run(work, f"{name} --help"), "```", ""]
        return "\n".join(page)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    (ROOT / "docs" / "cli.md").write_text(render())


if __name__ == "__main__":
    main()
