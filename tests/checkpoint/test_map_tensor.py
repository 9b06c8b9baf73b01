"""``SafetensorsFile.map_tensor``: each tensor a view of a mapping of its own (a disk offload's reads)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelpatch.checkpoint import SafetensorsFile
from modelpatch.errors import CheckpointError
from support.compare import assert_tensor_bitwise_equal


def test_map_tensor_every_dtype_bitwise(tmp_path: Path, dtype_samples) -> None:
    path = tmp_path / "all.safetensors"
    save_file({**dtype_samples, "empty": torch.empty(0, 3)}, str(path))
    data = path.read_bytes()
    expected = load_file(str(path))
    with SafetensorsFile.open(path) as f:
        for key, ref in expected.items():
            mapped = f.map_tensor(key)
            assert_tensor_bitwise_equal(mapped, ref)
            if mapped.numel():
                # A private mapping of its own: writing to it changes neither the file nor the next read.
                assert mapped.untyped_storage().data_ptr() != f.map_tensor(key).untyped_storage().data_ptr()
                mapped.reshape(-1).view(torch.uint8)[0] ^= 0xFF
                assert_tensor_bitwise_equal(f.map_tensor(key), ref)
    assert path.read_bytes() == data


def test_map_tensor_refuses_a_file_rewritten_since_open(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(100, dtype=torch.float32)}, str(path))
    with SafetensorsFile.open(path) as f:
        with open(path, "r+b") as file:
            file.seek(-4, os.SEEK_END)
            file.write(b"\xff\xff\xff\xff")
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        with pytest.raises(CheckpointError, match=r"w\.safetensors: the file changed"):
            f.map_tensor("a")
