"""``stream_checkpoint``: the files ``write_checkpoint`` (safetensors' own ``save_file``) writes, one tensor at a
time."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from modelpatch.checkpoint.writer import stream_checkpoint, write_checkpoint
from modelpatch.errors import CheckpointError


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "model.layers.0.weight": torch.randn(16, 8, generator=generator).to(torch.bfloat16),
        "model.layers.1.weight": torch.randn(8, 8, generator=generator).to(torch.bfloat16),
        "model.norm.weight": torch.randn(8, generator=generator),
        "positions": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(5, dtype=torch.uint8),
        "half": torch.randn(3, 2, generator=generator).to(torch.float16),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        'naïve "quoted" key': torch.ones(2, dtype=torch.int32),
    }


def _stream(tensors: dict[str, torch.Tensor], events: list[str] | None = None):
    def produce(keys: list[str]):
        for key in keys:
            if events is not None:
                events.append(f"asked {key}")
            yield key, tensors[key]

    return produce


def _meta(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: torch.empty(t.shape, dtype=t.dtype, device="meta") for key, t in tensors.items()}


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("max_shard_size", ["50GB", "200B"])
def test_streamed_files_are_byte_for_byte_those_of_save_file(tmp_path, max_shard_size):
    tensors = _tensors()
    extra = {"config.json": b"{}"}
    written = write_checkpoint(tmp_path / "saved", tensors, extra_files=extra, max_shard_size=max_shard_size)
    streamed = stream_checkpoint(
        tmp_path / "streamed", _meta(tensors), _stream(tensors), extra_files=extra, max_shard_size=max_shard_size
    )
    assert [p.name for p in streamed] == [p.name for p in written]
    assert _files(tmp_path / "streamed") == _files(tmp_path / "saved")
    if max_shard_size == "200B":
        assert len(streamed) > 3  # shards and index
    loaded = {}
    for path in (tmp_path / "streamed").glob("*.safetensors"):
        loaded.update(load_file(path))
    for key, tensor in tensors.items():
        assert torch.equal(loaded[key], tensor), key


def test_metadata_is_kept(tmp_path):
    """(safetensors writes the entries of a larger metadata dict in a random order: only one entry is bitwise
    stable.)"""
    tensors = _tensors()
    stream_checkpoint(tmp_path / "out", _meta(tensors), _stream(tensors), metadata={"note": "kept"})
    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt", "note": "kept"}


def test_each_tensor_is_written_before_the_next_is_asked_for(tmp_path):
    tensors = _tensors()
    events: list[str] = []
    stream_checkpoint(
        tmp_path / "out",
        _meta(tensors),
        _stream(tensors, events),
        written=lambda nbytes: events.append(f"wrote {nbytes}"),
    )
    asked = [event for event in events if event.startswith("asked")]
    assert len(asked) == len(tensors)
    assert all(a.startswith("asked") and b.startswith("wrote") for a, b in zip(events[::2], events[1::2], strict=True))


@pytest.mark.parametrize(
    "fault, message",
    [
        ("wrong key", "gave 'bytes' where"),
        ("wrong shape", "planned as"),
        ("wrong dtype", "planned as"),
        ("too few", "ended before"),
        ("too many", "more tensors"),
    ],
)
def test_a_stream_that_breaks_its_plan_writes_nothing(tmp_path, fault, message):
    tensors = _tensors()
    target = tmp_path / "out"
    write_checkpoint(target, {"previous": torch.ones(2)})
    before = _files(target)

    def produce(keys: list[str]):
        for key in keys:
            tensor = tensors[key]
            if key == "model.norm.weight":
                if fault == "wrong key":
                    key = "bytes"
                elif fault == "wrong shape":
                    tensor = tensor[:4]
                elif fault == "wrong dtype":
                    tensor = tensor.double()
                elif fault == "too few":
                    return
            yield key, tensor
        if fault == "too many":
            yield "extra", torch.ones(1)

    with pytest.raises(CheckpointError, match=message):
        stream_checkpoint(target, _meta(tensors), produce)
    assert _files(target) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary directory left
