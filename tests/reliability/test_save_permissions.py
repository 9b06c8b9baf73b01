"""Saves respect the permissions of the target and of its parent, and never strand a temporary or previous version.

A read-only directory says it must not change. The tests run as root, for whom every permission check passes, so the
unprivileged cases run in a forked child as user ``nobody``: there, before the writer checked permissions, a save over
a read-only checkpoint swapped it out and then could not delete it, leaving it in a hidden sibling for good.
"""

from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import modelpatch
from modelpatch.checkpoint import Checkpoint, write_checkpoint
from modelpatch.errors import CheckpointPermissionError
from support.files import read_tensors, siblings, snapshot

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="POSIX permission bits, fork and setuid"),
]

NOBODY = 65534
READ_ONLY = 0o555


def make_writable(path: Path) -> None:
    for root, dirs, _ in os.walk(path):
        for name in [root, *(os.path.join(root, d) for d in dirs)]:
            os.chmod(name, 0o755)


def as_unprivileged_user(function: Callable[[], None]) -> str | None:
    """Run ``function`` as an unprivileged user: ``nobody`` in a forked child when we are root.

    Returns ``"<exception type>: <message>"`` for what it raised, or None.
    """
    if os.geteuid() != 0:
        try:
            function()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then leave without running pytest's clean-up
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            try:
                function()
                report = ""
            except Exception as exc:
                report = f"{type(exc).__name__}: {exc}"
            os.write(write_end, report.encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        report = f.read().decode()
    os.waitpid(pid, 0)
    return report or None


@pytest.fixture
def unprivileged_root() -> Iterator[Path]:
    """A directory the unprivileged user owns (under /tmp: pytest's own temporary root is private to root)."""
    root = Path(tempfile.mkdtemp(prefix="modelpatch-permissions-", dir="/tmp"))
    if os.geteuid() == 0:
        os.chown(root, NOBODY, NOBODY)
    yield root
    make_writable(root)
    shutil.rmtree(root)


VERSION_1 = {"w": torch.arange(6.0)}
VERSION_2 = {"w": torch.arange(6.0) * 2}


def test_unprivileged_save_over_a_read_only_checkpoint_is_refused_and_strands_nothing(unprivileged_root):
    target = unprivileged_root / "ckpt"

    def save_twice() -> None:
        write_checkpoint(target, VERSION_1)
        target.chmod(READ_ONLY)
        write_checkpoint(target, VERSION_2)

    report = as_unprivileged_user(save_twice)
    assert report is not None and report.startswith("CheckpointPermissionError"), report
    assert str(target) in report and "dr-xr-xr-x" in report
    assert siblings(target) == []
    assert torch.equal(Checkpoint.open(target).tensor("w"), VERSION_1["w"])


def test_unprivileged_save_removes_leftovers_of_a_killed_save_even_with_read_only_folders(unprivileged_root):
    """A killed save left a temporary copy holding a read-only user folder: the next save still removes it."""
    target = unprivileged_root / "ckpt"

    def leave_leftovers_then_save() -> None:
        write_checkpoint(target, VERSION_1)
        for kind in ("tmp", "old"):
            notes = unprivileged_root / f".ckpt.modelpatch-{kind}-dead" / "notes"
            notes.mkdir(parents=True)
            (notes / "readme.md").write_text("kept read-only by its owner")
            notes.chmod(READ_ONLY)
        write_checkpoint(target, VERSION_2)

    assert as_unprivileged_user(leave_leftovers_then_save) is None
    assert siblings(target) == []
    assert torch.equal(Checkpoint.open(target).tensor("w"), VERSION_2["w"])


@pytest.fixture
def loaded_llama(stock):
    return modelpatch.from_pretrained(AutoModelForCausalLM, stock("llama").path)


@pytest.mark.parametrize("read_only", ["target", "parent", "folder inside the target"])
def test_save_pretrained_respects_read_only_directories_even_as_root(stock, loaded_llama, tmp_path, read_only):
    parent = tmp_path / "parent"
    target = parent / "ckpt"
    parent.mkdir()
    shutil.copytree(stock("llama").path, target)
    (target / "notes").mkdir()
    locked = {"target": target, "parent": parent, "folder inside the target": target / "notes"}[read_only]
    locked.chmod(READ_ONLY)
    before, parent_before = snapshot(target), sorted(os.listdir(parent))
    try:
        with torch.no_grad():
            loaded_llama.model.norm.weight.add_(1.0)
        with pytest.raises(CheckpointPermissionError) as info:
            modelpatch.save_pretrained(loaded_llama, target)
        assert isinstance(info.value, PermissionError) and isinstance(info.value, modelpatch.CheckpointError)
        assert str(info.value).startswith(f"{locked}: ")
        assert snapshot(target) == before
        assert sorted(os.listdir(parent)) == parent_before
    finally:
        locked.chmod(0o755)


def test_save_into_a_missing_directory_under_a_read_only_one_is_refused(loaded_llama, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(READ_ONLY)
    try:
        with pytest.raises(CheckpointPermissionError, match=f"^{locked}: "):
            modelpatch.save_pretrained(loaded_llama, locked / "new" / "ckpt")
        assert os.listdir(locked) == []
    finally:
        locked.chmod(0o755)


def test_a_writable_target_with_read_only_files_is_saved_over(stock, loaded_llama, tmp_path):
    """Files need no write permission to be replaced: only the directories holding them are checked."""
    target = tmp_path / "ckpt"
    shutil.copytree(stock("llama").path, target)
    (target / "tokenizer.json").write_text("{}")
    for file in target.iterdir():
        file.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    modelpatch.save_pretrained(loaded_llama, target)
    assert (target / "tokenizer.json").read_text() == "{}"
    assert sorted(read_tensors(target)) == sorted(read_tensors(stock("llama").path))
    assert siblings(target) == []
