"""Crash safety of saves: SIGKILL at random and at chosen moments, and a full disk.

A child process (``save_worker.py``) loads a ~54 MB Llama checkpoint with modelpatch, changes every weight and saves it
back over the same directory in several shards; it is killed with SIGKILL part-way (seeded random delays covering the
whole save, plus every phase of the writer), or runs under a file-size limit so that writes fail as on a full disk.
Afterwards the directory must hold one complete checkpoint, the previous one or (killed after the swap) the new one,
never a mix, and it loads with modelpatch to exactly those tensors; a later save to it succeeds and leaves no
``.<name>.modelpatch-tmp-*`` / ``-old-*`` siblings behind.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import modelpatch
from modelpatch.checkpoint import writer
from support.checkpoints import perturb
from support.compare import assert_bitwise_equal, bitwise_equal
from support.files import read_tensors, siblings, snapshot
from support.models import sized_config

pytestmark = [
    pytest.mark.reliability,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork, SIGKILL and RLIMIT_FSIZE (Linux)"),
]

SHARD = "6MB"
SHIFT = 0.5
SEED = 20240611
WORKER = Path(__file__).with_name("save_worker.py")


@pytest.fixture(scope="module")
def previous(tmp_path_factory) -> Path:
    """A ~54 MB fp32 Llama written by stock ``save_pretrained`` in ~6 MB shards: the checkpoint a save replaces."""
    config = sized_config(
        "llama", vocab=4096, hidden=512, intermediate=1024, layers=4, heads=8, kv_heads=4, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    perturb(model, 0)
    path = tmp_path_factory.mktemp("crash") / "previous"
    model.save_pretrained(path, max_shard_size=SHARD)
    (path / "tokenizer.json").write_text('{"user": "file"}')  # a file the save must carry over
    assert len(list(path.glob("model-*.safetensors"))) >= 6
    return path


@pytest.fixture(scope="module")
def versions(previous) -> dict[str, dict[str, torch.Tensor]]:
    old = read_tensors(previous)
    return {"previous": old, "new": {k: v + SHIFT for k, v in old.items()}}


class Worker:
    def __init__(self, log: Path):
        self.log = log
        with log.open("wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-u", str(WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        assert self.next_event()["event"] == "ready"

    def next_event(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.process.wait(timeout=30)
            tail = self.log.read_text(errors="replace")[-3000:]
            pytest.fail(f"save worker died (exit code {self.process.returncode}):\n{tail}")
        return json.loads(line)

    def save(self, directory: Path, **options) -> list[dict]:
        """One save of ``directory`` over itself; the events up to and including the child's exit."""
        command = {
            "source": str(directory),
            "target": str(directory),
            "shift": SHIFT,
            "max_shard_size": SHARD,
            **options,
        }
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        events = []
        while not events or events[-1]["event"] != "exit":
            events.append(self.next_event())
        assert events[-1]["started"], events
        return events

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker") / "stderr.log")
    yield w
    w.close()


@pytest.fixture(scope="module")
def save_seconds(worker, previous, tmp_path_factory, versions) -> float:
    """How long one uninterrupted save takes here (the random kill delays are fractions of it)."""
    directory = tmp_path_factory.mktemp("calibrate") / "ckpt"
    shutil.copytree(previous, directory)
    events = worker.save(directory)
    saved = [e for e in events if e["event"] == "saved"]
    assert saved and events[-1]["code"] == 0, events
    loaded = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    assert_bitwise_equal(loaded.state_dict(), versions["new"])
    assert siblings(directory) == []
    return saved[0]["seconds"]


def fresh_copy(previous: Path, tmp_path: Path) -> Path:
    directory = tmp_path / "ckpt"
    shutil.copytree(previous, directory)
    return directory


def assert_one_complete_version(directory: Path, versions) -> str:
    """The directory loads, with modelpatch, to exactly one of the two versions; returns which."""
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    state = model.state_dict()
    found = [name for name, tensors in versions.items() if bitwise_equal(state, tensors)]
    assert len(found) == 1, "the checkpoint is neither the previous nor the new one: a mix, or corrupt"
    assert (directory / "tokenizer.json").read_text() == '{"user": "file"}'
    assert (directory / "config.json").is_file() and (directory / "generation_config.json").is_file()
    return found[0]


