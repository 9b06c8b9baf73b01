"""Disk offload with ``device_map``: weights read in place from the checkpoint as stock does, converted ones written
to ``offload_folder`` (or the load refused), forward equal to stock, saves equal to the un-offloaded model's, and a
checkpoint file changed after the load refused at the next read."""

from __future__ import annotations

import copy
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.checkpoint import Checkpoint
from modelpatch.errors import CheckpointError
from modelpatch.loading.record import offloaded_weights
from support.stock_checkpoints import assert_tensors_identical, config_json, read_tensors

FUSED = {"qkv": True, "gate_up": True}
PARTIAL = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "disk",
}
MAPS = {"full": {"": "disk"}, "partial": PARTIAL}


def _logits(model, checkpoint):
    with torch.no_grad():
        return model(**checkpoint.inputs()).logits


def _on_disk(model, device_map) -> list[str]:
    """Parameters of ``model`` under a module ``device_map`` puts on disk."""
    disk = [module for module, device in device_map.items() if device == "disk"]
    return sorted(
        name
        for name, _ in model.named_parameters(remove_duplicate=False)
        if any(module == "" or name.startswith(module + ".") for module in disk)
    )


def _file_of(checkpoint) -> dict[str, str]:
    """Checkpoint key -> the safetensors file holding it."""
    index = checkpoint.path / "model.safetensors.index.json"
    if index.exists():
        return {key: str(checkpoint.path / name) for key, name in json.loads(index.read_text())["weight_map"].items()}
    return {key: str(checkpoint.path / "model.safetensors") for key in read_tensors(checkpoint.path)}


def _load(checkpoint, **kwargs):
    return modelpatch.from_pretrained(AutoModelForCausalLM, checkpoint.path, **kwargs)


@pytest.mark.parametrize("name", ["llama", "llama_sharded", "llama_tied"])
@pytest.mark.parametrize("which", sorted(MAPS))
def test_offload_reads_the_checkpoint_in_place(stock_checkpoint, tmp_path, name, which):
    checkpoint, device_map = stock_checkpoint(name), MAPS[which]
    folder = tmp_path / "offload"
    model = _load(checkpoint, device_map=device_map, offload_folder=folder)

    index = offloaded_weights(model).index
    assert sorted(index) == _on_disk(model, device_map)
    files = _file_of(checkpoint)
    tied = dict(getattr(model, "all_tied_weights_keys", {}) or {})
    for name_, entry in index.items():
        # A tied weight the checkpoint does not store is read from its partner's tensor.
        key = name_ if name_ in files else tied[name_]
        assert entry == {"safetensors_file": files[key], "weight_name": key, "dtype": "float32"}
        # accelerate reties a weight to its partner on the CPU after placing the modules.
        assert model.get_parameter(name_).is_meta or name_ in tied
    assert not folder.exists()  # nothing written

    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    logits = _logits(model, checkpoint)
    torch.testing.assert_close(logits, _logits(stock, checkpoint), rtol=0, atol=0)
    if not (tied and which == "partial"):
        # (Stock 5.23's forward fails there: its index has no entry for the head tied to the CPU embedding.)
        stock_offloaded = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map=device_map)
        torch.testing.assert_close(logits, _logits(stock_offloaded, checkpoint), rtol=0, atol=0)


def test_cast_weights_are_read_in_place_and_cast_on_read(stock_checkpoint):
    # As stock: the index records the model's dtype and the read casts the checkpoint's float32 tensor to it.
    checkpoint = stock_checkpoint("llama")
    model = _load(checkpoint, device_map=PARTIAL, dtype=torch.bfloat16)
    index = offloaded_weights(model).index
    assert index and {entry["dtype"] for entry in index.values()} == {"bfloat16"}
    assert {entry["weight_name"] for entry in index.values()} == set(index)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map=PARTIAL, dtype=torch.bfloat16)
    torch.testing.assert_close(_logits(model, checkpoint), _logits(stock, checkpoint), rtol=0, atol=0)


