"""FSDP2 and tensor-parallel state (DTensors) through the store: real gloo process groups on CPU.

A tiny transformer is trained a few AdamW steps under ``fully_shard`` (and a 2-D
FSDP x TP mesh), saved by the store, and restored onto other meshes: every full
tensor must be bit-identical to the gathered original, and training must go on
bit-identically where the layout is unchanged.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import forkserver
import pytest
from test_ranks import launch, results

from tieredckpt._format.manifest import ShardManifest
from tieredckpt._format.shardheader import read_header
from tieredckpt.errors import ChecksumMismatchError

WORKER = Path(__file__).with_name("fsdp_worker.py")


def run(world: int, scenario: str, run_dir, ref, mesh: str, *extra) -> list[dict]:
    return results(launch(world, [str(WORKER), scenario, str(run_dir), str(ref), "--mesh", mesh, *extra]))


def alone(scenario: str, run_dir, ref, *extra) -> dict:
    """The worker as one plain process: no process group, an unsharded model."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    proc = forkserver.shared().popen([str(WORKER), scenario, str(run_dir), str(ref), *extra], env=env)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory):
    """A 4-rank FSDP2 run saved at step 3 (and its gathered state, and its losses after)."""
    base = tmp_path_factory.mktemp("fsdp4")
    saved = run(4, "save", base / "run", base / "ref.bin", "4")
    return base, saved


def fresh_copy(base: Path, tmp_path: Path) -> Path:
    shutil.copytree(base / "run", tmp_path / "run")
    return tmp_path / "run"


def test_fsdp2_state_is_saved_as_pieces_once_for_all_ranks(fsdp4):
    base, _ = fsdp4
    manifest = ShardManifest.from_json((base / "run" / "step_000003" / "manifest.json").read_text())
    assert manifest.world_size == 4 and manifest.layout == "dtensor"
    pieces = sum(split_bytes(base / "run" / "step_000003" / e.path)[1] for e in manifest.shards)
    ref = read_header(base / "ref.bin")
    params_m_v = sum(e["data_offsets"][1] - e["data_offsets"][0] for k, e in ref.items()
                     if k != "__metadata__" and not k.endswith("/step"))
    assert pieces == params_m_v  # every parameter, m and v exactly once in all, not once per rank


