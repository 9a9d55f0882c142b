"""The library works where NumPy is not installed (torch does not require it)."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

SCRIPT = """
import sys
sys.modules["numpy"] = None  # any 'import numpy' now fails, as on a machine without it
import torch, tempfile
from tieredckpt import CheckpointStore, capture_rng, restore_rng, read_flat, write_flat
from tieredckpt._format.compare import first_difference
d = tempfile.mkdtemp()
state = {"w": torch.randn(100), "b": torch.ones(3, dtype=torch.bfloat16), "rng": capture_rng(), "n": 3}
assert "numpy" not in state["rng"]
with CheckpointStore(d) as store:
    store.save(1, state).wait()
    out = store.restore()
assert first_difference(state, out) is None, first_difference(state, out)
restore_rng(out["rng"])
write_flat(d + "/step_000001.bin", 1, torch.ones(4), torch.zeros(4), torch.zeros(4))
assert read_flat(d + "/step_000001.bin").weights.sum() == 4
print("ok")
"""


def test_save_restore_and_flat_without_numpy():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("ok")


CLI = """
import sys
sys.modules["numpy"] = None  # as in the demo's venv, which has no NumPy
from tieredckpt.cli import main
sys.exit(main(["verify", sys.argv[1], "--full"]))
"""


def test_the_cli_verifying_tensors_without_numpy_prints_no_warning(tmp_path):
    import torch

    from tieredckpt import CheckpointStore
    with CheckpointStore(tmp_path / "run") as store:
        store.save(1, {"w": torch.ones(3)}).wait()
    out = subprocess.run([sys.executable, "-c", CLI, str(tmp_path / "run")], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0 and "step 1: ok" in out.stdout, out.stderr
    assert out.stderr == ""  # torch's "Failed to initialize NumPy" warning included
