"""Hostile or broken checkpoints, end to end through ``modelpatch.from_pretrained``.

Each is crafted from a real stock-saved checkpoint. Every one must end in a clear error (``CheckpointError`` or
``LoadPlanError``) naming the file or the key at fault; nothing may be written into the checkpoint directory, no
model is returned, and no code from the checkpoint runs.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

import modelpatch
from modelpatch import CheckpointError, LoadPlanError
from support.files import snapshot

pytestmark = pytest.mark.reliability


# ------------------------------------------------------------------------------------------------------------ helpers


def read_header(file: Path) -> tuple[dict, bytes]:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def write_header(file: Path, header: dict, body: bytes) -> None:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def edit_header(file: Path, edit: Callable[[dict], None]) -> None:
    header, body = read_header(file)
    edit(header)
    write_header(file, header, body)


def tensor_keys(header: dict) -> list[str]:
    """Keys in data order."""
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def edit_index(directory: Path, edit: Callable[[dict], None]) -> Path:
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    edit(index["weight_map"])
    index_file.write_text(json.dumps(index))
    return index_file


def shards(directory: Path) -> list[Path]:
    return sorted(directory.glob("model-*.safetensors"))


class Payload:
    """Unpickling this would create ``marker`` (``open(marker, "w")``): proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


# ------------------------------------------------------------------------------------------------------ the cases
#
# Each case edits a fresh copy of a stock checkpoint (``llama``: one file; ``llama_sharded``: an index and shards) and
# returns (expected error type, strings the message must contain).


def truncate_in_data(d: Path):
    file = d / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    return CheckpointError, [str(file), "truncated"]


def truncate_in_header(d: Path):
    file = d / "model.safetensors"
    (length,) = struct.unpack("<Q", file.read_bytes()[:8])
    file.write_bytes(file.read_bytes()[: 8 + length // 2])
    return CheckpointError, [str(file), "header"]


def truncate_in_prefix(d: Path):
    file = d / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5])
    return CheckpointError, [str(file)]


def empty_file(d: Path):
    (d / "model.safetensors").write_bytes(b"")
    return CheckpointError, [str(d / "model.safetensors")]


def truncate_shard(d: Path):
    shard = shards(d)[1]
    shard.write_bytes(shard.read_bytes()[:-8])
    return CheckpointError, [str(shard)]


def header_length_huge(d: Path):
    file = d / "model.safetensors"
    file.write_bytes(struct.pack("<Q", 2**62) + file.read_bytes()[8:])
    return CheckpointError, [str(file), "header length"]


def header_not_json(d: Path):
    file = d / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[8:24] = b"\xff" * 16
    file.write_bytes(bytes(data))
    return CheckpointError, [str(file), "JSON"]


def offsets_overlap(d: Path):
    file = d / "model.safetensors"
    header, _ = read_header(file)
    first, second = tensor_keys(header)[:2]

    def edit(h):
        # ``second`` starts inside ``first`` (its byte length unchanged, so only the overlap is wrong).
        begin, end = h[second]["data_offsets"]
        shift = 4
        h[second]["data_offsets"] = [begin - shift, end - shift]

    edit_header(file, edit)
    return CheckpointError, [str(file), "overlap", repr(first), repr(second)]


def offsets_alias_same_bytes(d: Path):
    file = d / "model.safetensors"
    header, _ = read_header(file)
    norms = [k for k in tensor_keys(header) if k.endswith("layernorm.weight")]

    def edit(h):
        h[norms[1]]["data_offsets"] = list(h[norms[0]]["data_offsets"])  # two tensors read the same bytes

    edit_header(file, edit)
    return CheckpointError, [str(file), "overlap"]


def offsets_past_end(d: Path):
    file = d / "model.safetensors"
    header, body = read_header(file)
    last = tensor_keys(header)[-1]

    def edit(h):
        begin, end = h[last]["data_offsets"]
        h[last]["data_offsets"] = [begin + 64, end + 64]

    edit_header(file, edit)
    return CheckpointError, [str(file), repr(last)]


def offsets_reversed(d: Path):
    file = d / "model.safetensors"
    key = "model.norm.weight"

    def edit(h):
        h[key]["data_offsets"] = list(reversed(h[key]["data_offsets"]))

    edit_header(file, edit)
    return CheckpointError, [str(file), repr(key)]


