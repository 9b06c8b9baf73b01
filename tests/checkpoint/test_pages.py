"""``release_pages``: drops the resident pages of tensors read from a checkpoint file's mapping, and never touches any
other memory (dropping anonymous pages would zero them)."""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import save_file

from modelpatch.checkpoint import SafetensorsFile
from modelpatch.checkpoint.pages import in_file_mapping, release_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps")


def _resident(tensor: torch.Tensor) -> int:
    """Resident bytes of the mapping holding ``tensor`` (/proc/self/smaps)."""
    address, total, inside = tensor.data_ptr(), 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=5)
            if "-" in first[0] and len(first) >= 5 and ":" in first[3]:
                start, end = (int(x, 16) for x in first[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_pages_of_a_mapped_tensor_are_dropped_and_read_again(tmp_path):
    weight = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    save_file({"weight": weight}, tmp_path / "w.safetensors")
    with SafetensorsFile.open(tmp_path / "w.safetensors") as f:
        mapped = f.tensor("weight")
        assert in_file_mapping(mapped) and in_file_mapping(mapped[3:9])
        assert torch.equal(mapped, weight)  # every page touched: resident
        before = _resident(mapped)
        assert before >= weight.numel() * 4
        release_pages(mapped)
        assert _resident(mapped) <= before - weight.numel() * 4 + 2 * 4096
        assert torch.equal(mapped, weight)  # read from the file again


def test_other_memory_is_never_touched():
    weight = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    kept = weight.clone()
    assert not in_file_mapping(weight)
    release_pages(weight)
    assert torch.equal(weight, kept)
    assert not in_file_mapping(torch.empty(0))
