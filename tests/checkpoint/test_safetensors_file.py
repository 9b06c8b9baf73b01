"""SafetensorsFile: header validation, zero-copy reads, lifetime of handed-out tensors."""

from __future__ import annotations

import gc
import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from modelpatch.checkpoint import SafetensorsFile, TensorInfo
from modelpatch.errors import CheckpointError
from support.compare import assert_tensor_bitwise_equal

F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


def _header_bytes(header: dict) -> bytes:
    return json.dumps(header).encode()


def test_round_trip_matches_safetensors(tmp_path: Path, dtype_samples) -> None:
    path = tmp_path / "all.safetensors"
    save_file(dtype_samples, str(path), metadata={"format": "pt", "note": "x"})
    expected = load_file(str(path))
    with SafetensorsFile.open(path) as f:
        assert f.metadata == {"format": "pt", "note": "x"}
        assert set(f.tensors) == set(expected)
        for key, ref in expected.items():
            info = f.tensors[key]
            assert info.key == key and info.path == path
            assert info.dtype == ref.dtype and info.shape == tuple(ref.shape)
            assert info.end - info.start == ref.numel() * ref.element_size()
            assert_tensor_bitwise_equal(f.tensor(key), ref, key)


def test_header_order_and_absent_metadata(tmp_path: Path, write_raw) -> None:
    header = {
        "b": {"dtype": "I8", "shape": [1], "data_offsets": [0, 1]},
        "a": {"dtype": "I8", "shape": [1], "data_offsets": [1, 2]},
    }
    path = write_raw(tmp_path / "x.safetensors", header, b"\x05\x06")
    f = SafetensorsFile.open(path)
    assert list(f.tensors) == ["b", "a"]
    assert f.metadata == {}
    data_start = 8 + len(_header_bytes(header))
    assert f.tensors["a"] == TensorInfo("a", torch.int8, (1,), path, data_start + 1, data_start + 2)
    assert f.tensor("a").tolist() == [6]


def test_tensor_is_zero_copy_view_of_one_mapping(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(64, 64)}, str(path))
    with SafetensorsFile.open(path) as f:
        a1, a2, b = f.tensor("a"), f.tensor("a"), f.tensor("b")
        assert a1.data_ptr() == a2.data_ptr() == a1.untyped_storage().data_ptr()
        # Both keys live at their header offsets from one common base address: a single mapping.
        base = a1.data_ptr() - f.tensors["a"].start
        assert b.data_ptr() - f.tensors["b"].start == base
        a1[0] = 42.0  # writes land in the shared private mapping...
        assert a2[0].item() == 42.0
    # ...and never in the file.
    assert load_file(str(path))["a"][0].item() == 0.0
    assert SafetensorsFile.open(path).tensor("a")[0].item() == 0.0


def test_writing_view_does_not_modify_file(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(256)}, str(path))
    before = path.read_bytes()
    t = SafetensorsFile.open(path).tensor("w")
    t.fill_(7.0)
    assert torch.all(t == 7.0)
    assert path.read_bytes() == before


