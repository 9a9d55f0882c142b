"""A remote commit costs the same requests whatever the run already holds.

Counted at the HTTP level by the proxy in front of moto: the requests one step's upload
and commit make, with one step kept on the remote and with 500 (1,500 objects, more than
one page of a listing: a commit that listed ``objects/`` would pay a request more per
1,000 objects the kept steps hold). The kept steps are planted through the store's own
upload path (RemoteTier.upload of real committed local steps).
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import torch

from tieredckpt import CheckpointStore
from tieredckpt._tiers.remote import RemoteTier
from tieredckpt._tiers.sharded import save_sharded

PART = 64 << 10


def state(step: int) -> dict:
    """Three 64 KiB tensors whose bytes change every step: three new objects per step."""
    return {name: torch.full((PART // 4,), float(step * 3 + i)) for i, name in enumerate("abc")}


def plant(tmp_path, url: str, options: dict, steps: range) -> None:
    remote = RemoteTier(url, options, part_size=PART, concurrency=4)

    def one(step: int) -> None:
        local = tmp_path / "plant" / f"step_{step:06d}"
        remote.upload(local, save_sharded([state(step)], local, step), codec="raw")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, steps))
    remote.close()


def kind(line: str) -> str:
    """A request by what it does: its method and the sort of key (no step numbers, no object names)."""
    method, _, path = line.partition(" ")
    if "list-type" in path or "prefix=" in path:
        return f"{method} list"
    path = re.sub(r"step_\d+", "step_N", path.split("?")[0])
    path = re.sub(r"/objects/[^/]+", "/objects/X", path)
    return f"{method} {path.split('/run/', 1)[-1]}"


def commit_requests(tmp_path, proxied, name: str, step: int) -> Counter:
    """The requests the upload and commit of ``step`` make (the lease's renewals, on a timer, aside)."""
    with CheckpointStore(tmp_path / name, proxied.url, remote_options=proxied.options,
                         upload_part_size=PART, compression=None) as store:
        store.save(step, state(step)).wait()
        assert store.wait(uploads=True, timeout=60)  # the first upload: open, lease, probe done
        proxied.proxy.reset_counts()
        store.save(step + 1, state(step + 1)).wait()
        assert store.wait(uploads=True, timeout=60)
        counted = Counter(kind(r) for r in proxied.proxy.calls())
    return Counter({k: n for k, n in counted.items() if "writer.json" not in k})


def test_a_commit_makes_the_same_requests_with_1_and_with_500_kept_steps(tmp_path, proxied):
    alone = commit_requests(tmp_path, proxied, "alone", 1000)
    plant(tmp_path, proxied.url, proxied.direct, range(1, 501))
    held = proxied.remote().t.list_files("objects")
    assert len(held) >= 1500 + 3, len(held)  # more than one listing page of objects
    crowded = commit_requests(tmp_path, proxied, "crowded", 2000)
    assert crowded == alone, (crowded, alone)
    assert alone["PUT objects/X"] == 3  # the step's three parts, each sent once