def assert_next_save_recovers(directory: Path, expected: dict[str, torch.Tensor]) -> None:
    """A later save to the same directory succeeds, cleans up after the killed one and is loadable."""
    model = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    modelpatch.save_pretrained(model, directory, max_shard_size=SHARD)
    assert siblings(directory) == [], "a killed save's temporary files were left behind"
    assert not list(directory.glob(".*")), "temporary files inside the checkpoint"
    reloaded = modelpatch.from_pretrained(AutoModelForCausalLM, directory)
    assert_bitwise_equal(reloaded.state_dict(), expected)
    assert (directory / "tokenizer.json").read_text() == '{"user": "file"}'


def _random_delays() -> list[float]:
    """Seeded fractions of the save's duration: early, middle, late, and around the final swap."""
    rng = random.Random(SEED)
    return [rng.uniform(lo, hi) for lo, hi in ((0.02, 0.25), (0.25, 0.6), (0.6, 0.9), (0.9, 1.05))]


@pytest.mark.parametrize("fraction", _random_delays(), ids=lambda f: f"at{f:.0%}")
def test_sigkill_at_a_random_moment(worker, previous, versions, save_seconds, tmp_path, fraction):
    directory = fresh_copy(previous, tmp_path)
    events = worker.save(directory, kill_after=fraction * save_seconds)
    found = assert_one_complete_version(directory, versions)
    if events[-1]["signal"] != signal.SIGKILL:  # the save finished before the kill
        assert found == "new" and siblings(directory) == []
    assert_next_save_recovers(directory, versions[found])


KILL_POINTS = {
    # writer phase: the version the directory must hold after the kill
    "shard:1": "previous",  # before the first shard is written
    "shard:4": "previous",  # after three complete shards
    "before_swap": "previous",  # every file written and synced, not yet swapped in
    "after_exchange": "new",  # swapped in; the previous version not yet removed
    "removing_previous": "new",  # half of the previous version deleted
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_sigkill_at_each_phase_of_the_writer(worker, previous, versions, tmp_path, point):
    if point in ("after_exchange", "removing_previous") and writer._renameat2 is None:
        pytest.skip("no atomic directory exchange on this platform")
    directory = fresh_copy(previous, tmp_path)
    events = worker.save(directory, kill_at=point)
    assert events[-1]["signal"] == signal.SIGKILL, events
    assert siblings(directory), "a killed save leaves its temporary directory (removed by the next save)"
    assert assert_one_complete_version(directory, versions) == KILL_POINTS[point]
    assert_next_save_recovers(directory, versions[KILL_POINTS[point]])


def test_sigkill_between_the_two_renames_without_atomic_exchange(worker, previous, versions, tmp_path):
    """Without RENAME_EXCHANGE the swap is two renames; killed between them, the next save restores the previous one."""
    directory = fresh_copy(previous, tmp_path)
    events = worker.save(directory, kill_at="between_renames")
    assert events[-1]["signal"] == signal.SIGKILL, events
    assert not directory.exists()
    (old,) = [directory.parent / s for s in siblings(directory) if ".modelpatch-old-" in s]
    model = modelpatch.from_pretrained(AutoModelForCausalLM, old)  # complete, just under the sibling's name
    assert_bitwise_equal(model.state_dict(), versions["previous"])
    modelpatch.save_pretrained(model, directory, max_shard_size=SHARD)
    assert siblings(directory) == []
    assert assert_one_complete_version(directory, versions) == "previous"


@pytest.mark.parametrize("case", ["shard_too_big", "user_file_too_big"])
def test_full_disk_fails_cleanly(worker, previous, versions, tmp_path, case):
    directory = fresh_copy(previous, tmp_path)
    if case == "shard_too_big":
        limit, culprit = 3_000_000, directory / "model-00001-of-"
    else:
        # Every shard fits, but the previous checkpoint's own large file cannot be carried over.
        limit, culprit = 8_500_000, directory / "adapter_model.bin"
        culprit.write_bytes(b"\0" * (limit + 1))
    before = snapshot(directory)
    events = worker.save(directory, fsize=limit)
    errors = [e for e in events if e["event"] == "error"]
    assert events[-1]["code"] == 1 and errors, events
    assert errors[0]["type"] == "CheckpointError", errors
    assert str(culprit) in errors[0]["message"] and "too large" in errors[0]["message"].lower(), errors
    assert snapshot(directory) == before, "the previous checkpoint was modified"
    assert siblings(directory) == [], "a failed save left temporary files"
    assert assert_one_complete_version(directory, versions) == "previous"
    assert_next_save_recovers(directory, versions["previous"])
