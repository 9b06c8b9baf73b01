"""The checkpoint prefetch: reads a checkpoint's files into the page cache on background threads, changes nothing a
load gives, never fails a load, and its threads end."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import modelpatch
import modelpatch.checkpoint.prefetch as prefetch_module
from modelpatch.checkpoint import Checkpoint
from modelpatch.checkpoint.file_range import FileRange
from modelpatch.checkpoint.prefetch import (
    ENV_VAR,
    Prefetch,
    checkpoint_ranges,
    directory_prefetch,
    prefetch_mode,
    prefetching_directory,
    resident_fraction,
)
from support.compare import assert_bitwise_equal
from support.process import run_fresh

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore and posix_fadvise")


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("modelpatch-prefetch")]


def _join_prefetch_threads() -> None:
    for thread in _prefetch_threads():
        thread.join(30)
    assert not _prefetch_threads(), "a prefetch thread did not end"


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _big_file(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    tensors = {f"layers.{i}.weight": torch.full((256, 1024), float(i)) for i in range(12)}  # 12 MiB
    save_file(tensors, tmp_path / "model.safetensors")
    return tmp_path / "model.safetensors"


@pytest.fixture(autouse=True)
def _prefetch_on(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "1")


def test_prefetch_mode(monkeypatch):
    monkeypatch.delenv(ENV_VAR)
    assert prefetch_mode() == "auto"
    for value, mode in (("on", "on"), ("1", "on"), ("0", "off"), ("no", "off"), ("auto", "auto"), ("bogus", "auto")):
        monkeypatch.setenv(ENV_VAR, value)
        assert prefetch_mode() == mode


def test_prefetch_reads_the_files_into_the_page_cache(tmp_path):
    path = _big_file(tmp_path)
    _evict(path)
    if resident_fraction(path) > 0.5:
        pytest.skip("this file system keeps the file cached (posix_fadvise(DONTNEED) is only a hint)")
    with Checkpoint.open(tmp_path) as checkpoint:
        ranges = checkpoint_ranges(checkpoint)
        # Natural order: layer 2 before layer 10, whatever the order of the keys in the file.
        assert [r.start for r in ranges] == [checkpoint.file_range(f"layers.{i}.weight").start for i in range(12)]
        prefetch = Prefetch.start(ranges)
        assert prefetch is not None
    prefetch.join(30)  # it goes on after the checkpoint is closed: it reads its own descriptors
    assert not prefetch.alive() and prefetch.error is None
    assert 0 < prefetch.read_bytes <= sum(r.length for r in ranges)  # chunks still cached are skipped
    assert resident_fraction(path) > 0.99

    # Resident now: a second prefetch skips the chunks still all resident (one mincore per chunk), which on a machine
    # under memory pressure may not be every one.
    with Checkpoint.open(tmp_path) as checkpoint:
        again = Prefetch.start(checkpoint_ranges(checkpoint), chunk_bytes=2**20)
    assert again is not None
    again.join(30)
    assert again.read_bytes <= 2 * 2**20


def test_a_load_with_prefetch_gives_the_same_model_and_its_threads_end(stock_checkpoint, monkeypatch):
    ckpt = stock_checkpoint("llama_sharded")
    for file in ckpt.files:
        _evict(file)
    prefetched = ckpt.load()
    _join_prefetch_threads()
    monkeypatch.setenv(ENV_VAR, "0")
    plain = ckpt.load()
    assert not _prefetch_threads()
    assert_bitwise_equal(prefetched.state_dict(), plain.state_dict())
    assert_bitwise_equal(prefetched.state_dict(), ckpt.stock().state_dict())


def test_a_failing_prefetch_does_not_fail_the_load(stock_checkpoint, monkeypatch, caplog):
    ckpt = stock_checkpoint("llama")
    failed = threading.Event()

    def failing_read(*args):
        failed.set()
        raise OSError(5, "Input/output error")

    # The read every chunk goes through fails (as a read of a failing disk does); resident chunks are not read.
    monkeypatch.setattr(prefetch_module, "_read", failing_read)
    monkeypatch.setattr(prefetch_module._File, "resident", lambda self, start, length: False)
    with caplog.at_level("DEBUG", logger="modelpatch.checkpoint.prefetch"):
        model = modelpatch.from_pretrained(ckpt.model_class, ckpt.path)
        _join_prefetch_threads()
    assert failed.is_set()
    assert "checkpoint prefetch stopped: [Errno 5] Input/output error" in caplog.text
    assert_bitwise_equal(model.state_dict(), ckpt.stock().state_dict())


def test_prefetch_errors_are_kept_not_raised(tmp_path):
    # A descriptor that is no file: the prefetch cannot start, and says so by returning None.
    assert Prefetch.start([FileRange(tmp_path / "gone", -1, 0, 4096)]) is None
    assert Prefetch.start([]) is None
    # A descriptor whose reads fail (a directory: EISDIR): the threads stop at the first error and keep it.
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        prefetch = Prefetch.start([FileRange(tmp_path, fd, 0, 3 * prefetch_module.CHUNK_BYTES)])
        assert prefetch is not None
        prefetch.join(30)
    finally:
        os.close(fd)
    assert not prefetch.alive()
    assert isinstance(prefetch.error, IsADirectoryError)
    assert prefetch.read_bytes == 0


def test_a_failed_load_stops_the_prefetch(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("llama")
    with pytest.raises(modelpatch.LoadPlanError):
        modelpatch.from_pretrained(ckpt.model_class, ckpt.path, fusion_config={"qkv": True}, config=_other_config(ckpt))
    _join_prefetch_threads()


def _other_config(ckpt):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt.path)
    config.hidden_size *= 2  # every weight's shape differs from the checkpoint's
    return config


def test_the_headers_alone_give_the_load_s_ranges_in_natural_key_order(stock_checkpoint):
    """The early prefetch reads the headers without torch: the same byte ranges as the checkpoint's, in the same
    (natural key) order across the shards."""
    ckpt = stock_checkpoint("llama_sharded")
    prefetch = directory_prefetch(ckpt.path)
    assert prefetch is not None
    prefetch.stop()
    with Checkpoint.open(ckpt.path) as checkpoint:
        expected = [(r.path, r.start, r.length) for r in checkpoint_ranges(checkpoint)]
        assert prefetch.reads(checkpoint.files)
        assert len({r[0] for r in expected}) > 1
    from modelpatch.checkpoint.prefetch import _natural_order, _safetensors_ranges, safetensors_files

    found = []
    for path in safetensors_files(ckpt.path):
        fd = os.open(path, os.O_RDONLY)
        try:
            found += _safetensors_ranges(path, fd)
        finally:
            os.close(fd)
    assert [(r.path, r.start, r.length) for r in _natural_order(found)] == expected


def test_the_auto_class_starts_the_prefetch_before_torch_or_transformers_is_imported(stock_checkpoint, tmp_path):
    ckpt = stock_checkpoint("llama")
    script = (
        "import sys, threading\n"
        "import modelpatch.checkpoint.prefetch as p\n"
        "seen = []\n"
        "start = p.Prefetch.start.__func__\n"
        "def recording(cls, *args, **kwargs):\n"
        "    seen.append(('torch' in sys.modules, 'transformers' in sys.modules))\n"
        "    return start(cls, *args, **kwargs)\n"
        "p.Prefetch.start = classmethod(recording)\n"
        "from modelpatch import AutoModelForCausalLM\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
        "model = AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
        "print(seen)\n"
    )
    result = run_fresh(script, str(ckpt.path), unset=[ENV_VAR])
    # One prefetch, started before torch and transformers were imported, and adopted by the load.
    assert result.stdout.strip().splitlines()[-1] == "[(False, False)]"


def test_a_failed_auto_class_load_stops_its_prefetch(stock_checkpoint, monkeypatch):
    ckpt = stock_checkpoint("llama")
    release = threading.Event()
    started: list[Prefetch] = []
    original = prefetch_module.directory_prefetch

    def recorded(directory, **settings):
        prefetch = original(directory, **settings)
        started.append(prefetch)
        return prefetch

    monkeypatch.setattr(prefetch_module, "_read", lambda *args: release.wait(60))  # a hung disk
    monkeypatch.setattr(prefetch_module._File, "resident", lambda self, start, length: False)
    monkeypatch.setattr(prefetch_module, "directory_prefetch", recorded)
    monkeypatch.setattr(prefetch_module, "STOP_WAIT_SECONDS", 0.5)
    from modelpatch import AutoModelForCausalLM as PatchedAuto

    began = time.monotonic()
    with pytest.raises(modelpatch.LoadPlanError):
        try:
            PatchedAuto.from_pretrained(ckpt.path, fusion_config={"qkv": True}, config=_other_config(ckpt))
        finally:
            # The error came while the read still hung: the stop waited its bounded time, not for the read.
            assert started and started[0] is not None and started[0].alive()
            release.set()
    assert time.monotonic() - began < 30
    assert len(started) == 1 and started[0].stopped
    _join_prefetch_threads()


def test_no_prefetch_for_partial_reads_or_when_turned_off(stock_checkpoint, monkeypatch):
    ckpt = stock_checkpoint("llama")
    from modelpatch.auto import _prefetched_directory

    assert _prefetched_directory(ckpt.path, {}) == ckpt.path
    assert _prefetched_directory(ckpt.path, {"device_map": {"": "cpu"}}) is None
    assert _prefetched_directory(ckpt.path, {"tp_plan": "auto"}) is None
    assert _prefetched_directory(object(), {}) is None
    monkeypatch.setenv(ENV_VAR, "0")
    with prefetching_directory(ckpt.path) as prefetch:
        assert prefetch is None


@pytest.mark.parametrize("linked", ["index", "shard"])
def test_no_file_a_link_takes_outside_the_checkpoint_is_prefetched(stock_checkpoint, tmp_path, caplog, linked):
    """The load refuses an index or shard that a symlink takes outside the checkpoint folder (unless
    allow_external_symlinks): the prefetch, which starts before the load, reads none of it either."""
    source = stock_checkpoint("llama_sharded").path
    outside, directory = tmp_path / "outside", tmp_path / "ckpt"
    shutil.copytree(source, outside)
    shutil.copytree(source, directory)
    name = "model.safetensors.index.json" if linked == "index" else sorted(p.name for p in source.glob("model-*"))[-1]
    (directory / name).unlink()
    (directory / name).symlink_to(outside / name)
    with prefetching_directory(directory) as prefetch:
        assert prefetch is None
    with pytest.raises(modelpatch.CheckpointError, match="symlink"):
        Checkpoint.open(directory)
    with prefetching_directory(directory, allow_external_symlinks=True) as prefetch:
        assert prefetch is not None
        prefetch.stop()
    with Checkpoint.open(directory, allow_external_symlinks=True) as checkpoint:
        assert prefetch.reads(checkpoint.files)
    # The Auto classes start it with the load's setting.
    from modelpatch import AutoModelForCausalLM as PatchedAuto

    with caplog.at_level(logging.DEBUG, logger=prefetch_module.__name__):
        with pytest.raises(modelpatch.CheckpointError, match="symlink"):
            PatchedAuto.from_pretrained(directory)
        assert not any("prefetch started" in r.getMessage() for r in caplog.records)
        PatchedAuto.from_pretrained(directory, allow_external_symlinks=True)
        assert any("prefetch started" in r.getMessage() for r in caplog.records)
    _join_prefetch_threads()


def test_the_prefetch_adds_nothing_to_the_process_memory(tmp_path):
    from safetensors.torch import save_file

    save_file({f"layers.{i}.weight": torch.ones(1024, 1024) for i in range(16)}, tmp_path / "model.safetensors")
    _evict(tmp_path / "model.safetensors")
    if resident_fraction(tmp_path / "model.safetensors") > 0.5:
        pytest.skip("this file system keeps the file cached (posix_fadvise(DONTNEED) is only a hint)")

    def rss() -> int:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))

    before = rss()
    prefetch = directory_prefetch(tmp_path)
    assert prefetch is not None
    prefetch.join(30)
    assert prefetch.read_bytes >= 32 * 2**20  # 64 MiB file, most of it read
    assert rss() - before < 8 * 2**20


def test_a_prefetch_still_reading_stops_when_the_interpreter_exits(tmp_path):
    # A sparse file (its holes read as zeros, nothing on disk) far larger than what the thread reads before the
    # script's last line: the thread is still reading when the interpreter starts to exit. The check runs in an atexit
    # handler registered before modelpatch is imported, so after modelpatch's own.
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(512 * 2**20)
    script = (
        "import atexit, os, sys\n"
        "def check():\n"
        "    print('stopped at exit:', prefetch.stopped)\n"
        "    prefetch.join(10)\n"
        "    print('alive after:', prefetch.alive())\n"
        "atexit.register(check)\n"
        "from modelpatch.checkpoint.file_range import FileRange\n"
        "from modelpatch.checkpoint.prefetch import Prefetch\n"
        "fd = os.open(sys.argv[1], os.O_RDONLY)\n"
        "ranges = [FileRange(sys.argv[1], fd, start, 2**20) for start in range(0, 512 * 2**20, 2**20)]\n"
        "prefetch = Prefetch.start(ranges, chunk_bytes=2**20)\n"
        "assert prefetch is not None and prefetch.alive()\n"
    )
    out = run_fresh(script, str(tmp_path / "big.bin")).stdout.split("\n")
    assert "stopped at exit: True" in out
    assert "alive after: False" in out
