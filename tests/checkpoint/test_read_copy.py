"""``SafetensorsFile.read``: tensors read as independent copies (a disk offload's reads), checked against the file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelpatch.checkpoint import SafetensorsFile
from modelpatch.errors import CheckpointError


def test_read_copies_every_dtype_bitwise(tmp_path: Path, dtype_samples, assert_same) -> None:
    path = tmp_path / "all.safetensors"
    save_file({**dtype_samples, "empty": torch.empty(0, 3)}, str(path))
    expected = load_file(str(path))
    with SafetensorsFile.open(path) as f:
        for key, ref in expected.items():
            copy = f.read(key)
            assert_same(copy, ref)
            if copy.numel():
                copy.reshape(-1).view(torch.uint8)[0] ^= 0xFF  # the copy is the caller's: the file is not touched
                assert_same(f.read(key), ref)


def test_read_refuses_a_file_rewritten_since_open(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(100, dtype=torch.float32)}, str(path))
    with SafetensorsFile.open(path) as f:
        with open(path, "r+b") as file:
            file.seek(-4, os.SEEK_END)
            file.write(b"\xff\xff\xff\xff")
        stat = os.stat(path)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        with pytest.raises(CheckpointError, match=r"w\.safetensors: the file changed"):
            f.read("a")


def test_read_unknown_key_and_closed_file(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_file({"a": torch.ones(3)}, str(path))
    f = SafetensorsFile.open(path)
    with pytest.raises(CheckpointError, match=r"c\.safetensors: no tensor named 'b'"):
        f.read("b")
    f.close()
    with pytest.raises(CheckpointError, match=r"c\.safetensors: file is closed"):
        f.read("a")