def split_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the header and the plain tensors before the pieces, bytes of the pieces) of a shard."""
    from tieredckpt._format.tree import piece_nodes
    header = read_header(path)
    meta = json.loads(header.pop("__metadata__")["tieredckpt"])
    names = {meta["names"][n["t"]] for _, n in piece_nodes(meta["tree"]) if n.get("t") is not None}
    size = {k: e["data_offsets"][1] - e["data_offsets"][0] for k, e in header.items()}
    front = path.stat().st_size - sum(size.values()) + sum(v for k, v in size.items() if k not in names)
    return front, sum(v for k, v in size.items() if k in names)


@pytest.mark.parametrize("world", [4, 2])
def test_fsdp2_restores_bit_identical_at_4_and_2_ranks(fsdp4, tmp_path, world):
    base, saved = fsdp4
    restored = run(world, "restore", fresh_copy(base, tmp_path), base / "ref.bin", str(world))
    assert restored[0]["diff"] is None
    assert all(r["step"] == 3 for r in restored)
    if world == 4:  # the same layout: training goes on exactly as the saving run did
        assert [r["losses"] for r in restored] == [s["losses"] for s in saved]
        # and each rank's RNG comes back from its own shard (they differ per rank)
        assert [r["next_random"] for r in restored] == [s["next_random"] for s in saved]
        assert len({str(s["next_random"]) for s in saved}) == 4
    else:  # 4 -> 2: each rank read exactly the saved pieces its shards overlap, nothing more
        assert all(r["read"] == r["need"] for r in restored), [(r["read"], r["need"]) for r in restored]


def test_fsdp2_checkpoint_restores_into_an_unsharded_model_on_one_process(fsdp4, tmp_path):
    base, _ = fsdp4
    out = alone("restore", fresh_copy(base, tmp_path), base / "ref.bin")
    assert out["diff"] is None and out["step"] == 3


def test_unsharded_checkpoint_restores_into_fsdp2_at_2_ranks(tmp_path):
    alone("save", tmp_path / "run", tmp_path / "ref.bin")
    restored = run(2, "restore", tmp_path / "run", tmp_path / "ref.bin", "2")
    assert restored[0]["diff"] is None


def test_fsdp2_overlapped_save_is_exactly_the_saved_step(tmp_path):
    saved = run(2, "save", tmp_path / "run", tmp_path / "ref.bin", "2", "--overlap")  # training went on at once
    restored = run(2, "restore", tmp_path / "run", tmp_path / "ref.bin", "2")
    assert restored[0]["diff"] is None and [r["losses"] for r in restored] == [s["losses"] for s in saved]


def test_2d_fsdp_x_tp_mesh_restores_at_another_shape(tmp_path):
    run(4, "save", tmp_path / "run", tmp_path / "ref.bin", "2x2")
    restored = run(2, "restore", tmp_path / "run", tmp_path / "ref.bin", "1x2")
    assert restored[0]["diff"] is None
    assert alone("restore", tmp_path / "run", tmp_path / "ref.bin")["diff"] is None


PART = 16 << 10


@pytest.fixture(scope="module")
def from_s3(tmp_path_factory, moto_server):
    """A 4-rank FSDP2 run saved to S3 from node-local dirs, in small parts (a state large beside its
    headers), every machine then gone; two fresh machines restore it at 2 ranks from the bucket.
    Returns their reports, and what any rank must fetch besides its pieces (``overhead``: every
    shard's header and plain tensors, in whole parts, and at most one part more at each end of
    the run of pieces it needs from a shard) and the bytes of every shard (``total``)."""
    base = tmp_path_factory.mktemp("from_s3")
    bucket = f"fsdp-{os.getpid()}"
    moto_server.make_bucket(bucket)
    remote = ["--remote", f"s3://{bucket}/run", "--remote-options", json.dumps(moto_server.options()),
              "--part-size", str(PART), "--width", "128"]
    run(4, "save", base / "old{rank}", base / "ref.bin", "4", *remote)
    total = sum(e.size for e in ShardManifest.from_json(
        (base / "old0" / "step_000003" / "manifest.json").read_text()).shards)
    fronts = [split_bytes(base / f"old{r}" / "step_000003" / f"rank{r}.bin")[0] for r in range(4)]
    overhead = sum(-(-f // PART) * PART + 2 * PART for f in fronts)
    for rank in range(4):
        shutil.rmtree(base / f"old{rank}")  # every machine is gone; only the bucket is left
    restored = run(2, "restore", base / "new{rank}", base / "ref.bin", "2", *remote)
    return restored, overhead, total


def test_fresh_machines_restore_fsdp2_state_from_s3_at_another_world_size(from_s3):
    restored, _, _ = from_s3
    assert restored[0]["diff"] is None and all(r["step"] == 3 for r in restored)


def test_a_fresh_machine_downloads_only_the_remote_parts_its_pieces_lie_in(from_s3):
    restored, overhead, total = from_s3
    for r in restored:  # each of 2 ranks needs half of the pieces: it fetched their parts, not every shard
        assert r["need"] <= r["fetched"] <= r["need"] + overhead < total, (r, overhead, total)


def test_a_corrupt_local_piece_is_refused_and_read_from_the_remote(tmp_path, moto_server):
    bucket = f"rot-{os.getpid()}"
    moto_server.make_bucket(bucket)
    remote = ["--remote", f"s3://{bucket}/run", "--remote-options", json.dumps(moto_server.options())]
    run(2, "save", tmp_path / "run", tmp_path / "ref.bin", "2", *remote)
    shard = tmp_path / "run" / "step_000003" / "rank1.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40  # one bit of one saved piece rots on the local disk
    shard.write_bytes(bytes(data))
    restored = run(2, "restore", tmp_path / "run", tmp_path / "ref.bin", "2", *remote)
    assert restored[0]["diff"] is None and all(r["step"] == 3 for r in restored)


def test_a_rank_killed_mid_save_commits_nothing_and_the_previous_step_loads(tmp_path):
    procs = launch(4, [str(WORKER), "killed", str(tmp_path / "run"), str(tmp_path / "ref.bin"),
                       "--mesh", "4", "--kill-rank", "2"])
    outs = [proc.communicate(timeout=240)[0] for proc in procs]
    assert procs[2].returncode == -9
    for rank in (0, 1, 3):  # the others learn that the step failed; none claims it saved
        assert "error" in json.loads(outs[rank].strip().splitlines()[-1]), outs[rank]
    committed = [p.name for p in (tmp_path / "run").iterdir() if ".tmp-" not in p.name and p.name.startswith("step_")]
    assert committed == ["step_000001"]  # only scratch of step 2 is left, removed by the next save
    restored = run(4, "restore", tmp_path / "run", tmp_path / "ref.bin", "4")
    assert all(r["step"] == 1 for r in restored)


# ---- torch.distributed.checkpoint through the store's writer and reader --------------------

def test_dcp_save_at_4_ranks_loads_at_4_and_2_bit_identical(tmp_path):
    saved = run(4, "save", tmp_path / "run", tmp_path / "ref.bin", "4", "--dcp", "save")
    manifest = ShardManifest.from_json((tmp_path / "run" / "step_000003" / "manifest.json").read_text())
    assert manifest.world_size == 4  # committed by the store's protocol, not DCP's .metadata
    assert not list((tmp_path / "run").rglob("*.distcp")) and not list((tmp_path / "run").rglob(".metadata"))
    same = run(4, "restore", tmp_path / "run", tmp_path / "ref.bin", "4", "--dcp", "save")
    assert same[0]["diff"] is None and [r["losses"] for r in same] == [s["losses"] for s in saved]
    fewer = run(2, "restore", tmp_path / "run", tmp_path / "ref.bin", "2", "--dcp", "save")
    assert fewer[0]["diff"] is None and all(r["step"] == 3 for r in fewer)


def test_dcp_async_save_to_s3_loads_on_fresh_machines(tmp_path, moto_server):
    bucket = f"dcp-{os.getpid()}"
    moto_server.make_bucket(bucket)
    remote = ["--remote", f"s3://{bucket}/run", "--remote-options", json.dumps(moto_server.options())]
    run(2, "save", tmp_path / "old{rank}", tmp_path / "ref.bin", "2", "--dcp", "async_save", *remote)
    for rank in range(2):
        shutil.rmtree(tmp_path / f"old{rank}")
    restored = run(2, "restore", tmp_path / "new{rank}", tmp_path / "ref.bin", "2", "--dcp", "save", *remote)
    assert restored[0]["diff"] is None and all(r["step"] == 3 for r in restored)


def test_dcp_on_one_process_round_trips(tmp_path):
    alone("save", tmp_path / "run", tmp_path / "ref.bin", "--dcp", "save")
    out = alone("restore", tmp_path / "run", tmp_path / "ref.bin", "--dcp", "save")
    assert out["diff"] is None and out["step"] == 3


class Opaque:
    """Not plain data: loading it back would mean unpickling an arbitrary class."""


def test_dcp_refuses_an_entry_it_would_have_to_unpickle(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from tieredckpt import CheckpointStore

    with CheckpointStore(tmp_path / "run") as store:
        with pytest.raises(BaseException, match="'extra' is not plain data"):  # DCP wraps it
            dcp.save({"w": torch.ones(3), "extra": Opaque()}, storage_writer=store.dcp_writer(1), no_dist=True)
        assert store.list() == []  # nothing committed
        dcp.save({"w": torch.ones(3), "extra": {"lr": 0.1, "betas": (0.9, 0.95)}},
                 storage_writer=store.dcp_writer(2), no_dist=True)
        state = {"w": torch.zeros(3), "extra": {"lr": 0.0, "betas": None}}  # DCP loads the keys asked for
        dcp.load(state, storage_reader=store.dcp_reader(), no_dist=True)
        assert torch.equal(state["w"], torch.ones(3)) and state["extra"] == {"lr": 0.1, "betas": (0.9, 0.95)}


def test_dcp_load_of_a_corrupt_chunk_raises_before_touching_any_tensor(tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    from tieredckpt import CheckpointStore

    with CheckpointStore(tmp_path / "run") as store:
        dcp.save({"a": torch.ones(1000), "b": torch.full((1000,), 2.0)}, storage_writer=store.dcp_writer(1),
                 no_dist=True)
    shard = tmp_path / "run" / "step_000001" / "rank0.bin"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # the last chunk ("b") rots
    shard.write_bytes(bytes(data))
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    with CheckpointStore(tmp_path / "run") as store:
        with pytest.raises(BaseException, match="'dcp/tensors/1/1' fails its crc32c"):
            dcp.load(state, storage_reader=store.dcp_reader(), no_dist=True)
    assert torch.equal(state["a"], torch.zeros(1000)) and torch.equal(state["b"], torch.zeros(1000))


@pytest.mark.parametrize("edit", [
    (rb'\"o\":[0]', rb'\"o\":[9]'),              # a piece that lies outside its global tensor
    (rb'\"g\":[1000]', rb'\"g\":[9999]'),        # another global shape than the target's
    (rb'\"d\":\"float32\"', rb'\"d\":\"float64\"'),  # a dtype that does not match its bytes
    (rb'\"t\":1', rb'\"t\":7'),                  # a piece naming a tensor the shard does not hold
])
@pytest.mark.parametrize("unchecked_header", [False, True])
def test_a_hostile_piece_node_is_refused_by_name_and_nothing_loads(tmp_path, edit, unchecked_header):
    import torch
    import torch.distributed.checkpoint as dcp

    from tieredckpt import CheckpointStore, CorruptCheckpointError

    with CheckpointStore(tmp_path / "run") as store:  # one process: DCP chunks are stored as pieces too
        dcp.save({"a": torch.ones(1000), "b": torch.full((1000,), 2.0)}, storage_writer=store.dcp_writer(1),
                 no_dist=True)
    shard = tmp_path / "run" / "step_000001" / "rank0.bin"
    data = shard.read_bytes()
    old, new = edit
    assert old in data and len(old) == len(new)
    shard.write_bytes(data.replace(old, new, 1))  # the header changes: its crc32c in the manifest no longer matches
    if unchecked_header:  # as a manifest without header checksums (or one forged with it): the nodes are checked
        import json as _json

        from tieredckpt._format.manifest import DIGEST_KEY, canonical_digest
        path = tmp_path / "run" / "step_000001" / "manifest.json"
        raw = _json.loads(path.read_text())
        raw.pop(DIGEST_KEY)
        raw["shards"][0]["header_crc32c"] = ""
        raw[DIGEST_KEY] = canonical_digest(raw)
        path.write_text(_json.dumps(raw))
    state = {"a": torch.zeros(1000), "b": torch.zeros(1000)}
    with CheckpointStore(tmp_path / "run") as store:
        # (a forged global shape with no header checksum is, to DCP, a checkpoint of another size)
        with pytest.raises(BaseException, match=r"rank0\.bin|Size mismatch between saved") as failure:
            dcp.load(state, storage_reader=store.dcp_reader(), no_dist=True)
        assert "Traceback" not in str(failure.value).split("\n")[-1]
        with pytest.raises(CorruptCheckpointError, match=r"step_000001.*(rank0\.bin|dcp/tensors/0/1)"):
            store.restore()
    assert torch.equal(state["a"], torch.zeros(1000)) and torch.equal(state["b"], torch.zeros(1000))


def test_part_of_a_piece_reads_and_verifies_only_the_blocks_it_lies_in(tmp_path, monkeypatch):
    import torch

    from tieredckpt._format.boxes import Box
    from tieredckpt._format.pieces import Chunk
    from tieredckpt._format.shardfile import CRC_BLOCK
    from tieredckpt._tiers import assemble
    from tieredckpt._tiers.sharded import read_manifest, save_sharded

    whole = torch.arange(4096 * 512, dtype=torch.float32).reshape(4096, 512)  # 8 MiB: 8 blocks
    save_sharded([{"w": Chunk(whole, (4096, 512), (0, 0))}], tmp_path / "step_000001", 1)
    entry = read_manifest(tmp_path / "step_000001").shards[0]
    reads = []
    real = assemble._pread_into
    monkeypatch.setattr(assemble, "_pread_into", lambda fd, view, at: reads.append(len(view)) or real(fd, view, at))
    f = assemble.PieceFile(tmp_path / "step_000001" / entry.path, entry, "crc")
    piece = Box((0, 0), (4096, 512))
    for want in (Box((1000, 0), (1500, 512)), Box((7, 3), (9, 100)), Box((4095, 511), (1, 1))):
        reads.clear()
        got = f.part(0, piece, want)
        assert torch.equal(got, whole[want.relative_to(piece)])
        wanted = (want.shape[0] - 1) * 512 * 4 + want.shape[1] * 4  # first to last element, in bytes
        assert wanted <= sum(reads) <= wanted + 2 * CRC_BLOCK  # its blocks, not the 8 MiB piece
    f.close()
    path = tmp_path / "step_000001" / entry.path
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # rot in the last block: parts elsewhere still read, a part there is refused
    path.write_bytes(bytes(data))
    f = assemble.PieceFile(path, entry, "crc")
    assert torch.equal(f.part(0, piece, Box((0, 0), (10, 512))), whole[:10])
    with pytest.raises(ChecksumMismatchError, match="fails its crc32c"):
        f.part(0, piece, Box((4090, 0), (6, 512)))
    f.close()