@pytest.mark.parametrize("which", sorted(MAPS))
def test_converted_weights_need_offload_folder(stock_checkpoint, tmp_path, which):
    checkpoint, device_map = stock_checkpoint("llama"), MAPS[which]
    with pytest.raises(ValueError, match="offload_folder") as error:
        _load(checkpoint, fusion_config=FUSED, device_map=device_map)
    fused = ["model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"]
    for name in fused:
        assert name in str(error.value)
    # Only the disk modules' weights are named, and none read in place.
    assert ("model.layers.0.self_attn.qkv_proj.weight" in str(error.value)) == (which == "full")
    assert "o_proj" not in str(error.value)

    folder = tmp_path / "offload"
    model = _load(checkpoint, fusion_config=FUSED, device_map=device_map, offload_folder=folder)
    index = offloaded_weights(model).index
    assert sorted(index) == _on_disk(model, device_map)
    written = sorted(name for name in index if "qkv_proj" in name or "gate_up_proj" in name)
    assert sorted(path.name for path in folder.iterdir()) == sorted(f"{name}.safetensors" for name in written)
    for name, entry in index.items():
        if name in written:
            assert entry["safetensors_file"] == str(folder / f"{name}.safetensors") and entry["weight_name"] == name
        else:
            assert (
                entry["safetensors_file"] == str(checkpoint.path / "model.safetensors") and entry["weight_name"] == name
            )

    stock_offloaded = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map=device_map)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    logits = _logits(model, checkpoint)
    torch.testing.assert_close(logits, _logits(stock_offloaded, checkpoint), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, _logits(stock, checkpoint), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["a_file", "below_a_file", "read_only"])
def test_unusable_offload_folder_is_named_before_any_tensor_is_read(stock_checkpoint, tmp_path, monkeypatch, case):
    checkpoint = stock_checkpoint("llama")
    if case == "a_file":
        folder = tmp_path / "offload"
        folder.write_text("")
        expected = r"is not a directory"
    elif case == "below_a_file":
        (tmp_path / "file").write_text("")
        folder = tmp_path / "file" / "offload"
        expected = rf"lies below {tmp_path / 'file'}, which is not a directory"
    else:
        folder = tmp_path / "offload"
        folder.mkdir(mode=0o555)
        expected = r"permissions \(dr-xr-xr-x\) do not allow it"

    def refuse(self, key):
        raise AssertionError(f"tensor {key!r} was read")

    monkeypatch.setattr(Checkpoint, "tensor", refuse)
    with pytest.raises(CheckpointError, match=expected) as error:
        _load(checkpoint, fusion_config=FUSED, device_map=PARTIAL, offload_folder=folder)
    message = str(error.value)
    assert message.startswith(f"{folder}: offload_folder") and "pass another offload_folder" in message


def test_moe_experts_need_offload_folder_as_in_stock(stock_checkpoint, tmp_path):
    # Per-expert checkpoint tensors become one 3-D parameter at load: stock cannot read them in place either.
    checkpoint = stock_checkpoint("qwen2_moe")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        _load(checkpoint, device_map={"": "disk"})
    with pytest.raises(ValueError, match="offload_folder"):
        AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map={"": "disk"})
    model = _load(checkpoint, device_map={"": "disk"}, offload_folder=tmp_path)
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    torch.testing.assert_close(_logits(model, checkpoint), _logits(stock, checkpoint), rtol=1e-5, atol=1e-5)


def test_auto_device_map_with_max_memory_offloads_to_disk(stock_checkpoint):
    checkpoint = stock_checkpoint("llama")
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    size = sum(t.numel() * t.element_size() for t in stock.state_dict().values())
    # The CPU keeps room for the largest layer besides what it holds: 90% of the model leaves the first layer there.
    max_memory = {"cpu": size * 9 // 10}
    model = _load(checkpoint, device_map="auto", max_memory=max_memory)
    assert model.hf_device_map["model.layers.0"] == "cpu" and model.hf_device_map["model.layers.1"] == "disk"
    stock_offloaded = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map="auto", max_memory=max_memory)
    assert model.hf_device_map == stock_offloaded.hf_device_map
    assert sorted(offloaded_weights(model).index) == _on_disk(model, model.hf_device_map)
    logits = _logits(model, checkpoint)
    torch.testing.assert_close(logits, _logits(stock_offloaded, checkpoint), rtol=0, atol=0)
    torch.testing.assert_close(logits, _logits(stock, checkpoint), rtol=0, atol=0)


