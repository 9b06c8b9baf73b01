"""Shared test fixtures: every test starts and ends with the process-wide registries as they were.

The patch registry is emptied; every registry (which tests extend or overwrite, built-in fusions included) is
restored to its contents before the test (``modelpatch.testing.scoped_registries``). No test may reach the network:
the hub is offline.
"""

from __future__ import annotations

import os

import huggingface_hub.constants
import pytest
import torch
import transformers

import modelpatch
from modelpatch.checkpoint import Checkpoint
from modelpatch.testing import scoped_registries
from support.checkpoints import STOCK_CHECKPOINTS, CheckpointFactory

transformers.logging.set_verbosity_error()

# Subprocesses (the CLI tests) read the variable; this process's huggingface_hub read it at import already.
os.environ["HF_HUB_OFFLINE"] = "1"
huggingface_hub.constants.HF_HUB_OFFLINE = True


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``tiny("llama")`` -> a :class:`TinyCheckpoint` written by stock ``save_pretrained`` (built once per session)."""
    return CheckpointFactory(tmp_path_factory.mktemp("tiny_checkpoints"))


@pytest.fixture(scope="session")
def stock_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``stock_checkpoint("llama")`` -> a wider :class:`TinyCheckpoint` of ``STOCK_CHECKPOINTS`` (once per session).

    Shared by the loader and the reliability tests: tests that damage a checkpoint copy it first.
    """
    return CheckpointFactory(tmp_path_factory.mktemp("stock"), STOCK_CHECKPOINTS)


@pytest.fixture(autouse=True)
def _restore_registries():
    modelpatch.clear_patch_mapping()
    with scoped_registries():
        yield


# torch 2.6's dynamo cannot trace transformers' output capturing: a stock LlamaForCausalLM fails to compile there
# (NameError: name 'torch' is not defined, in transformers.utils.output_capturing; measured with transformers 5.15.1,
# while torch 2.11 compiles it). The tests that run torch.compile (marked slow) have nothing to compare against there.
_STOCK_CANNOT_COMPILE = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) == (2, 6)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _STOCK_CANNOT_COMPILE:
        skip = pytest.mark.skip(reason=f"torch {torch.__version__} cannot compile stock transformers models")
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(skip)


@pytest.fixture
def no_tensor_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A test during which reading any checkpoint tensor fails: what is refused must be refused from the headers."""

    def refuse(self, key):
        raise AssertionError(f"tensor {key!r} was read")

    monkeypatch.setattr(Checkpoint, "tensor", refuse)
