"""write_checkpoint: single and sharded output, size parsing, atomic swap and crash recovery."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from modelpatch.checkpoint import Checkpoint, write_checkpoint
from modelpatch.checkpoint.writer import parse_size
from modelpatch.errors import CheckpointError
from support.compare import assert_tensor_bitwise_equal


def _snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _siblings(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.parent.iterdir() if ".modelpatch-" in p.name)


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "layer.0.weight": torch.randn(16, 16, generator=gen),  # 1024 bytes
        "layer.0.bias": torch.randn(16, generator=gen),  # 64 bytes
        "layer.1.weight": torch.randn(16, 16, generator=gen).to(torch.bfloat16),  # 512 bytes
        "scale": torch.tensor(2.0),
        "empty": torch.zeros(0, 4),
    }


def test_single_file(tmp_path: Path, tensors) -> None:
    out = tmp_path / "ckpt"
    written = write_checkpoint(out, tensors, extra_files={"config.json": b'{"a": 1}'}, metadata={"origin": "test"})
    assert written == [out / "model.safetensors", out / "config.json"]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "config.json").read_bytes() == b'{"a": 1}'
    loaded = load_file(str(out / "model.safetensors"))
    assert loaded.keys() == tensors.keys()
    for key, ref in tensors.items():
        assert_tensor_bitwise_equal(loaded[key], ref, key)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt", "origin": "test"}
    assert _siblings(out) == []


def test_sharded(tmp_path: Path, tensors) -> None:
    out = tmp_path / "ckpt"
    written = write_checkpoint(out, tensors, max_shard_size="1KB")
    # Sorted keys, greedy: [empty, layer.0.bias] | [layer.0.weight (1024 > 1000, alone)] | [layer.1.weight, scale]
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert written == [out / n for n in names] + [out / "model.safetensors.index.json"]
    raw_index = (out / "model.safetensors.index.json").read_text()
    expected_index = {
        "metadata": {"total_size": 1024 + 64 + 512 + 4},
        "weight_map": {
            "empty": names[0],
            "layer.0.bias": names[0],
            "layer.0.weight": names[1],
            "layer.1.weight": names[2],
            "scale": names[2],
        },
    }
    assert raw_index == json.dumps(expected_index, indent=2, sort_keys=True) + "\n"
    with Checkpoint.open(out) as ckpt:
        assert ckpt.is_sharded and ckpt.keys() == sorted(tensors)
        for key, ref in tensors.items():
            assert_tensor_bitwise_equal(ckpt.tensor(key), ref, key)


def test_total_equal_to_limit_is_single_file(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "c", {"a": torch.zeros(25)}, max_shard_size=100)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["model.safetensors"]


@pytest.mark.parametrize(
    ("size", "expected"),
    [("50GB", 50 * 10**9), ("500MB", 500 * 10**6), ("10KB", 10_000), ("1.5kb", 1500), ("2GiB", 2 * 2**30), (123, 123)],
)
def test_parse_size(size: int | str, expected: int) -> None:
    assert parse_size(size, context=Path("x")) == expected


@pytest.mark.parametrize("size", ["abc", "10XB", "", 0, -5, "0MB", True])
def test_parse_size_rejects(tmp_path: Path, size: object) -> None:
    with pytest.raises(CheckpointError, match="ckpt"):
        write_checkpoint(tmp_path / "ckpt", {"a": torch.ones(1)}, max_shard_size=size)  # type: ignore[arg-type]


def _existing_checkpoint(tmp_path: Path) -> Path:
    out = tmp_path / "ckpt"
    write_checkpoint(out, {"old": torch.ones(3)}, extra_files={"config.json": b"old"})
    (out / "tokenizer.json").write_text("tok")
    return out


def test_failure_mid_write_leaves_previous_checkpoint_untouched(tmp_path: Path) -> None:
    out = _existing_checkpoint(tmp_path)
    before = _snapshot(out)
    # "a" fills shard 1, which is written; "z" is an unmaterialized (meta) parameter that fails in shard 2.
    bad = {"a": torch.ones(100), "z": torch.empty(100, device="meta")}
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors.*'z'"):
        write_checkpoint(out, bad, extra_files={"config.json": b"new"}, max_shard_size=400)
    assert _snapshot(out) == before
    assert _siblings(out) == []


@pytest.mark.parametrize("name", ["sub/config.json", "../config.json", "..", "", "model.safetensors", "x.safetensors"])
def test_bad_extra_file_names_rejected_before_writing(tmp_path: Path, name: str) -> None:
    out = _existing_checkpoint(tmp_path)
    before = _snapshot(out)
    with pytest.raises(CheckpointError, match="ckpt"):
        write_checkpoint(out, {"a": torch.ones(1)}, extra_files={name: b"x"})
    assert _snapshot(out) == before
    assert _siblings(out) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"tensors": {"a": [1.0]}},
        {"tensors": {1: torch.ones(1)}},
        {"metadata": {"k": 1}},
        {"extra_files": {"config.json": "text, not bytes"}},
    ],
)
def test_invalid_arguments(tmp_path: Path, bad: dict) -> None:
    kwargs = {"tensors": {"a": torch.ones(1)}, **bad}
    with pytest.raises(CheckpointError, match="ckpt"):
        write_checkpoint(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()


def test_overwrite_preserves_unrelated_user_files(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    write_checkpoint(out, {"a": torch.ones(300), "b": torch.ones(300)}, max_shard_size=2000)  # sharded
    (out / "tokenizer.json").write_text("tok")
    (out / "adapter_model.safetensors").write_bytes(b"user adapter")
    (out / "notes").mkdir()
    (out / "notes" / "readme.md").write_text("hi")
    (out / "config.json").write_text("old config")

    write_checkpoint(out, {"a": torch.zeros(2)}, extra_files={"config.json": b"new config"})
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_model.safetensors",
        "config.json",
        "model.safetensors",
        "notes",
        "tokenizer.json",
    ]
    assert (out / "tokenizer.json").read_text() == "tok"
    assert (out / "notes" / "readme.md").read_text() == "hi"
    assert (out / "config.json").read_bytes() == b"new config"
    assert Checkpoint.open(out).keys() == ["a"]
    assert _siblings(out) == []


def test_stale_siblings_removed(tmp_path: Path) -> None:
    out = _existing_checkpoint(tmp_path)
    (tmp_path / ".ckpt.modelpatch-tmp-dead").mkdir()
    (tmp_path / ".ckpt.modelpatch-tmp-dead" / "model.safetensors").write_bytes(b"partial")
    (tmp_path / ".ckpt.modelpatch-old-dead").mkdir()
    (tmp_path / ".other.modelpatch-tmp-keep").mkdir()  # belongs to a different directory
    write_checkpoint(out, {"new": torch.ones(1)})
    assert _siblings(out) == [".other.modelpatch-tmp-keep"]
    assert Checkpoint.open(out).keys() == ["new"]


def test_old_sibling_restored_when_target_missing(tmp_path: Path) -> None:
    # A save killed between "rename ckpt -> old" and "rename tmp -> ckpt" leaves only the old sibling.
    out = _existing_checkpoint(tmp_path)
    old = tmp_path / ".ckpt.modelpatch-old-0123"
    out.rename(old)
    (tmp_path / ".ckpt.modelpatch-tmp-4567").mkdir()
    write_checkpoint(out, {"new": torch.ones(1)})
    assert (out / "tokenizer.json").read_text() == "tok"  # carried over from the restored version
    assert (out / "config.json").read_bytes() == b"old"
    assert Checkpoint.open(out).keys() == ["new"]
    assert _siblings(out) == []


def test_rewrite_directory_that_is_being_read(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    write_checkpoint(out, {"w": torch.arange(8.0)})
    ckpt = Checkpoint.open(out)
    w = ckpt.tensor("w")  # memory-mapped from the file about to be replaced
    write_checkpoint(out, {"w": w * 2})
    assert w.tolist() == [float(i) for i in range(8)]
    assert Checkpoint.open(out).tensor("w").tolist() == [2.0 * i for i in range(8)]


def test_shared_storage_rejected(tmp_path: Path) -> None:
    w = torch.randn(4, 4)
    with pytest.raises(CheckpointError, match=r"'lm_head\.weight'.*'embed\.weight'|'embed\.weight'.*'lm_head\.weight'"):
        write_checkpoint(tmp_path / "ckpt", {"embed.weight": w, "lm_head.weight": w})
    with pytest.raises(CheckpointError, match="share memory"):
        write_checkpoint(tmp_path / "ckpt", {"full": w, "row": w[1]})
    with pytest.raises(CheckpointError, match="share memory"):
        write_checkpoint(tmp_path / "ckpt", {"full": w, "t": w.t()})
    assert not (tmp_path / "ckpt").exists()


def test_disjoint_views_of_one_storage_allowed(tmp_path: Path) -> None:
    qkv = torch.randn(6, 4)
    q, k, v = qkv.chunk(3)
    other = torch.randn(4, 6)
    parts = {"q": q, "k": k, "v": v, "other_t": other.t()}  # other_t: non-contiguous, sole user of its storage
    write_checkpoint(tmp_path / "ckpt", parts)
    with Checkpoint.open(tmp_path / "ckpt") as ckpt:
        for key, ref in parts.items():
            assert_tensor_bitwise_equal(ckpt.tensor(key), ref, key)


def test_target_must_not_be_a_file_or_symlink(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file: exists and is not a directory"):
        write_checkpoint(tmp_path / "file", {"a": torch.ones(1)})
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(CheckpointError, match="link: is a symlink"):
        write_checkpoint(tmp_path / "link", {"a": torch.ones(1)})


def test_creates_missing_parents_and_empty_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "a" / "b" / "ckpt"
    assert write_checkpoint(out, {}) == [out / "model.safetensors"]
    assert Checkpoint.open(out).keys() == []


def test_single_file_bytes_match_plain_save_file(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    save_file({"x": torch.ones(1)}, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    write_checkpoint(out, {"x": torch.ones(1)})
    assert (out / "model.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
