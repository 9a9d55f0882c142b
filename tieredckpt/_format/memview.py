"""Byte views of tensor memory without NumPy (torch does not require it).

``byte_view(t)`` is a writable ``memoryview`` over a contiguous CPU tensor's
bytes: it can be written to a file, hashed, or filled with ``readinto``, with
no copy. The view keeps the tensor alive, so its memory cannot be freed
underneath it.
"""

from __future__ import annotations

import ctypes

import torch


def byte_view(t: torch.Tensor) -> memoryview:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous CPU tensor")
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(bytearray())
    array = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    array._owner = t  # the view -> array -> tensor keeps it alive
    return memoryview(array).cast("B")
