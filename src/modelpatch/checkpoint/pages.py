"""The resident pages of checkpoint files mapped into memory: which tensors view them, and dropping those pages.

Tensors read from a safetensors file are views of a private (copy-on-write) mapping of it. Once such a tensor has
been copied or converted, the pages it was read from stay resident in the mapping and count towards the process's
memory; they can be dropped, as the kernel reads a dropped page of a file mapping from the file again if it is
touched. Dropping pages of any other memory would zero them, so this module keeps the address range of every
mapping it is told of and acts on tensors lying inside one only.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import weakref
from collections.abc import Callable

import torch

# Start address -> end address of each live private file mapping registered; an entry goes with its mapping.
_mappings: dict[int, int] = {}


def register_mapping(mapping: mmap.mmap) -> None:
    """Record ``mapping`` (a private mapping of a file) as one whose pages :func:`release_pages` may drop."""
    if len(mapping) == 0:
        return
    # frombuffer shares the mapping's memory: its address is the mapping's start.
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    _mappings[start] = start + len(mapping)
    weakref.finalize(mapping, _mappings.pop, start, None)


def in_file_mapping(tensor: torch.Tensor) -> bool:
    """Whether the memory of ``tensor`` lies inside a registered file mapping."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return False
    first = tensor.untyped_storage().data_ptr()
    last = first + tensor.untyped_storage().nbytes()
    return any(start <= first and last <= end for start, end in _mappings.items())


def _find_madvise() -> Callable[[int, int], object] | None:
    advice = getattr(mmap, "MADV_DONTNEED", None)
    if advice is None or not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return lambda address, length: madvise(address, length, advice)


_madvise = _find_madvise()


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages lying wholly inside ``tensor`` when it views a registered file mapping (pages shared
    with a neighbouring tensor are kept); a no-op for any other tensor, and where the platform cannot drop pages."""
    if _madvise is None or not in_file_mapping(tensor):
        return
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _madvise(first, last - first)
