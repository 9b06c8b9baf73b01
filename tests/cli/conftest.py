"""Tiny checkpoints written by stock ``save_pretrained``, and ``modelpatch`` run in-process."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, Qwen2MoeForCausalLM

from modelpatch.cli import main
from support.models import tiny_config

CliRun = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config("llama")).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "qwen2_moe"
    torch.manual_seed(1)
    Qwen2MoeForCausalLM(tiny_config("qwen2_moe", shared_expert_intermediate_size=16)).save_pretrained(path)
    return path


@pytest.fixture
def cli(capsys, monkeypatch) -> CliRun:
    """``cli("convert", src, dst)`` -> (exit code, stdout, stderr) of ``modelpatch`` called in-process.

    ``--patch`` specs name classes of ``cli_patches``, importable because pytest puts this folder on ``sys.path``;
    ``sys.path`` is restored afterwards (``--import`` adds the current directory to it).
    """
    monkeypatch.setattr(sys, "path", [*sys.path])

    def run(*args: str | Path) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main([str(a) for a in args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    return run