def dtype_disagrees_with_bytes(d: Path):
    file = d / "model.safetensors"
    key = "model.layers.0.self_attn.q_proj.weight"
    edit_header(file, lambda h: h[key].update(dtype="F16"))  # half the bytes the offsets span
    return CheckpointError, [str(file), repr(key), "bytes"]


def shape_disagrees_with_bytes(d: Path):
    file = d / "model.safetensors"
    key = "model.norm.weight"
    edit_header(file, lambda h: h[key].update(shape=[65]))
    return CheckpointError, [str(file), repr(key), "bytes"]


def unknown_dtype(d: Path):
    file = d / "model.safetensors"
    key = "lm_head.weight"
    edit_header(file, lambda h: h[key].update(dtype="F128"))
    return CheckpointError, [str(file), repr(key), "dtype"]


def header_nested_past_the_parsers_recursion_limit(d: Path):
    file = d / "model.safetensors"
    header, body = read_header(file)
    raw = json.dumps(header)[:-1] + ', "__extra__": ' + "[" * 100_000 + "]" * 100_000 + "}"
    raw_bytes = raw.encode() + b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw_bytes)) + raw_bytes + body)
    return CheckpointError, [str(file), "nested"]


def unused_bytes_between_tensors(d: Path):
    """8 bytes no tensor owns before the last tensor: stock's safetensors reader refuses the file."""
    file = d / "model.safetensors"
    header, body = read_header(file)
    last = tensor_keys(header)[-1]
    begin, end = header[last]["data_offsets"]
    header[last]["data_offsets"] = [begin + 8, end + 8]
    write_header(file, header, body[:begin] + b"\0" * 8 + body[begin:])
    return CheckpointError, [str(file), "belong to no tensor", repr(last)]


def unused_bytes_after_the_last_tensor(d: Path):
    file = d / "model.safetensors"
    with file.open("ab") as f:
        f.write(b"\0" * 8)
    return CheckpointError, [str(file), "at the end of the file belong to no tensor"]


def duplicate_header_key(d: Path):
    file = d / "model.safetensors"
    header, body = read_header(file)
    raw = json.dumps(header)
    key = "model.norm.weight"
    entry = json.dumps(header[key])
    raw = raw[:-1] + f', "{key}": {entry}' + "}"  # the same key twice in one JSON object
    raw_bytes = raw.encode() + b" " * (-len(raw) % 8)
    file.write_bytes(struct.pack("<Q", len(raw_bytes)) + raw_bytes + body)
    return CheckpointError, [str(file), repr(key)]


def consistent_header_wrong_shape_for_model(d: Path):
    """A valid file whose tensor has a different (self-consistent) shape than the model: a plan error."""
    file = d / "model.safetensors"
    key = "model.layers.1.mlp.down_proj.weight"

    def edit(h):
        rows, cols = h[key]["shape"]
        h[key]["shape"] = [cols, rows]  # same byte length, transposed shape

    edit_header(file, edit)
    return LoadPlanError, [key, "shape"]


def renamed_key_leaves_parameter_missing(d: Path):
    file = d / "model.safetensors"
    key = "model.layers.0.input_layernorm.weight"
    edit_header(file, lambda h: h.update({"model.layers.0.input_layernorm.wieght": h.pop(key)}))
    return LoadPlanError, [key, "missing"]


def index_names_missing_shard(d: Path):
    victim = "model.layers.0.mlp.up_proj.weight"
    index = edit_index(d, lambda m: m.update({victim: "model-00009-of-00009.safetensors"}))
    return CheckpointError, [str(index), "model-00009-of-00009.safetensors"]


def index_shard_deleted(d: Path):
    victim = shards(d)[-1]
    victim.unlink()
    return CheckpointError, [victim.name]


def index_dotdot(d: Path):
    shutil.copy(shards(d)[0], d.parent / "outside.safetensors")
    first = shards(d)[0].name
    index = edit_index(d, lambda m: m.update({k: "../outside.safetensors" for k, v in m.items() if v == first}))
    return CheckpointError, [str(index), "'../outside.safetensors'"]


def index_absolute(d: Path):
    outside = d.parent / "outside.safetensors"
    shutil.copy(shards(d)[0], outside)
    first = shards(d)[0].name
    index = edit_index(d, lambda m: m.update({k: str(outside) for k, v in m.items() if v == first}))
    return CheckpointError, [str(index), repr(str(outside))]