@pytest.mark.parametrize("fusion_config", [None, FUSED], ids=["llama", "fused"])
@pytest.mark.parametrize("which", sorted(MAPS))
def test_offloaded_model_saves_like_the_loaded_one(stock_checkpoint, tmp_path, fusion_config, which):
    checkpoint = stock_checkpoint("llama")
    plain = _load(checkpoint, fusion_config=fusion_config)
    modelpatch.save_pretrained(plain, tmp_path / "plain")
    offloaded = _load(checkpoint, fusion_config=fusion_config, device_map=MAPS[which], offload_folder=tmp_path / "off")
    modelpatch.save_pretrained(offloaded, tmp_path / "modelpatch")
    offloaded.save_pretrained(tmp_path / "stock_path")
    expected = read_tensors(tmp_path / "plain")
    assert_tensors_identical(read_tensors(tmp_path / "modelpatch"), expected)
    assert_tensors_identical(read_tensors(tmp_path / "stock_path"), expected)
    assert config_json(tmp_path / "modelpatch") == config_json(tmp_path / "plain")
    # The model still runs from its offloaded weights after the saves.
    torch.testing.assert_close(_logits(offloaded, checkpoint), _logits(plain, checkpoint), rtol=1e-5, atol=1e-5)
    if fusion_config is None:
        # Stock saves its own offloaded model with the same tensors.
        stock = AutoModelForCausalLM.from_pretrained(checkpoint.path, device_map=MAPS[which])
        stock.save_pretrained(tmp_path / "stock")
        assert_tensors_identical(read_tensors(tmp_path / "stock"), expected)


@pytest.mark.parametrize("offloaded", ["model.embed_tokens", "lm_head"])
def test_a_tie_with_one_side_offloaded_is_saved_tied_after_a_forward(stock_checkpoint, tmp_path, offloaded):
    """accelerate puts the offloaded side back on the meta device after each forward: two tensors, one value. The
    save kept lm_head.weight and wrote tie_word_embeddings false; it writes the tied checkpoint, as the loaded one."""
    checkpoint = stock_checkpoint("llama_tied")
    plain = _load(checkpoint)
    modelpatch.save_pretrained(plain, tmp_path / "plain")
    device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
    model = _load(checkpoint, device_map={**device_map, "model.rotary_emb": "cpu", offloaded: "disk"})
    torch.testing.assert_close(_logits(model, checkpoint), _logits(plain, checkpoint), rtol=0, atol=0)
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # the forward parted them
    modelpatch.save_pretrained(model, tmp_path / "modelpatch")
    model.save_pretrained(tmp_path / "stock_path")
    expected = read_tensors(tmp_path / "plain")
    assert "lm_head.weight" not in expected
    for saved in ("modelpatch", "stock_path"):
        assert_tensors_identical(read_tensors(tmp_path / saved), expected)
        assert config_json(tmp_path / saved)["tie_word_embeddings"] is True
    assert config_json(tmp_path / "modelpatch") == config_json(tmp_path / "plain")

    # Untied for real (the resident side changed since): both are written, and the config says untied.
    resident = model.model.embed_tokens if offloaded == "lm_head" else model.lm_head
    with torch.no_grad():
        resident.weight.add_(1.0)
    modelpatch.save_pretrained(model, tmp_path / "untied")
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= set(read_tensors(tmp_path / "untied"))
    assert config_json(tmp_path / "untied")["tie_word_embeddings"] is False


def _fully_offloaded_copy(checkpoint, tmp_path):
    """A copy of ``checkpoint`` in ``tmp_path`` and the model loaded from it with every module on ``"disk"``."""
    source = shutil.copytree(checkpoint.path, tmp_path / checkpoint.path.name)
    return checkpoint, source, modelpatch.from_pretrained(AutoModelForCausalLM, source, device_map={"": "disk"})


def _rewrite_in_place(path, keep_mtime=False):
    """Flip one byte of the last tensor's data, in the same file (same inode); ``keep_mtime``: then set its
    modification time back, as ``rsync --inplace -t`` or ``touch -r`` do (the size is unchanged anyway)."""
    before = os.stat(path)
    with open(path, "r+b") as file:
        file.seek(-1, os.SEEK_END)
        last = file.read(1)
        file.seek(-1, os.SEEK_END)
        file.write(bytes([last[0] ^ 0xFF]))
    stat = os.stat(path)
    # Else a later modification time, whatever the file system's clock says.
    mtime = before.st_mtime_ns if keep_mtime else stat.st_mtime_ns + 1_000_000
    os.utime(path, ns=(stat.st_atime_ns, mtime))