def test_tensors_outlive_close(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_file({"x": torch.arange(10, dtype=torch.int64).reshape(2, 5), "s": torch.tensor(2.0)}, str(path))
    with SafetensorsFile.open(path) as f:
        x = f.tensor("x")
        s = f.tensor("s")
    del f
    gc.collect()
    assert x.sum().item() == 45 and x.shape == (2, 5)
    assert s.shape == () and s.item() == 2.0


@pytest.mark.parametrize("read", ["tensor", "map_tensor"])
def test_an_unknown_key_and_a_closed_file_are_refused_by_name(tmp_path: Path, read: str) -> None:
    # Both readers of one tensor: the view of the file's one mapping, and a mapping of the tensor's own pages.
    path = tmp_path / "k.safetensors"
    save_file({"x": torch.ones(2)}, str(path))
    f = SafetensorsFile.open(path)
    with pytest.raises(CheckpointError, match=r"k\.safetensors: no tensor named 'nope'"):
        getattr(f, read)("nope")
    f.close()
    with pytest.raises(CheckpointError, match=r"k\.safetensors: file is closed"):
        getattr(f, read)("x")


HOSTILE = {
    "shorter_than_8_bytes": lambda w, p: p.write_bytes(b"\x01\x02\x03"),
    "header_length_huge": lambda w, p: p.write_bytes(struct.pack("<Q", 2**40) + b"{}"),
    "header_length_past_eof": lambda w, p: p.write_bytes(struct.pack("<Q", 1000) + b"{}"),
    "not_utf8": lambda w, p: w(p, b"\xff\xfe{}"),
    "bad_json": lambda w, p: w(p, b"{not json"),
    "json_not_object": lambda w, p: w(p, b"[1, 2]"),
    "duplicate_key": lambda w, p: w(
        p, b'{"a": ' + _header_bytes(F32x2) + b', "a": ' + _header_bytes(F32x2) + b"}", bytes(8)
    ),
    "bad_metadata": lambda w, p: w(p, {"__metadata__": {"k": 1}}),
    "entry_not_object": lambda w, p: w(p, {"a": [1, 2]}),
    "unknown_dtype": lambda w, p: w(p, {"a": {**F32x2, "dtype": "F7"}}, bytes(8)),
    "shape_negative": lambda w, p: w(p, {"a": {**F32x2, "shape": [-2]}}, bytes(8)),
    "shape_not_ints": lambda w, p: w(p, {"a": {**F32x2, "shape": ["2"]}}, bytes(8)),
    "shape_bool": lambda w, p: w(p, {"a": {**F32x2, "shape": [True, 2]}}, bytes(8)),
    "offsets_reversed": lambda w, p: w(p, {"a": {**F32x2, "data_offsets": [8, 0]}}, bytes(8)),
    "offsets_negative": lambda w, p: w(p, {"a": {**F32x2, "data_offsets": [-8, 0]}}, bytes(8)),
    "offsets_one_int": lambda w, p: w(p, {"a": {**F32x2, "data_offsets": [0]}}, bytes(8)),
    "offsets_float": lambda w, p: w(p, {"a": {**F32x2, "data_offsets": [0, 8.0]}}, bytes(8)),
    "offsets_past_end_truncated": lambda w, p: w(p, {"a": {**F32x2, "shape": [4], "data_offsets": [0, 16]}}, bytes(8)),
    "bytes_disagree_with_shape": lambda w, p: w(p, {"a": {**F32x2, "shape": [3]}}, bytes(8)),
    "bytes_disagree_with_dtype": lambda w, p: w(p, {"a": {**F32x2, "dtype": "F64"}}, bytes(8)),
    "overlapping_offsets": lambda w, p: w(p, {"a": F32x2, "b": {**F32x2, "data_offsets": [4, 12]}}, bytes(12)),
    "identical_offsets": lambda w, p: w(p, {"a": F32x2, "b": F32x2}, bytes(8)),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_files_rejected_with_file_name(tmp_path: Path, write_raw, case: str) -> None:
    path = tmp_path / f"hostile_{case}.safetensors"
    HOSTILE[case](write_raw, path)
    with pytest.raises(CheckpointError) as excinfo:
        SafetensorsFile.open(path)
    assert path.name in str(excinfo.value)


@pytest.mark.parametrize(
    ("case", "key"),
    [("unknown_dtype", "'a'"), ("offsets_past_end_truncated", "'a'"), ("overlapping_offsets", "'b'")],
)
def test_hostile_errors_name_the_key(tmp_path: Path, write_raw, case: str, key: str) -> None:
    path = tmp_path / "k.safetensors"
    HOSTILE[case](write_raw, path)
    with pytest.raises(CheckpointError, match=key):
        SafetensorsFile.open(path)


def test_empty_tensors_may_share_offsets(tmp_path: Path, write_raw) -> None:
    header = {
        "e1": {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]},
        "e2": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "a": F32x2,
    }
    path = write_raw(tmp_path / "e.safetensors", header, struct.pack("<2f", 1.0, 2.0))
    f = SafetensorsFile.open(path)
    assert f.tensor("e1").shape == (0, 4)
    assert f.tensor("a").tolist() == [1.0, 2.0]


def test_truncated_real_file(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(100), "b": torch.ones(100)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=r"t\.safetensors.*truncated"):
        SafetensorsFile.open(path)


def test_joined_is_the_concatenation_of_back_to_back_tensors_without_a_copy(tmp_path: Path) -> None:
    """Tensors the file holds one right after another are their dim-0 concatenation, as one view of the mapping."""
    path = tmp_path / "j.safetensors"
    torch.manual_seed(0)
    tensors = {"a.gate": torch.randn(3, 4), "a.up": torch.randn(5, 4), "b": torch.randn(2, 4)}
    save_file(tensors, str(path))
    with SafetensorsFile.open(path) as f:
        order = sorted(f.tensors, key=lambda key: f.tensors[key].start)
        assert order == ["a.gate", "a.up", "b"]  # save_file's order: the test's premise
        joined = f.joined(["a.gate", "a.up"])
        assert joined is not None and joined.dim() == 1
        assert_tensor_bitwise_equal(joined.view(8, 4), torch.cat([tensors["a.gate"], tensors["a.up"]]), "joined")
        assert joined.data_ptr() == f.tensor("a.gate").data_ptr()  # the file's bytes, not a copy
        assert f.joined(["a.gate", "a.up", "b"]).numel() == 40
        assert f.joined(["a.up"]).numel() == 20
        # Not in file order, or not adjacent: no view (the caller concatenates).
        assert f.joined(["a.up", "a.gate"]) is None
        assert f.joined(["a.gate", "b"]) is None
        joined[0] = 42.0  # a private mapping, as every view the file hands out
    assert load_file(str(path))["a.gate"][0, 0].item() == tensors["a.gate"][0, 0].item()


def test_joined_needs_one_dtype_and_names_an_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "d.safetensors"
    save_file({"a": torch.ones(4), "b": torch.ones(4, dtype=torch.float16)}, str(path))
    with SafetensorsFile.open(path) as f:
        first, second = sorted(f.tensors, key=lambda key: f.tensors[key].start)
        assert f.tensors[first].end == f.tensors[second].start
        assert f.joined([first, second]) is None
        with pytest.raises(CheckpointError, match=r"d\.safetensors.*'nope'"):
            f.joined([first, "nope"])


def test_joined_refuses_a_file_truncated_after_opening(tmp_path: Path) -> None:
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.ones(1000), "b": torch.ones(1000)}, str(path))
    f = SafetensorsFile.open(path)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size - 100)
    with pytest.raises(CheckpointError, match=r"t\.safetensors"):
        f.joined(["a", "b"])
