"""A training process whose framework rewrites one fixed checkpoint folder in place at every save.

    inplace_writer.py RUN SRC DIGESTS SAVES LINK [REMOTE_URL OPTIONS_JSON [GO_FILE]]

Each save writes, over the files of the previous one (same names, same inodes, truncated):
``model.safetensors`` (safetensors.torch.save_file, 40 MB), ``optimizer.pt`` (torch.save,
24 MB) and ``latest`` (a truncating open(..., "wb")), then commits the folder with
``save_files`` and goes straight on to the next save's rewrite, while the commit's crc32c
pass, the sha256 fill and the upload read the step in the background. DIGESTS gets, per step,
the sha256 of every file as the folder held it when ``save_files`` was called. With GO_FILE,
the store is opened and the process waits for that file (the test takes the remote down).
Exit 0; 3 when ``close()`` raised the uploads it refused (only with LINK, whose steps change).
"""

import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tieredckpt import CheckpointStore, UploadError

run, src, digests_path = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
saves, link = int(sys.argv[4]), sys.argv[5] == "link"
url = sys.argv[6] if len(sys.argv) > 6 else None
options = json.loads(sys.argv[7]) if len(sys.argv) > 7 else {}
go = Path(sys.argv[8]) if len(sys.argv) > 8 else None
src.mkdir(parents=True, exist_ok=True)
digests: dict[str, dict[str, str]] = {}

# with LINK the framework breaks link=True's rule, so a commit can find a file shrinking under its
# checksum: that save fails by name and the run goes on (on_save_error="warn"), as a user's would
store = CheckpointStore(run, url, remote_options=options, keep_local=3, close_timeout=5,
                        on_save_error="warn" if link else "raise")
try:
    print("open", flush=True)
    while go is not None and not go.exists():
        time.sleep(0.05)
    for step in range(1, saves + 1):
        save_file({"w": torch.full((10 << 20,), float(step))}, str(src / "model.safetensors"))
        torch.save({"exp_avg": torch.full((6 << 20,), float(-step))}, src / "optimizer.pt")
        with open(src / "latest", "wb") as f:
            f.write(f"global_step{step}".encode())
        digests[str(step)] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in src.iterdir()}
        store.save_files(step, src, link=link)  # not waited for: the next rewrite starts at once
    store.wait()
    digests_path.write_text(json.dumps(digests))
    print("saved", flush=True)
except Exception as exc:  # noqa: BLE001 - said on stdout, then the exit status says it
    print(f"raised {type(exc).__name__}: {exc}", flush=True)
    raise
finally:
    try:
        store.close()
    except UploadError as exc:  # the loud end of uploads refused (their bytes changed after the commit)
        print(f"upload refused: {exc}", flush=True)
        sys.exit(3)
print("closed", flush=True)