def index_symlink_file(d: Path):
    outside = d.parent / "outside.safetensors"
    first = shards(d)[0]
    shutil.move(first, outside)  # the real shard now lives outside; a symlink inside points at it
    (d / "link.safetensors").symlink_to(outside)
    index = edit_index(d, lambda m: m.update({k: "link.safetensors" for k, v in m.items() if v == first.name}))
    return CheckpointError, [str(index), "'link.safetensors'", "outside"]


def index_symlink_directory(d: Path):
    outside = d.parent / "elsewhere"
    outside.mkdir()
    first = shards(d)[0]
    shutil.move(first, outside / first.name)
    (d / "sub").symlink_to(outside, target_is_directory=True)
    index = edit_index(d, lambda m: m.update({k: f"sub/{first.name}" for k, v in m.items() if v == first.name}))
    return CheckpointError, [str(index), f"'sub/{first.name}'", "outside"]


def index_symlink_to_device(d: Path):
    (d / "zero.safetensors").symlink_to("/dev/zero")
    index = edit_index(d, lambda m: m.update({next(iter(m)): "zero.safetensors"}))
    return CheckpointError, [str(index), "'zero.safetensors'"]


def index_names_a_fifo(d: Path):
    """Opening a FIFO for reading would block until a writer appears: it must be refused, not hang the load."""
    os.mkfifo(d / "pipe.safetensors")
    index = edit_index(d, lambda m: m.update({next(iter(m)): "pipe.safetensors"}))
    return CheckpointError, [str(index), "'pipe.safetensors'"]


def index_shard_name_with_nul(d: Path):
    first = shards(d)[0].name
    index = edit_index(d, lambda m: m.update({k: first + "\0x" for k, v in m.items() if v == first}))
    return CheckpointError, [str(index), repr(first + "\0x")]


def index_same_key_in_two_shards(d: Path):
    first, second = shards(d)[:2]
    header1, _ = read_header(first)
    key = tensor_keys(header1)[0]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(second))
    tensors[key] = load_file(str(first))[key]
    save_file(tensors, str(second), metadata={"format": "pt"})
    index = d / "model.safetensors.index.json"
    return CheckpointError, [str(index), repr(key), first.name, second.name]


def index_maps_key_to_the_wrong_shard(d: Path):
    first, second = shards(d)[:2]
    key = tensor_keys(read_header(first)[0])[0]
    index = edit_index(d, lambda m: m.update({key: second.name}))
    return CheckpointError, [str(index), repr(key), second.name]


def index_not_json(d: Path):
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    return CheckpointError, [str(index), "JSON"]


def index_weight_map_not_strings(d: Path):
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"model.norm.weight": 3}}))
    return CheckpointError, [str(index), "weight_map"]


def fp8_weights_with_their_scales(d: Path):
    """Loaded as plain floats without their scales, every projection would be silently wrong."""
    from safetensors.torch import load_file, save_file

    file = d / "model.safetensors"
    tensors = load_file(str(file))
    for key in [k for k in tensors if k.endswith("_proj.weight")]:
        tensors[key] = tensors[key].to(torch.float8_e4m3fn)
        tensors[key.removesuffix("weight") + "weight_scale_inv"] = torch.ones(1, 1)
    save_file(tensors, str(file), metadata={"format": "pt"})
    return LoadPlanError, ["quantized", "fp8", "weight_scale_inv", "does not support"]


