"""Shared fixtures for the checkpoint layer tests: real files on disk, no mocks."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


@pytest.fixture
def write_raw() -> Callable[[Path, object, bytes], Path]:
    """Write a safetensors file by hand: 8-byte length, header (dict -> JSON, or raw bytes), data."""

    def _write(path: Path, header: object, data: bytes = b"") -> Path:
        raw = header if isinstance(header, bytes) else json.dumps(header).encode("utf-8")
        path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
        return path

    return _write


def _dtype_samples() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    samples = {
        "f64": torch.randn(3, 2, dtype=torch.float64, generator=gen),
        "f32": torch.randn(4, 5, generator=gen),
        "f16": torch.randn(7, dtype=torch.float16, generator=gen),
        "bf16": torch.randn(2, 3, 4, dtype=torch.bfloat16, generator=gen),
        "i64": torch.arange(-5, 5, dtype=torch.int64),
        "i32": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "scalar_i64": torch.tensor(7, dtype=torch.int64),
        "empty": torch.zeros(0),
        "empty_2d": torch.zeros(2, 0, 3, dtype=torch.bfloat16),
        "odd_bytes": torch.ones(3, dtype=torch.int8),
        "after_odd": torch.randn(5, generator=gen),
    }
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            samples[name] = torch.arange(4, dtype=torch.uint8).to(getattr(torch, name))
    return samples


@pytest.fixture
def dtype_samples() -> dict[str, torch.Tensor]:
    """Tensors of every supported dtype, including 0-d and empty ones."""
    return _dtype_samples()
