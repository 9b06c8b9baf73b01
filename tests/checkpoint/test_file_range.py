"""``FileRange``: a tensor's bytes in a safetensors file, copied into another file file to file (or, where the kernel
cannot, read and written), and written by ``stream_checkpoint`` exactly as the tensor itself would be."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from modelpatch.checkpoint import SafetensorsFile
from modelpatch.checkpoint.writer import stream_checkpoint
from modelpatch.errors import CheckpointError


@pytest.fixture
def source(tmp_path: Path) -> Path:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(64, 32, generator=generator).to(torch.bfloat16),
        "b": torch.randn(16, 32, generator=generator).to(torch.bfloat16),
        "c": torch.arange(10, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "source.safetensors")
    return tmp_path / "source.safetensors"


def _bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_range_holds_the_tensor_bytes_and_narrows_to_its_rows(source, tmp_path):
    with SafetensorsFile.open(source) as f:
        whole = f.file_range("a")
        row_bytes = 32 * 2
        rows = whole.narrow(3 * row_bytes, 5 * row_bytes)
        out = tmp_path / "out.bin"
        with out.open("wb") as target:
            whole.copy_to(target.fileno())
            rows.copy_to(target.fileno())
        assert out.read_bytes() == _bytes(f.tensor("a")) + _bytes(f.tensor("a")[3:8])
        with pytest.raises(ValueError, match="outside"):
            whole.narrow(row_bytes, whole.length)


def test_a_target_the_kernel_cannot_copy_into_is_written_through_memory(source):
    """copy_file_range refuses a pipe (EINVAL): the bytes are read and written instead."""
    with SafetensorsFile.open(source) as f:
        file_range = f.file_range("b")
        read, write = os.pipe()
        try:
            file_range.copy_to(write)
            os.close(write)
            with os.fdopen(read, "rb") as pipe:
                assert pipe.read() == _bytes(f.tensor("b"))
        finally:
            for fd in (read, write):
                try:
                    os.close(fd)
                except OSError:
                    pass


def test_a_file_truncated_under_a_range_is_refused_by_name(source, tmp_path):
    with SafetensorsFile.open(source) as f:
        file_range = f.file_range("c")
        os.truncate(source, file_range.start + 8)  # rewritten in place: the range now runs past its end
        with (tmp_path / "out.bin").open("wb") as target, pytest.raises(CheckpointError, match="source.safetensors"):
            file_range.copy_to(target.fileno())


def test_streamed_ranges_write_the_files_the_tensors_would(source, tmp_path):
    """A fused tensor given as its parts' ranges (rows of a, then b) is the file stock safetensors writes for it."""
    with SafetensorsFile.open(source) as f:
        fused = torch.cat([f.tensor("a")[:32], f.tensor("b")])
        tensors = {"fused": fused, "c": f.tensor("c")}
        half = f.file_range("a").narrow(0, 32 * 32 * 2)
        given = {"fused": [half, f.file_range("b")], "c": [f.file_range("c")]}
        layout = {key: torch.empty_like(t, device="meta") for key, t in tensors.items()}
        stream_checkpoint(tmp_path / "ranges", layout, lambda keys: ((key, given[key]) for key in keys))
        stream_checkpoint(tmp_path / "tensors", layout, lambda keys: ((key, tensors[key]) for key in keys))
        # A range of the wrong size is refused before anything is swapped in.
        given["c"] = [f.file_range("c").narrow(0, 8)]
        with pytest.raises(CheckpointError, match="'c' is given as 8 bytes"):
            stream_checkpoint(tmp_path / "short", layout, lambda keys: ((key, given[key]) for key in keys))
    written = (tmp_path / "ranges" / "model.safetensors").read_bytes()
    assert written == (tmp_path / "tensors" / "model.safetensors").read_bytes()
    save_file({key: t.clone() for key, t in tensors.items()}, tmp_path / "stock.safetensors", metadata={"format": "pt"})
    assert written == (tmp_path / "stock.safetensors").read_bytes()
    assert not (tmp_path / "short").exists()
