"""Bad input to ``modelpatch`` (called in-process): a message in words and exit code 2, never a traceback or a
silently incomplete result. Exit code 1 is kept for a failed verification."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from support.compare import assert_same_files


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))


@pytest.fixture
def source(llama_checkpoint, tmp_path) -> Path:
    directory = tmp_path / "src"
    shutil.copytree(llama_checkpoint, directory)
    return directory


@pytest.mark.parametrize(
    "architectures, because",
    [(None, 'config.json has no "architectures"'), (["MyLlamaForCausalLM"], "which transformers does not have")],
)
def test_convert_keeps_every_tensor_or_fails_naming_the_dropped_ones(cli, source, tmp_path, architectures, because):
    """Falling back to AutoModel (no task head) would have written a checkpoint without ``lm_head.weight``."""
    edit_config(source, architectures=architectures)
    destination = tmp_path / "dst"
    code, _, err = cli("convert", source, destination)
    assert code == 2
    assert "lm_head.weight" in err and because in err
    assert "--model-class" in err and "LlamaForCausalLM" in err
    assert "Traceback" not in err
    assert not destination.exists()

    code, _, err = cli("convert", source, destination, "--model-class", "LlamaForCausalLM")
    assert code == 0, err
    assert_same_files(destination, source)


def test_model_class_must_be_a_transformers_model_class(cli, source, tmp_path):
    code, _, err = cli("plan", source, "--model-class", "LlamaConfig")
    assert code == 2 and "--model-class 'LlamaConfig'" in err and "LlamaForCausalLM" in err


@pytest.fixture
def pickle_source(source) -> Path:
    torch.save(load_file(str(source / "model.safetensors")), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    return source


@pytest.mark.parametrize("command", ["inspect", "plan", "verify"])
def test_pickle_checkpoints_name_the_flag_that_allows_them(cli, pickle_source, command):
    code, _, err = cli(command, pickle_source)
    assert code == 2 and "--allow-pickle" in err and "pytorch_model.bin" in err
    code, out, err = cli(command, pickle_source, "--allow-pickle")
    assert code == 0, err


def test_convert_of_a_pickle_checkpoint_with_the_flag(cli, pickle_source, tmp_path):
    code, _, err = cli("convert", pickle_source, tmp_path / "dst", "--allow-pickle")
    assert code == 0, err
    assert (tmp_path / "dst" / "model.safetensors").is_file()
    assert not (tmp_path / "dst" / "pytorch_model.bin").exists()  # the source's weights are replaced, not copied


def _write_over(directory: Path, name: str, content: str) -> None:
    (directory / name).write_text(content)


ALL = ("inspect", "plan", "convert", "verify")
BAD_SOURCES = {
    # case: (edit of the source, text the error must contain, commands that read what is broken)
    "config too large": (lambda d: _write_over(d, "config.json", "{" + " " * (16 * 2**20) + "}"), "limit", ALL),
    "config nested": (lambda d: edit_config(d, extra=json.loads("[" * 40 + "]" * 40)), "nested", ALL),
    "config huge count": (lambda d: edit_config(d, num_hidden_layers=300_000_000), "num_hidden_layers", ALL),
    "config zero heads": (lambda d: edit_config(d, num_attention_heads=0), "config.json", ALL),
    "config negative size": (lambda d: edit_config(d, intermediate_size=-3), "negative dimension", ALL),
    "weights header": (lambda d: _write_over(d, "model.safetensors", "\xff" * 64), "model.safetensors", ALL),
    "generation config": (
        lambda d: _write_over(d, "generation_config.json", "[" * 50_000),
        "generation_config.json",
        ("convert", "verify"),
    ),
}


@pytest.mark.parametrize(
    "case, command", [(case, command) for case, (_, _, commands) in BAD_SOURCES.items() for command in commands]
)
def test_bad_checkpoints_are_one_line_and_exit_code_2(cli, source, tmp_path, case, command):
    edit, needle, _ = BAD_SOURCES[case]
    edit(source)
    args = [command, source, *([tmp_path / "dst"] if command == "convert" else [])]
    code, out, err = cli(*args)
    assert code == 2
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert out == ""  # checked before anything is printed (inspect prints many lines once it has them all)


def test_bad_save_arguments_and_targets_exit_code_2(cli, source, tmp_path):
    code, _, err = cli("convert", source, tmp_path / "dst", "--max-shard-size", "lots")
    assert code == 2 and "max_shard_size 'lots'" in err
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        code, _, err = cli("convert", source, locked / "dst")
        assert code == 2 and str(locked) in err and "permissions" in err
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


def test_verify_of_a_patch_that_crashes_is_a_failed_verification(cli, source):
    code, out, err = cli("verify", source, "--patch", "LlamaMLP=cli_patches:CrashingMLP")
    assert code == 1, err
    assert "FAILED" in out and "patched model fails" in out and "Traceback" not in out + err
