"""``modelpatch convert`` copies SRC's non-weight files (tokenizer, templates, processor configs, ...) into DST."""

from __future__ import annotations

import filecmp
import json
import os
from pathlib import Path

import pytest
from transformers import LlamaForCausalLM

CARRIED = {
    "tokenizer.json": '{"version": "1.0"}',
    "tokenizer_config.json": '{"model_max_length": 128}',
    "special_tokens_map.json": '{"bos_token": "<s>"}',
    "vocab.json": '{"a": 0}',
    "merges.txt": "a b\n",
    "tokenizer.model": "\x00sentencepiece\x01",
    "chat_template.jinja": "{{ messages }}",
    "preprocessor_config.json": "{}",
    "processor_config.json": "{}",
    "README.md": "# tiny llama\n",
    "LICENSE": "Apache-2.0\n",
    ".gitattributes": "*.safetensors filter=lfs\n",
    "modules.json": json.dumps(
        [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
    ),
    "1_Pooling/config.json": '{"pooling_mode_mean_tokens": true}',
}
NOT_CARRIED = {  # weights of other formats, and folders convert does not know
    "pytorch_model.bin": "stale weights",
    "tf_model.h5": "stale weights",
    "training_args.bin": "pickle",
    "onnx/model.onnx": "exported weights",
    "extras/added_tokens.json": '{"<extra>": 64}',
}


@pytest.fixture
def source(llama_checkpoint, tmp_path) -> Path:
    """The tiny Llama saved sharded (index + shards), with tokenizer files, links and folders around it."""
    directory = tmp_path / "src"
    LlamaForCausalLM.from_pretrained(llama_checkpoint).save_pretrained(directory, max_shard_size="40KB")
    assert (directory / "model.safetensors.index.json").is_file()
    for name, content in {**CARRIED, **NOT_CARRIED}.items():
        (directory / name).parent.mkdir(exist_ok=True)
        (directory / name).write_text(content)
    os.symlink("extras/added_tokens.json", directory / "added_tokens.json")  # inside SRC: copied as a file
    (tmp_path / "outside.txt").write_text("not part of the checkpoint")
    os.symlink(tmp_path / "outside.txt", directory / "notes.txt")  # escapes SRC: never copied
    return directory


def test_convert_copies_non_weight_files_only(cli, source, tmp_path):
    destination = tmp_path / "dst"
    code, out, err = cli("convert", source, destination, "--fusion", "qkv,gate_up")
    assert code == 0, err

    files = {str(p.relative_to(destination)) for p in destination.rglob("*") if p.is_file()}
    assert files == {"config.json", "generation_config.json", "model.safetensors", "added_tokens.json", *CARRIED}
    for name in CARRIED:
        assert filecmp.cmp(source / name, destination / name, shallow=False), name
    copied = destination / "added_tokens.json"
    assert not copied.is_symlink() and copied.read_text() == (source / "extras/added_tokens.json").read_text()
    assert "copied from" in out and "tokenizer.json" in out
    assert err.startswith("modelpatch convert: note: not copied from")
    assert "extras/ (a subdirectory)" in err and "onnx/ (a subdirectory)" in err
    assert f"notes.txt (a symlink to {tmp_path / 'outside.txt'}, outside SRC)" in err
    assert "tf_model.h5" not in err  # weight files are left out without a note


def test_convert_replaces_links_in_an_existing_destination(cli, source, tmp_path):
    """A file kept from the previous DST that is a symlink is replaced, never written through."""
    destination = tmp_path / "dst"
    assert cli("convert", source, destination, "-q")[0] == 0
    target = tmp_path / "elsewhere.md"
    target.write_text("unrelated")
    (destination / "README.md").unlink()
    os.symlink(target, destination / "README.md")

    code, _, err = cli("convert", source, destination, "--force", "-q")
    assert code == 0 and err == ""  # -q: no note about the folders left out
    assert target.read_text() == "unrelated"
    assert not (destination / "README.md").is_symlink()
    assert (destination / "README.md").read_text() == CARRIED["README.md"]


def test_a_malformed_modules_json_is_bad_input_before_anything_is_written(cli, source, tmp_path):
    (source / "modules.json").write_text("[" * 50)
    code, out, err = cli("convert", source, tmp_path / "dst")
    assert code == 2 and "modules.json" in err and out == ""
    assert not (tmp_path / "dst").exists()