def config_declares_quantization(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (d / "config.json").write_text(json.dumps(config))
    return LoadPlanError, ["quantized", "'gptq'", "does not support"]


def edit_config(d: Path, **values) -> Path:
    config_file = d / "config.json"
    config = json.loads(config_file.read_text())
    config.update(values)
    config_file.write_text(json.dumps(config))
    return config_file


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def append_raw(file: Path, members: str) -> Path:
    """Add raw JSON text (``, "key": value``) at the end of the JSON object in ``file``."""
    file.write_text(file.read_text().rstrip().removesuffix("}") + members + "}")
    return file


def config_too_large(d: Path):
    config_file = append_raw(d / "config.json", " " * (16 * 2**20))
    return CheckpointError, [str(config_file), "limit"]


def config_nested_too_deeply(d: Path):
    config_file = edit_config(d, extra=json.loads(nested(40)))
    return CheckpointError, [str(config_file), "nested"]


def config_nested_past_the_parsers_recursion_limit(d: Path):
    config_file = append_raw(d / "config.json", f', "extra": {nested(100_000)}')
    return CheckpointError, [str(config_file), "nested"]


def config_integer_with_thousands_of_digits(d: Path):
    config_file = append_raw(d / "config.json", f', "vocab_size": 1{"0" * 4000}')
    return CheckpointError, [str(config_file), "digits"]


def config_absurd_layer_count(d: Path):
    """300 million layers: transformers would build a 2.4 GB ``layer_types`` list before any model."""
    config_file = edit_config(d, num_hidden_layers=300_000_000)
    return CheckpointError, [str(config_file), "num_hidden_layers = 300000000"]


def config_zero_heads(d: Path):
    config_file = edit_config(d, num_attention_heads=0)
    return CheckpointError, [str(config_file), "llama"]


def config_negative_size(d: Path):
    config_file = edit_config(d, intermediate_size=-5)
    return CheckpointError, [str(config_file), "LlamaForCausalLM", "negative dimension"]


def config_unknown_rope_type(d: Path):
    config_file = edit_config(d, rope_parameters={"rope_type": "nonsense", "rope_theta": 10000.0})
    return CheckpointError, [str(config_file), "nonsense"]


def config_wrong_value_type(d: Path):
    config_file = edit_config(d, hidden_size="wide")
    return CheckpointError, [str(config_file), "hidden_size"]


def index_too_large(d: Path):
    index = append_raw(d / "model.safetensors.index.json", " " * (64 * 2**20))
    return CheckpointError, [str(index), "limit"]


def index_nested_too_deeply(d: Path):
    index = append_raw(d / "model.safetensors.index.json", f', "metadata2": {nested(100_000)}')
    return CheckpointError, [str(index), "nested"]


def config_not_json(d: Path):
    (d / "config.json").write_text('{"model_type": "llama",')
    return CheckpointError, [str(d / "config.json"), "JSON"]


def config_unknown_model_type(d: Path):
    config = json.loads((d / "config.json").read_text())
    config["model_type"] = "definitely_not_a_model"
    (d / "config.json").write_text(json.dumps(config))
    return CheckpointError, [str(d / "config.json"), "definitely_not_a_model"]


def config_json_array(d: Path):
    (d / "config.json").write_text("[]")
    return CheckpointError, [str(d / "config.json")]


SINGLE_FILE = {
    f.__name__: f
    for f in (
        truncate_in_data,
        truncate_in_header,
        truncate_in_prefix,
        empty_file,
        header_length_huge,
        header_not_json,
        offsets_overlap,
        offsets_alias_same_bytes,
        offsets_past_end,
        offsets_reversed,
        dtype_disagrees_with_bytes,
        shape_disagrees_with_bytes,
        unknown_dtype,
        duplicate_header_key,
        header_nested_past_the_parsers_recursion_limit,
        unused_bytes_between_tensors,
        unused_bytes_after_the_last_tensor,
        consistent_header_wrong_shape_for_model,
        renamed_key_leaves_parameter_missing,
        fp8_weights_with_their_scales,
        config_declares_quantization,
        config_not_json,
        config_unknown_model_type,
        config_json_array,
        config_too_large,
        config_nested_too_deeply,
        config_nested_past_the_parsers_recursion_limit,
        config_integer_with_thousands_of_digits,
        config_absurd_layer_count,
        config_zero_heads,
        config_negative_size,
        config_unknown_rope_type,
        config_wrong_value_type,
    )
}
SHARDED = {
    f.__name__: f
    for f in (
        truncate_shard,
        index_names_missing_shard,
        index_shard_deleted,
        index_dotdot,
        index_absolute,
        index_symlink_file,
        index_symlink_directory,
        index_symlink_to_device,
        index_names_a_fifo,
        index_shard_name_with_nul,
        index_same_key_in_two_shards,
        index_maps_key_to_the_wrong_shard,
        index_not_json,
        index_weight_map_not_strings,
        index_too_large,
        index_nested_too_deeply,
    )
}


def assert_refused(directory: Path, error: type, needles: list[str], **kwargs) -> Exception:
    """from_pretrained raises ``error`` naming every needle; nothing changes on disk or in the process."""
    before = snapshot(directory)
    parent_before = sorted(p.name for p in directory.parent.iterdir())
    dtype, tie_weights = torch.get_default_dtype(), PreTrainedModel.tie_weights
    result = None
    with pytest.raises(error) as info:
        result = modelpatch.from_pretrained(AutoModelForCausalLM, directory, **kwargs)
    assert result is None
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in the error:\n{message}"
    assert snapshot(directory) == before, "the checkpoint directory was modified"
    assert sorted(p.name for p in directory.parent.iterdir()) == parent_before, "files appeared next to it"
    assert torch.get_default_dtype() == dtype and PreTrainedModel.tie_weights is tie_weights
    assert modelpatch.get_patch_mapping() == {}
    return info.value


@pytest.mark.parametrize("case", sorted(SINGLE_FILE))
def test_hostile_single_file_checkpoint(stock, tmp_path, case):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, directory)
    error, needles = SINGLE_FILE[case](directory)
    assert_refused(directory, error, needles)


