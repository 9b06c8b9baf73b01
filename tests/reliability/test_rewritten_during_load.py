"""A checkpoint file rewritten in place while it is being loaded is refused, never read as a mix of two versions.

Each test lets a load validate the safetensors headers, then rewrites a file of a stock-saved checkpoint at a chosen
moment: between the header check and the first data read, or after the data was read but before the load returns.
A file *replaced* (a new file renamed over the name, as every atomic writer does) is not a change to the open file:
the load reads the version whose header it validated.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.loading import load as load_module
from support.compare import assert_bitwise_equal
from support.files import read_tensors
from support.refusals import refused_load

pytestmark = pytest.mark.reliability


def _other_version(file: Path, scratch: Path) -> bytes:
    """The bytes of ``file`` with every tensor changed: same keys, shapes and dtypes, hence the same size."""
    tensors = {key: (t + 1 if t.is_floating_point() else t) for key, t in load_file(str(file)).items()}
    save_file(tensors, str(scratch), metadata={"format": "pt"})
    content = scratch.read_bytes()
    assert len(content) == file.stat().st_size
    return content


def _rewrite_in_place(file: Path, content: bytes) -> None:
    """Overwrite ``file`` through its own inode, as ``open(file, "r+b").write`` in another process would."""
    inode = file.stat().st_ino
    with file.open("r+b") as f:
        f.write(content)
    assert file.stat().st_ino == inode


def _rewrite_keeping_size_and_mtime(file: Path, content: bytes) -> None:
    """What ``rsync --inplace -t`` or a rewrite followed by ``touch -r`` leaves: other bytes, same size and mtime."""
    before = file.stat()
    _rewrite_in_place(file, content)
    os.utime(file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = file.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


def _run_after(monkeypatch, name: str, action) -> None:
    """Run ``action()`` right after ``modelpatch.loading.load.<name>`` returns during the next load."""
    original = getattr(load_module, name)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        action()
        return result

    monkeypatch.setattr(load_module, name, wrapper)


@pytest.mark.parametrize("layout", ["llama", "llama_sharded"])
@pytest.mark.parametrize("moment", ["plan_model_load", "load_into_model"])
def test_file_rewritten_in_place_during_a_load_is_refused_naming_it(stock, tmp_path, monkeypatch, layout, moment):
    """``plan_model_load``: headers validated, no data read yet; ``load_into_model``: every tensor already read."""
    directory = tmp_path / "ckpt"
    shutil.copytree(stock(layout).path, directory)
    victim = sorted(directory.glob("*.safetensors"))[-1]
    content = _other_version(victim, tmp_path / "other.safetensors")
    _run_after(monkeypatch, moment, lambda: _rewrite_in_place(victim, content))
    assert str(victim) in refused_load(directory, "rewrote it in place")


@pytest.mark.parametrize("moment", ["plan_model_load", "load_into_model"])
def test_file_rewritten_with_its_size_and_mtime_restored_is_refused(stock, tmp_path, monkeypatch, moment):
    """Size and modification time can be set back; the status-change time cannot."""
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, directory)
    victim = directory / "model.safetensors"
    content = _other_version(victim, tmp_path / "other.safetensors")
    _run_after(monkeypatch, moment, lambda: _rewrite_keeping_size_and_mtime(victim, content))
    assert str(victim) in refused_load(directory, "rewrote it in place")


def test_pickle_file_rewritten_in_place_during_a_load_is_refused(stock, tmp_path, monkeypatch):
    directory = tmp_path / "bin"
    directory.mkdir()
    shutil.copy(stock("llama").path / "config.json", directory)
    victim = directory / "pytorch_model.bin"
    tensors = read_tensors(stock("llama").path)
    torch.save(tensors, victim)
    changed = {key: t + 1 for key, t in tensors.items()}
    _run_after(monkeypatch, "plan_model_load", lambda: torch.save(changed, victim))  # truncates and rewrites
    assert str(victim) in refused_load(directory, "rewrote it in place", allow_pickle=True)


def test_file_replaced_by_a_rename_during_a_load_gives_the_validated_version(stock, tmp_path, monkeypatch):
    """Not a false alarm: the load keeps reading the file it opened, which nobody changed."""
    directory = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, directory)
    victim = directory / "model.safetensors"
    replacement = tmp_path / "other.safetensors"
    _other_version(victim, replacement)
    _run_after(monkeypatch, "plan_model_load", lambda: os.replace(replacement, victim))
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    assert_bitwise_equal(model.state_dict(), read_tensors(stock("llama").path))
