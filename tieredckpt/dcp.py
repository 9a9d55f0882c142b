"""torch.distributed.checkpoint on the store's tiers (see _loop/dcp.py).

    dcp.save(state, storage_writer=store.dcp_writer(step))
    dcp.load(state, storage_reader=store.dcp_reader())
"""

from ._loop.dcp import TieredReader, TieredWriter

__all__ = ["TieredReader", "TieredWriter"]