@pytest.mark.parametrize("case", sorted(SHARDED))
def test_hostile_sharded_checkpoint(stock, tmp_path, case):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama_sharded").path, directory)
    assert len(shards(directory)) >= 3
    error, needles = SHARDED[case](directory)
    assert_refused(directory, error, needles)


def test_unmodified_copies_load(stock, tmp_path):
    """The cases above start from checkpoints that do load: every failure is caused by its edit."""
    for name in ("llama", "llama_sharded"):
        directory = tmp_path / name
        shutil.copytree(stock(name).path, directory)
        model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
        assert model.model.norm.weight.shape == (64,)


def test_plan_errors_name_the_checkpoints_own_keys(tmp_path):
    """A Mixtral checkpoint (renamed block_sparse_moe -> mlp at load) missing one expert weight."""
    from safetensors.torch import load_file, save_file

    from support.models import tiny_config, wide

    directory = tmp_path / "mixtral"
    config = tiny_config("mixtral", **wide(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2))
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.0.block_sparse_moe.experts.0.w3.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    error = assert_refused(directory, LoadPlanError, ["model.layers.0.block_sparse_moe.experts."])
    assert "model.layers.0.mlp.experts.0." not in str(error), "names a key that is not in the file"


@pytest.mark.parametrize("content", ["{not json", "[]", '{"max_new_tokens": "many"}'])
def test_broken_generation_config_is_a_checkpoint_error_naming_it(stock, tmp_path, content):
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, directory)
    (directory / "generation_config.json").write_text(content)
    assert_refused(directory, CheckpointError, [str(directory / "generation_config.json")])


# ------------------------------------------------------------------------------------------------------------- pickle


@pytest.fixture
def pickle_directory(stock, tmp_path) -> Path:
    directory = tmp_path / "bin"
    directory.mkdir()
    shutil.copy(stock("llama").path / "config.json", directory)
    return directory


def test_pickle_refused_by_default_without_being_opened(pickle_directory, tmp_path, monkeypatch):
    marker = tmp_path / "pwned"
    with (pickle_directory / "pytorch_model.bin").open("wb") as f:
        pickle.dump({"model.norm.weight": Payload(marker)}, f)
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called without allow_pickle"))
    assert_refused(pickle_directory, CheckpointError, [str(pickle_directory / "pytorch_model.bin"), "allow_pickle"])
    assert not marker.exists()


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_malicious_pickle_never_executed_even_when_allowed(pickle_directory, tmp_path, layout):
    marker = tmp_path / "pwned"
    payload = {"model.norm.weight": Payload(marker)}
    if layout == "single":
        name = "pytorch_model.bin"
        with (pickle_directory / name).open("wb") as f:
            pickle.dump(payload, f)
    else:
        name = "pytorch_model-00001-of-00001.bin"
        torch.save(payload, pickle_directory / name)  # a real torch zip archive with the payload inside
        (pickle_directory / "pytorch_model.bin.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": name}})
        )
    assert_refused(pickle_directory, CheckpointError, [str(pickle_directory / name)], allow_pickle=True)
    assert not marker.exists(), "unpickling ran code from the checkpoint"


def test_config_auto_map_code_is_never_imported(stock, tmp_path):
    """A config.json pointing at Python files in the checkpoint (``auto_map``) never makes them run."""
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, directory)
    marker = tmp_path / "imported"
    code = (
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import LlamaConfig as EvilConfig, LlamaForCausalLM as EvilModel\n"
    )
    (directory / "configuration_evil.py").write_text(code)
    (directory / "modeling_evil.py").write_text(code)
    config = json.loads((directory / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForCausalLM": "modeling_evil.EvilModel",
    }
    (directory / "config.json").write_text(json.dumps(config))
    before = snapshot(directory)
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    assert type(model).__module__.startswith("transformers.")
    assert not marker.exists(), "code from the checkpoint directory ran"
    assert snapshot(directory) == before