def test_checkpoint_rewritten_after_load_fails_the_offloaded_read(stock_checkpoint, tmp_path):
    checkpoint, source, model = _fully_offloaded_copy(stock_checkpoint("llama"), tmp_path)
    _logits(model, checkpoint)
    _rewrite_in_place(source / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"Offloaded weight '[\w.]+' cannot be read from .*model\.safetensors"):
        _logits(model, checkpoint)
    with pytest.raises(CheckpointError, match="changed"):
        modelpatch.save_pretrained(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


def test_checkpoint_rewritten_with_its_size_and_mtime_restored_fails_the_offloaded_read(stock_checkpoint, tmp_path):
    # rsync --inplace -t, or a rewrite followed by touch -r: only the status-change time tells.
    checkpoint, source, model = _fully_offloaded_copy(stock_checkpoint("llama"), tmp_path)
    _logits(model, checkpoint)
    file = source / "model.safetensors"
    before = file.stat()
    _rewrite_in_place(file, keep_mtime=True)
    assert (file.stat().st_size, file.stat().st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    with pytest.raises(CheckpointError, match=r"Offloaded weight '[\w.]+' cannot be read from .*model\.safetensors"):
        _logits(model, checkpoint)


def test_checkpoint_truncated_after_load_fails_the_offloaded_read_naming_it(stock_checkpoint, tmp_path):
    # Read from the truncated file, the weights' pages would kill the process with SIGBUS.
    checkpoint, source, model = _fully_offloaded_copy(stock_checkpoint("llama"), tmp_path)
    file = source / "model.safetensors"
    size = file.stat().st_size
    os.truncate(file, size // 2)
    with pytest.raises(
        CheckpointError, match=rf"model\.safetensors: the file was truncated from {size} to {size // 2}"
    ):
        _logits(model, checkpoint)


def test_offload_folder_file_rewritten_fails_the_read(stock_checkpoint, tmp_path):
    checkpoint = stock_checkpoint("llama")
    model = _load(checkpoint, fusion_config=FUSED, device_map=PARTIAL, offload_folder=tmp_path)
    _rewrite_in_place(tmp_path / "model.layers.1.self_attn.qkv_proj.weight.safetensors")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.self_attn\.qkv_proj\.weight'"):
        _logits(model, checkpoint)


def test_checkpoint_replaced_after_load_is_not_read(stock_checkpoint, tmp_path):
    # The offloaded reads go through the files opened at load: a new file renamed over the old one changes nothing.
    checkpoint, source, model = _fully_offloaded_copy(stock_checkpoint("llama"), tmp_path)
    expected = _logits(model, checkpoint)
    other = {key: torch.zeros_like(tensor) for key, tensor in read_tensors(source).items()}
    save_file(other, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    os.replace(tmp_path / "other.safetensors", source / "model.safetensors")
    torch.testing.assert_close(_logits(model, checkpoint), expected, rtol=0, atol=0)


def test_pickle_checkpoint_weights_are_written_to_offload_folder(stock_checkpoint, tmp_path):
    # A pickle file has no byte ranges to read tensors from in place: stock writes them to the folder too.
    checkpoint = stock_checkpoint("llama")
    source = tmp_path / "llama_bin"
    shutil.copytree(checkpoint.path, source, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save(read_tensors(checkpoint.path), source / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*offload_folder"):
        modelpatch.from_pretrained(AutoModelForCausalLM, source, allow_pickle=True, device_map=PARTIAL)
    folder = tmp_path / "offload"
    model = modelpatch.from_pretrained(
        AutoModelForCausalLM, source, allow_pickle=True, device_map=PARTIAL, offload_folder=folder
    )
    assert sorted(path.name for path in folder.iterdir()) == [
        f"{name}.safetensors" for name in _on_disk(model, PARTIAL)
    ]
    stock = AutoModelForCausalLM.from_pretrained(checkpoint.path)
    torch.testing.assert_close(_logits(model, checkpoint), _logits(stock, checkpoint), rtol=0, atol=0)


def test_copied_offloaded_model_reads_the_same_files(stock_checkpoint):
    checkpoint = stock_checkpoint("llama")
    model = _load(checkpoint, device_map=PARTIAL)
    copied = copy.deepcopy(model)
    assert offloaded_weights(copied).index == offloaded_weights(model).index
    torch.testing.assert_close(_logits(copied, checkpoint), _logits(model, checkpoint), rtol=0, atol=0)
