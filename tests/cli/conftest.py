"""Tiny checkpoints written by stock ``save_pretrained``, and ``modelpatch`` run in-process."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2MoeConfig, Qwen2MoeForCausalLM

from modelpatch.cli import main

SIZES = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

CliRun = Callable[..., tuple[int, str, str]]


@pytest.fixture(scope="session")
def llama_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "llama"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SIZES)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "qwen2_moe"
    torch.manual_seed(1)
    config = Qwen2MoeConfig(
        **SIZES, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16
    )
    Qwen2MoeForCausalLM(config).save_pretrained(path)
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
