"""Checkpoint: directory resolution, sharded indexes and their confinement, opt-in pickle loading."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelpatch.checkpoint import Checkpoint
from modelpatch.errors import CheckpointError
from support.compare import assert_tensor_bitwise_equal


def _write_index(directory: Path, weight_map: dict[str, str], name: str = "model.safetensors.index.json") -> Path:
    path = directory / name
    path.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return path


@pytest.fixture
def sharded_dir(tmp_path: Path) -> Path:
    """A valid two-shard safetensors checkpoint."""
    directory = tmp_path / "sharded"
    directory.mkdir()
    save_file({"a": torch.arange(4.0), "b": torch.ones(2, 2)}, str(directory / "s1.safetensors"), {"format": "pt"})
    save_file({"c": torch.tensor(5, dtype=torch.int64)}, str(directory / "s2.safetensors"))
    _write_index(directory, {"a": "s1.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"})
    return directory


def test_single_file(tmp_path: Path, dtype_samples) -> None:
    path = tmp_path / "model.safetensors"
    save_file(dtype_samples, str(path), metadata={"format": "pt"})
    with Checkpoint.open(tmp_path) as ckpt:
        assert ckpt.keys() == sorted(dtype_samples)
        assert not ckpt.is_sharded
        assert ckpt.files == [path]
        assert ckpt.metadata == {"format": "pt"}
        assert ckpt.total_bytes == sum(t.numel() * t.element_size() for t in dtype_samples.values())
        for key, ref in dtype_samples.items():
            assert ckpt.info(key).path == path
            assert_tensor_bitwise_equal(ckpt.tensor(key), ref, key)


def test_single_file_tensor_is_zero_copy(tmp_path: Path) -> None:
    save_file({"w": torch.randn(128, 128)}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint.open(tmp_path)
    a, b = ckpt.tensor("w"), ckpt.tensor("w")
    assert a.data_ptr() == b.data_ptr()
    ckpt.close()
    assert torch.equal(a, load_file(str(tmp_path / "model.safetensors"))["w"])


def test_sharded_index(sharded_dir: Path) -> None:
    with Checkpoint.open(str(sharded_dir)) as ckpt:
        assert ckpt.is_sharded
        assert ckpt.keys() == ["a", "b", "c"]
        assert ckpt.files == [sharded_dir / "s1.safetensors", sharded_dir / "s2.safetensors"]
        assert ckpt.info("c").path == sharded_dir / "s2.safetensors"
        assert ckpt.tensor("a").tolist() == [0.0, 1.0, 2.0, 3.0]
        assert ckpt.tensor("c").item() == 5
        assert ckpt.total_bytes == 16 + 16 + 8
        assert ckpt.metadata == {"format": "pt"}


def test_index_read_beside_a_single_file_of_the_same_tensors(sharded_dir: Path) -> None:
    tensors = {"a": torch.arange(4.0), "b": torch.ones(2, 2), "c": torch.tensor(5, dtype=torch.int64)}
    save_file(tensors, str(sharded_dir / "model.safetensors"))
    with Checkpoint.open(sharded_dir) as checkpoint:
        assert checkpoint.keys() == ["a", "b", "c"]
        assert checkpoint.is_sharded


@pytest.mark.parametrize(
    "single", [{"other": torch.ones(1)}, {"a": torch.arange(4.0), "b": torch.ones(2, 2), "c": torch.tensor(6)}]
)
def test_a_single_file_of_other_tensors_beside_an_index_is_refused_naming_both(sharded_dir: Path, single) -> None:
    save_file(single, str(sharded_dir / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"two checkpoints of different versions: model.safetensors.index.json"):
        Checkpoint.open(sharded_dir)


def test_shard_keys_missing_from_weight_map_are_included_with_warning(sharded_dir: Path, caplog) -> None:
    _write_index(sharded_dir, {"a": "s1.safetensors", "c": "s2.safetensors"})
    with caplog.at_level(logging.WARNING, logger="modelpatch.checkpoint"):
        ckpt = Checkpoint.open(sharded_dir)
    assert ckpt.keys() == ["a", "b", "c"]
    assert any(r.getMessage().endswith("missing from weight_map, included anyway: b") for r in caplog.records)


def test_unknown_key(sharded_dir: Path) -> None:
    ckpt = Checkpoint.open(sharded_dir)
    with pytest.raises(CheckpointError, match=r"sharded.*'zzz'"):
        ckpt.info("zzz")
    with pytest.raises(CheckpointError, match="'zzz'"):
        ckpt.tensor("zzz")


def test_not_a_local_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a local directory"):
        Checkpoint.open(tmp_path / "meta-llama/Llama-3-8B")
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="file: not a local directory"):
        Checkpoint.open(tmp_path / "file")


def test_empty_directory_lists_what_was_looked_for(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as excinfo:
        Checkpoint.open(tmp_path)
    for name in ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin"):
        assert name in str(excinfo.value)


def _outside_file(tmp_path: Path) -> Path:
    outside = tmp_path / "outside.safetensors"
    save_file({"a": torch.ones(1)}, str(outside))
    return outside


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink", "nested_dotdot"])
def test_shard_outside_directory_rejected(tmp_path: Path, kind: str) -> None:
    outside = _outside_file(tmp_path)
    directory = tmp_path / "ckpt"
    (directory / "sub").mkdir(parents=True)
    name = {
        "dotdot": "../outside.safetensors",
        "absolute": str(outside),
        "symlink": "link.safetensors",
        "nested_dotdot": "sub/../../outside.safetensors",
    }[kind]
    if kind == "symlink":
        (directory / "link.safetensors").symlink_to(outside)
    index = _write_index(directory, {"a": name})
    with pytest.raises(CheckpointError) as excinfo:
        Checkpoint.open(directory)
    assert index.name in str(excinfo.value) and repr(name) in str(excinfo.value)


def test_symlink_inside_directory_allowed(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    (directory / "blobs").mkdir(parents=True)
    save_file({"a": torch.ones(1)}, str(directory / "blobs" / "real"))
    (directory / "s.safetensors").symlink_to(directory / "blobs" / "real")
    _write_index(directory, {"a": "s.safetensors"})
    assert Checkpoint.open(directory).tensor("a").tolist() == [1.0]


def _hub_snapshot(tmp_path: Path, blob_folder: str, repo: str = "models--org--name", commit: str = "c" * 40) -> Path:
    """A huggingface_hub cache snapshot whose index and shard link (relatively) to blobs in ``blob_folder``."""
    snapshot = tmp_path / repo / "snapshots" / commit / "sub"
    snapshot.mkdir(parents=True)
    blobs = tmp_path / blob_folder
    blobs.mkdir(parents=True, exist_ok=True)
    save_file({"a": torch.ones(1)}, str(blobs / "shard-blob"))
    _write_index(blobs, {"a": "s.safetensors"}, name="index-blob")
    for name, blob in (("s.safetensors", "shard-blob"), ("model.safetensors.index.json", "index-blob")):
        (snapshot / name).symlink_to(os.path.relpath(blobs / blob, snapshot))
    return snapshot


def test_hub_snapshot_links_into_its_blobs(tmp_path: Path) -> None:
    with Checkpoint.open(_hub_snapshot(tmp_path, "models--org--name/blobs")) as checkpoint:
        assert checkpoint.tensor("a").tolist() == [1.0]


@pytest.mark.parametrize("blob_folder", ["models--org--other/blobs", "models--org--name/elsewhere", "outside"])
def test_hub_snapshot_links_elsewhere_refused(tmp_path: Path, blob_folder: str) -> None:
    snapshot = _hub_snapshot(tmp_path, blob_folder)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: resolves through a symlink"):
        Checkpoint.open(snapshot)
    with Checkpoint.open(snapshot, allow_external_symlinks=True) as checkpoint:
        assert checkpoint.tensor("a").tolist() == [1.0]


def test_hub_snapshot_folder_linked_into_another_repository_refused(tmp_path: Path) -> None:
    # models--org--name's snapshot folder is a link to models--org--other's: its files and blobs are that one's.
    other = _hub_snapshot(tmp_path, "models--org--other/blobs", repo="models--org--other").parent
    snapshots = tmp_path / "models--org--name" / "snapshots"
    snapshots.mkdir(parents=True)
    (snapshots / other.name).symlink_to(os.path.relpath(other, snapshots), target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: resolves through a symlink"):
        Checkpoint.open(snapshots / other.name / "sub")
    # A snapshot folder linked to another snapshot of its own repository is followed.
    own = _hub_snapshot(tmp_path, "models--org--name/blobs", commit="d" * 40).parent
    (snapshots / ("e" * 40)).symlink_to(own.name, target_is_directory=True)
    with Checkpoint.open(snapshots / ("e" * 40) / "sub") as checkpoint:
        assert checkpoint.tensor("a").tolist() == [1.0]


def test_missing_shard(sharded_dir: Path) -> None:
    _write_index(sharded_dir, {"a": "s1.safetensors", "z": "gone.safetensors"})
    with pytest.raises(CheckpointError, match=r"'gone\.safetensors' does not exist"):
        Checkpoint.open(sharded_dir)


def test_same_key_in_two_shards(sharded_dir: Path) -> None:
    save_file({"a": torch.zeros(4), "d": torch.ones(1)}, str(sharded_dir / "s3.safetensors"))
    _write_index(sharded_dir, {"a": "s1.safetensors", "b": "s1.safetensors", "d": "s3.safetensors"})
    with pytest.raises(CheckpointError) as excinfo:
        Checkpoint.open(sharded_dir)
    message = str(excinfo.value)
    assert "'a'" in message and "s1.safetensors" in message and "s3.safetensors" in message


def test_weight_map_key_absent_from_its_shard(sharded_dir: Path) -> None:
    _write_index(sharded_dir, {"a": "s2.safetensors", "b": "s1.safetensors", "c": "s2.safetensors"})
    with pytest.raises(CheckpointError, match=r"'a' is mapped to s2\.safetensors"):
        Checkpoint.open(sharded_dir)


@pytest.mark.parametrize(
    "content", ["{bad json", "[]", '{"metadata": {}}', '{"weight_map": {"a": 1}}', '{"weight_map": []}']
)
def test_malformed_index(sharded_dir: Path, content: str) -> None:
    (sharded_dir / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json"):
        Checkpoint.open(sharded_dir)


def test_hostile_shard_header_reported_with_shard_name(sharded_dir: Path) -> None:
    (sharded_dir / "s2.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(CheckpointError, match=r"s2\.safetensors"):
        Checkpoint.open(sharded_dir)


def test_close_keeps_handed_out_tensors(sharded_dir: Path) -> None:
    ckpt = Checkpoint.open(sharded_dir)
    a = ckpt.tensor("a")
    ckpt.close()
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(CheckpointError, match="closed"):
        ckpt.tensor("a")
    assert ckpt.keys() == ["a", "b", "c"]


# --- pickle checkpoints -------------------------------------------------------------------------


def test_pickle_refused_by_default(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*allow_pickle=True"):
        Checkpoint.open(tmp_path)


def test_pickle_index_refused_by_default(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2)}, tmp_path / "a.bin")
    _write_index(tmp_path, {"w": "a.bin"}, name="pytorch_model.bin.index.json")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin\.index\.json.*allow_pickle=True"):
        Checkpoint.open(tmp_path)


def test_pickle_loaded_when_allowed(tmp_path: Path) -> None:
    state = {"w": torch.randn(3, 4), "b": torch.arange(3), "s": torch.tensor(1.5, dtype=torch.bfloat16)}
    path = tmp_path / "pytorch_model.bin"
    torch.save(state, path)
    with Checkpoint.open(tmp_path, allow_pickle=True) as ckpt:
        assert ckpt.keys() == ["b", "s", "w"]
        assert ckpt.files == [path]
        assert ckpt.metadata == {}
        assert not ckpt.is_sharded
        info = ckpt.info("w")
        assert (info.path, info.start, info.end, info.shape, info.dtype) == (path, -1, -1, (3, 4), torch.float32)
        for key, ref in state.items():
            assert torch.equal(ckpt.tensor(key), ref)


def test_sharded_pickle_loaded_when_allowed(tmp_path: Path) -> None:
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": torch.zeros(3)}, tmp_path / "pytorch_model-00002-of-00002.bin")
    _write_index(
        tmp_path,
        {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"},
        name="pytorch_model.bin.index.json",
    )
    ckpt = Checkpoint.open(tmp_path, allow_pickle=True)
    assert ckpt.is_sharded and ckpt.keys() == ["a", "b"]
    assert ckpt.tensor("b").tolist() == [0.0, 0.0, 0.0]


class _Payload:
    """Pickles as a call to os.mkdir(marker): executed by any unpickler that does not restrict globals."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_malicious_pickle_not_executed(tmp_path: Path) -> None:
    control_marker = tmp_path / "control_marker"
    control = tmp_path / "control.bin"
    torch.save({"w": torch.ones(1), "x": _Payload(control_marker)}, control)
    torch.load(control, weights_only=False)  # proves the payload is live when unrestricted
    assert control_marker.exists()

    directory = tmp_path / "evil"
    directory.mkdir()
    marker = tmp_path / "pwned"
    torch.save({"w": torch.ones(1), "x": _Payload(marker)}, directory / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        Checkpoint.open(directory, allow_pickle=True)
    assert not marker.exists()


@pytest.mark.parametrize("payload", [[torch.ones(1)], {"nested": {"w": torch.ones(1)}}, {"n": 3}])
def test_pickle_that_is_not_a_flat_state_dict(tmp_path: Path, payload: object) -> None:
    torch.save(payload, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        Checkpoint.open(tmp_path, allow_pickle=True)


def test_garbage_pickle(tmp_path: Path) -> None:
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a zip nor a pickle")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin"):
        Checkpoint.open(tmp_path, allow_pickle=True)


def test_joined_only_within_one_safetensors_file(sharded_dir: Path, tmp_path: Path) -> None:
    with Checkpoint.open(str(sharded_dir)) as ckpt:
        joined = ckpt.joined(["a", "b"])
        assert joined is not None
        assert joined.tolist() == [0.0, 1.0, 2.0, 3.0, 1.0, 1.0, 1.0, 1.0]
        assert ckpt.joined(["b", "c"]) is None  # two files
    torch.save({"a": torch.ones(2), "b": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with Checkpoint.open(tmp_path, allow_pickle=True) as ckpt:
        assert ckpt.joined(["a", "b"]) is None  # torch's own mapping: no byte ranges
