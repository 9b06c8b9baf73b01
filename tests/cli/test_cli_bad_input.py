"""Bad input to ``modelpatch`` (called in-process): a message in words and exit code 2, never a traceback or a
silently incomplete result. Exit code 1 is kept for a failed verification."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import modelpatch
from support.compare import assert_same_files
from support.files import snapshot


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
    # Refused from the checkpoint's keys before the model is built: building 100000 layers took minutes.
    "config more layers than the checkpoint": (
        lambda d: edit_config(d, num_hidden_layers=100_000),
        "num_hidden_layers = 100000, but no tensor key of the checkpoint has an index above 1",
        ALL,
    ),
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


def _one_line(code: int, err: str, *needles: str) -> None:
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err


def test_a_patch_whose_replacement_cannot_be_built_from_the_original_arguments(cli, source):
    code, _, err = cli("plan", source, "--patch", "LlamaMLP=torch.nn:Linear")
    _one_line(code, err, "'LlamaMLP' replaces LlamaMLP by torch.nn.modules.linear.Linear", "(LlamaConfig)", "TypeError")


def test_demo_keep_that_cannot_be_a_directory(cli, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine")
    for keep in (a_file, a_file / "below"):
        code, _, err = cli("demo", "--keep", keep)
        _one_line(code, err, f"--keep {keep}: cannot make that directory")
    assert a_file.read_text() == "mine"


@pytest.mark.parametrize("option, value", [("--atol", "-1"), ("--atol", "nan"), ("--rtol", "inf"), ("--rtol", "-0.5")])
def test_verify_tolerances_that_pass_or_fail_everything_are_refused(cli, source, option, value):
    code, out, err = cli("verify", source, option, value)
    _one_line(code, err, f"{option} must be a finite number >= 0")
    assert out == ""


def test_convert_into_a_directory_containing_the_source_or_inside_it_is_refused(cli, tmp_path, llama_checkpoint):
    parent = tmp_path / "parent"
    source = parent / "src"
    shutil.copytree(llama_checkpoint, source)
    (parent / "notes.txt").write_text("unrelated")
    before = snapshot(parent)
    code, _, err = cli("convert", source, parent, "--force")
    _one_line(code, err, f"DST {parent} contains SRC")
    code, _, err = cli("convert", source, source / "converted")
    _one_line(code, err, "lies inside SRC")
    assert snapshot(parent) == before and sorted(os.listdir(parent)) == ["notes.txt", "src"]


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{missing}"],
        ["plan", "{missing}"],
        ["convert", "{missing}", "{tmp}/dst"],
        ["verify", "{source}", "--rtol", "inf"],
        ["demo", "--keep", "{source}/config.json"],
    ],
    ids=lambda args: args[0],
)
def test_stderr_of_a_fresh_process_is_the_error_line_alone(source, tmp_path, args):
    """Importing torch and transformers (torchao kernels that do not load, torch deprecation notes) printed warnings
    before every command's error."""
    values = {"missing": tmp_path / "missing", "tmp": tmp_path, "source": source}
    env = {**os.environ, "PYTHONPATH": str(Path(modelpatch.__file__).parents[1])}
    command = [sys.executable, "-m", "modelpatch.cli", *(arg.format(**values) for arg in args)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(f"modelpatch {args[0]}: error: "), result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize("command", ["plan", "convert", "verify"])
def test_a_patch_pattern_that_matches_the_model_class_is_one_line(cli, source, tmp_path, command):
    """``.*`` replaced LlamaForCausalLM itself by nn.Identity: an AttributeError traceback, exit code 1."""
    destination = tmp_path / "dst"
    args = [command, source, *([destination] if command == "convert" else []), "--patch", ".*=torch.nn:Identity"]
    code, out, err = cli(*args)
    _one_line(code, err, "'.*' replaces the model class LlamaForCausalLM itself by torch.nn.modules.linear.Identity")
    assert out == "" and not destination.exists()
